// The paged KV cache's block allocator: a free list of block ids with reference counts.
// A sequence owns a list of blocks (its block-table row); block i holds its tokens
// [i * block_size, (i + 1) * block_size). Prefix sharing gives several sequences the same
// blocks (refcount > 1); a sequence about to write into a shared block first gets a private
// copy (copy-on-write: the allocator hands out the new block and reports the (src, dst) pair,
// the engine copies the data with flashserve::copy_blocks).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace serving {

// The pool has fewer free blocks than an operation needs; nothing was changed.
class OutOfBlocks : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using BlockList = std::vector<int32_t>;  // one sequence's block-table row

struct CowCopy {
  int32_t src = 0, dst = 0;  // copy block src's data to block dst
};

class BlockAllocator {
 public:
  BlockAllocator(int32_t num_blocks, int32_t block_size);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return int32_t(ref_.size()); }
  int32_t num_free() const { return int32_t(free_.size()); }
  int32_t refcount(int32_t block) const;
  // Blocks holding `tokens` tokens.
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // One block with refcount 1. Throws OutOfBlocks when the pool is empty.
  int32_t allocate();
  // Another owner of an allocated block.
  void retain(int32_t block);
  // One owner fewer; the block returns to the free list at refcount 0. Throws
  // std::logic_error for a block that is not allocated.
  void release(int32_t block);

  // Free blocks that prepare_write(blocks, begin, end) would take: new blocks to cover `end`
  // tokens plus one copy per shared block among those that positions [begin, end) touch.
  int64_t blocks_needed(const BlockList& blocks, int64_t begin, int64_t end) const;
  // Makes positions [begin, end) writable: grows `blocks` to cover `end` tokens and replaces
  // each shared block they touch by a private copy, appending (old, new) to `copies`.
  // Throws OutOfBlocks, changing nothing, when the pool lacks blocks_needed().
  void prepare_write(BlockList& blocks, int64_t begin, int64_t end, std::vector<CowCopy>& copies);
  // A new owner of the blocks covering the first `num_tokens` tokens of `blocks`.
  BlockList share(const BlockList& blocks, int64_t num_tokens);
  // Releases every block of the list and empties it.
  void free_all(BlockList& blocks);

 private:
  int32_t block_size_;
  std::vector<int32_t> free_;  // stack of free block ids
  std::vector<int32_t> ref_;   // [num_blocks] reference counts
};

}  // namespace serving
