// CPU reference of the tree-speculation metadata operations (spec_metadata.hpp). Inputs
// validated by src/api/validate_spec_metadata.* (the contents that index memory included).
#pragma once

#include "problem/spec_metadata.hpp"

namespace flashserve::reference {

// Row by row: the first decode_length slots of out_cache_loc's row as int32, the constant
// lengths and their offsets.
void spec_draft_expand(const detail::DraftExpandProblem& pr);

// Row by row, in order: the visible drafts' slots then the hidden ones', the visible count,
// and its running sum.
void spec_verify_expand(const detail::VerifyExpandProblem& pr);

// Row by row: the prefix row then the expand row up to la + lb columns, the lengths and their
// running sum.
void spec_window_page_table(const detail::WindowPageTableProblem& pr);

}  // namespace flashserve::reference
