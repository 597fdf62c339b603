// Block allocator (block_allocator.hpp): free-list stack, reference counts, copy-on-write.
#include "block_allocator.hpp"

#include <algorithm>
#include <string>

namespace serving {

namespace {

[[noreturn]] void bad_block(const char* what, int32_t block) {
  throw std::logic_error(std::string(what) + ": block " + std::to_string(block) + " is not allocated");
}

}  // namespace

BlockAllocator::BlockAllocator(int32_t num_blocks, int32_t block_size) : block_size_(block_size) {
  if (num_blocks < 1 || block_size < 1) throw std::invalid_argument("BlockAllocator: expected num_blocks, block_size >= 1");
  ref_.assign(size_t(num_blocks), 0);
  free_.resize(size_t(num_blocks));
  // Stack top is block 0: a fresh pool hands out 0, 1, 2, ...; freed blocks are reused first.
  for (int32_t i = 0; i < num_blocks; ++i) free_[size_t(i)] = num_blocks - 1 - i;
}

int32_t BlockAllocator::refcount(int32_t block) const {
  if (block < 0 || block >= num_blocks()) throw std::out_of_range("refcount: block " + std::to_string(block));
  return ref_[size_t(block)];
}

int32_t BlockAllocator::allocate() {
  if (free_.empty()) throw OutOfBlocks("KV cache: all " + std::to_string(num_blocks()) + " blocks in use");
  const int32_t b = free_.back();
  free_.pop_back();
  ref_[size_t(b)] = 1;
  return b;
}

void BlockAllocator::retain(int32_t block) {
  if (block < 0 || block >= num_blocks() || ref_[size_t(block)] == 0) bad_block("retain", block);
  ++ref_[size_t(block)];
}

void BlockAllocator::release(int32_t block) {
  if (block < 0 || block >= num_blocks() || ref_[size_t(block)] == 0) bad_block("release", block);
  if (--ref_[size_t(block)] == 0) free_.push_back(block);
}

int64_t BlockAllocator::blocks_needed(const BlockList& blocks, int64_t begin, int64_t end) const {
  if (end <= begin) return 0;
  const int64_t have = int64_t(blocks.size());
  int64_t need = std::max<int64_t>(0, blocks_for(end) - have);
  for (int64_t i = begin / block_size_; i < std::min(have, blocks_for(end)); ++i)
    if (ref_[size_t(blocks[size_t(i)])] > 1) ++need;
  return need;
}

void BlockAllocator::prepare_write(BlockList& blocks, int64_t begin, int64_t end, std::vector<CowCopy>& copies) {
  if (end <= begin) return;
  const int64_t need = blocks_needed(blocks, begin, end);
  if (need > num_free())
    throw OutOfBlocks("KV cache: " + std::to_string(need) + " blocks needed, " + std::to_string(num_free()) + " free");
  const int64_t have = int64_t(blocks.size());
  for (int64_t i = begin / block_size_; i < std::min(have, blocks_for(end)); ++i) {
    int32_t& b = blocks[size_t(i)];
    if (ref_[size_t(b)] == 1) continue;
    const int32_t copy = allocate();
    copies.push_back({b, copy});
    release(b);
    b = copy;
  }
  while (int64_t(blocks.size()) < blocks_for(end)) blocks.push_back(allocate());
}

BlockList BlockAllocator::share(const BlockList& blocks, int64_t num_tokens) {
  const int64_t n = blocks_for(num_tokens);
  if (n > int64_t(blocks.size())) throw std::invalid_argument("share: fewer blocks than num_tokens needs");
  BlockList out(blocks.begin(), blocks.begin() + n);
  for (int32_t b : out) retain(b);
  return out;
}

void BlockAllocator::free_all(BlockList& blocks) {
  for (int32_t b : blocks) release(b);
  blocks.clear();
}

}  // namespace serving
