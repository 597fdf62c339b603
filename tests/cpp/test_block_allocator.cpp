// The serving demo's block allocator (examples/serving/block_allocator.hpp): reference counts,
// prefix sharing, copy-on-write, exhaustion, and no leak after a random workload.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "block_allocator.hpp"
#include "support/host_tensor.hpp"

namespace {

using serving::BlockAllocator;
using serving::BlockList;
using serving::CowCopy;
using serving::OutOfBlocks;

// Every block is either free or referenced exactly refcount times by `owners`.
void expect_consistent(const BlockAllocator& a, const std::vector<const BlockList*>& owners) {
  std::map<int32_t, int32_t> refs;
  for (const BlockList* o : owners)
    for (int32_t b : *o) ++refs[b];
  int32_t used = 0;
  for (int32_t b = 0; b < a.num_blocks(); ++b) {
    const int32_t want = refs.count(b) ? refs[b] : 0;
    ASSERT_EQ(a.refcount(b), want) << "block " << b;
    used += want > 0;
  }
  EXPECT_EQ(a.num_free() + used, a.num_blocks());
}

TEST(BlockAllocator, AllocateReleaseRefcounts) {
  BlockAllocator a(4, 16);
  EXPECT_EQ(a.num_free(), 4);
  const int32_t b0 = a.allocate(), b1 = a.allocate();
  EXPECT_NE(b0, b1);
  EXPECT_EQ(a.refcount(b0), 1);
  a.retain(b0);
  EXPECT_EQ(a.refcount(b0), 2);
  a.release(b0);
  EXPECT_EQ(a.refcount(b0), 1);
  EXPECT_EQ(a.num_free(), 2);
  a.release(b0);
  EXPECT_EQ(a.refcount(b0), 0);
  EXPECT_EQ(a.num_free(), 3);
  EXPECT_THROW(a.release(b0), std::logic_error);  // already free
  EXPECT_THROW(a.retain(b0), std::logic_error);
  EXPECT_THROW(a.release(99), std::logic_error);
  EXPECT_EQ(a.allocate(), b0);  // freed blocks are reused first
  EXPECT_THROW(BlockAllocator(0, 16), std::invalid_argument);
}

TEST(BlockAllocator, PrepareWriteGrowsToCoverTokens) {
  BlockAllocator a(8, 16);
  BlockList seq;
  std::vector<CowCopy> copies;
  EXPECT_EQ(a.blocks_needed(seq, 0, 17), 2);
  a.prepare_write(seq, 0, 17, copies);
  EXPECT_EQ(seq.size(), 2u);
  a.prepare_write(seq, 17, 32, copies);  // still within block 1
  EXPECT_EQ(seq.size(), 2u);
  a.prepare_write(seq, 32, 33, copies);
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_TRUE(copies.empty());
  a.prepare_write(seq, 40, 40, copies);  // empty range: nothing
  EXPECT_EQ(seq.size(), 3u);
  expect_consistent(a, {&seq});
}

TEST(BlockAllocator, PrefixSharingAndCopyOnWrite) {
  BlockAllocator a(16, 16);
  BlockList leader;
  std::vector<CowCopy> copies;
  a.prepare_write(leader, 0, 40, copies);  // 40 tokens: blocks 0, 1 full, block 2 partial
  ASSERT_EQ(leader.size(), 3u);
  BlockList member = a.share(leader, 40);
  EXPECT_EQ(member, leader);
  for (int32_t b : leader) EXPECT_EQ(a.refcount(b), 2);
  BlockList short_share = a.share(leader, 32);  // whole blocks only: 2
  EXPECT_EQ(short_share.size(), 2u);
  EXPECT_EQ(a.refcount(leader[0]), 3);
  EXPECT_THROW(a.share(leader, 49), std::invalid_argument);

  // The member writes token 40 (into the shared partial block 2): one copy, its own block.
  EXPECT_EQ(a.blocks_needed(member, 40, 41), 1);
  a.prepare_write(member, 40, 41, copies);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, leader[2]);
  EXPECT_EQ(copies[0].dst, member[2]);
  EXPECT_NE(member[2], leader[2]);
  EXPECT_EQ(a.refcount(leader[2]), 1);
  EXPECT_EQ(a.refcount(member[2]), 1);
  EXPECT_EQ(member[0], leader[0]);
  EXPECT_EQ(member[1], leader[1]);

