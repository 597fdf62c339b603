// Validation of the tree-speculation metadata operations (spec_metadata.hpp): shapes, dtypes
// and devices first (no tensor contents read), then, for CPU calls, the contents that index
// memory. Everything throws flashserve::Error naming the argument before any write.
#pragma once

#include "flashserve/spec_metadata.hpp"
#include "problem/spec_metadata.hpp"

namespace flashserve::detail {

DraftExpandProblem validate_spec_draft_expand(const SpecDraftExpandParams& p);

VerifyExpandProblem validate_spec_verify_expand(const SpecVerifyExpandParams& p);
// CPU contents: pool indices inside req_to_token, lengths >= 0 with the drafts inside its
// columns, every mask element read inside custom_mask.
void check_verify_expand_contents(const VerifyExpandProblem& pr);

WindowPageTableProblem validate_spec_window_page_table(const SpecWindowPageTableParams& p);
// CPU contents: lengths >= 0, each row's la + lb inside page_table's width, int32 offsets.
void check_window_contents(const WindowPageTableProblem& pr);

}  // namespace flashserve::detail
