// CUDA launchers of the tree-speculation metadata operations (flashserve/spec_metadata.hpp). A
// plain C++ header: host code includes it without CUDA headers. Defined only in CUDA builds
// (FLASHSERVE_WITH_CUDA=1).
//
// Inputs are validated by src/api/validate_spec_metadata.* (shapes, dtypes, devices). Their
// contents live on the device and are not checked on the host: a pool index, a req_to_token
// column or a mask element out of range reads as 0 (a mask bit as hidden), never accessed; a
// window row's la + lb past page_table's width is written up to the width.
//
// Every launch goes on `stream` (a cudaStream_t; null = the default stream) of the current
// device; nothing is allocated and nothing waits for the device (graph-capturable).
#pragma once

#include "problem/spec_metadata.hpp"

namespace flashserve::kernels {

// One launch, a thread per page-table entry (and per offset).
void spec_draft_expand(const detail::DraftExpandProblem& pr, void* stream);

// One block: requests in chunks of its threads, their mask offsets scanned, then a thread per
// draft row (its page-table row and visible count) with the counts scanned into cu_seqlens_k.
void spec_verify_expand(const detail::VerifyExpandProblem& pr, void* stream);

// Two launches: blocks over rows (each row's columns by the block's threads, and its length),
// then one block scanning the lengths into cu_seqlens_k.
void spec_window_page_table(const detail::WindowPageTableProblem& pr, void* stream);

}  // namespace flashserve::kernels