  // Writing across shared full blocks copies each one; growth past the end adds a block.
  copies.clear();
  EXPECT_EQ(a.blocks_needed(short_share, 10, 40), 2 + 1);
  a.prepare_write(short_share, 10, 40, copies);
  EXPECT_EQ(copies.size(), 2u);
  EXPECT_EQ(short_share.size(), 3u);
  expect_consistent(a, {&leader, &member, &short_share});

  a.free_all(leader);
  a.free_all(member);
  a.free_all(short_share);
  EXPECT_TRUE(leader.empty());
  EXPECT_EQ(a.num_free(), 16);
}

TEST(BlockAllocator, ExhaustionThrowsAndChangesNothing) {
  BlockAllocator a(3, 4);
  BlockList s1, s2;
  std::vector<CowCopy> copies;
  a.prepare_write(s1, 0, 8, copies);  // 2 blocks
  EXPECT_THROW(a.prepare_write(s2, 0, 12, copies), OutOfBlocks);  // needs 3, 1 free
  EXPECT_TRUE(s2.empty());
  EXPECT_EQ(a.num_free(), 1);
  // Copy-on-write also needs a free block: share s1, take the last block, then write.
  BlockList shared = a.share(s1, 8);
  BlockList last;
  a.prepare_write(last, 0, 1, copies);
  EXPECT_EQ(a.num_free(), 0);
  const BlockList before = shared;
  EXPECT_THROW(a.prepare_write(shared, 0, 1, copies), OutOfBlocks);
  EXPECT_EQ(shared, before);
  EXPECT_TRUE(copies.empty());
  EXPECT_THROW(a.allocate(), OutOfBlocks);
  expect_consistent(a, {&s1, &shared, &last});
}

// Sequences come and go: fresh ones, forks of a live one (prefix sharing), appends (with
// copy-on-write), releases. Refcounts always match the owners; nothing leaks at the end.
TEST(BlockAllocator, RandomWorkloadNoLeaks) {
  auto rng = fstest::make_rng(0xb10c);
  BlockAllocator a(64, 8);
  struct Seq {
    BlockList blocks;
    int64_t len = 0;
  };
  std::vector<Seq> live;
  std::uniform_int_distribution<int> op(0, 9), len(1, 40);
  int64_t cow = 0, exhausted = 0;
  for (int it = 0; it < 4000; ++it) {
    const int o = op(rng);
    try {
      if (o < 2 || live.empty()) {
        Seq s;
        std::vector<CowCopy> copies;
        s.len = len(rng);
        a.prepare_write(s.blocks, 0, s.len, copies);
        live.push_back(std::move(s));
      } else if (o < 4) {
        const Seq& src = live[rng() % live.size()];
        Seq s;
        s.len = std::uniform_int_distribution<int64_t>(0, src.len)(rng);
        s.blocks = a.share(src.blocks, s.len);
        live.push_back(std::move(s));
      } else if (o < 8) {
        Seq& s = live[rng() % live.size()];
        std::vector<CowCopy> copies;
        const int64_t n = len(rng) / 4 + 1;
        const BlockList before = s.blocks;
        a.prepare_write(s.blocks, s.len, s.len + n, copies);
        for (const CowCopy& c : copies) {
          EXPECT_NE(std::find(before.begin(), before.end(), c.src), before.end());
          EXPECT_EQ(a.refcount(c.dst), 1);
        }
        cow += int64_t(copies.size());
        s.len += n;
      } else {
        const size_t i = rng() % live.size();
        a.free_all(live[i].blocks);
        live.erase(live.begin() + int64_t(i));
      }
    } catch (const OutOfBlocks&) {
      ++exhausted;
    }
    if (it % 50 == 0) {
      std::vector<const BlockList*> owners;
      for (const Seq& s : live) owners.push_back(&s.blocks);
      expect_consistent(a, owners);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GT(cow, 0);
  EXPECT_GT(exhausted, 0);
  for (Seq& s : live) a.free_all(s.blocks);
  EXPECT_EQ(a.num_free(), a.num_blocks());
  for (int32_t b = 0; b < a.num_blocks(); ++b) EXPECT_EQ(a.refcount(b), 0);
}

}  // namespace
