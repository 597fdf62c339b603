// Validation of the KV-cache maintenance calls (cache.hpp): shapes, dtypes and devices first
// (no tensor contents read), then, for CPU calls, the contents that index memory (slots, block
// indices, sequence lengths). Everything throws flashserve::Error naming the argument before
// any write.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>

#include "common/check.hpp"
#include "problem/cache.hpp"
#include "flashserve/cache.hpp"
#include "flashserve/tensor.hpp"

namespace flashserve::detail {

CacheWriteProblem validate_cache_write(const CacheWriteParams& p);
// CPU contents: every slot < num_blocks * block_size (negative slots are skipped).
void check_cache_write_contents(const CacheWriteProblem& pr);

// copy_blocks: caches share num_blocks and device; block_mapping int64 [n, 2] on that device.
Device validate_copy_blocks(std::span<const TensorRef> caches, const TensorRef& block_mapping);
// swap_blocks: same dtype and block shape; block_mapping int64 [n, 2] on the CPU. Returns
// whether either cache is on a CUDA device.
bool validate_swap_blocks(const TensorRef& src, const TensorRef& dst, const TensorRef& block_mapping);
// CPU contents: 0 <= src < src_blocks and 0 <= dst < dst_blocks in every row.
void check_block_mapping(const TensorRef& block_mapping, int64_t src_blocks, int64_t dst_blocks);

Device validate_advance_step(const AdvanceStepParams& p);
// CPU contents: 0 <= seq_lens[i] < INT32_MAX and every next position's block within the row.
void check_advance_step_contents(const AdvanceStepParams& p);

Device validate_quantize_int8(const TensorRef& x, const TensorRef& out, const TensorRef& scale);

}  // namespace flashserve::detail
