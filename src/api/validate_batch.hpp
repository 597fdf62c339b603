// Validation of an attention call's batch description (cu_seqlens, seqused_k, block_table,
// cache_batch_idx, max_seqlen) and of the int8 scale operands.
#pragma once

#include "problem/attention.hpp"

namespace flashserve::detail {

// Ranks, dtypes and sizes of the metadata; sets pr.batch. Needs q and k normalized.
void check_batch(AttnProblem& pr, const AttentionParams& p);
// Contents (CPU only): monotone cu_seqlens within the tensors, lengths within max_seqlen and
// the cache, block indices of every used block in range, cache rows in range.
void check_batch_contents(AttnProblem& pr, const AttentionParams& p);
// q_scale, k_scale_cache, v_scale for the int8 modes (normalized into pr).
void check_int8_scales(AttnProblem& pr, const AttentionParams& p);

}  // namespace flashserve::detail
