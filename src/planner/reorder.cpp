// Batch reordering for the decode/prefill split (SPEC.md §6): decodes first, stable.
#include <cstdint>
#include <span>
#include <vector>

#include "flashserve/backend.hpp"

namespace flashserve::backend {

std::vector<int32_t> reorder_decodes_first(std::span<const int32_t> query_lens, int threshold) {
  std::vector<int32_t> order;
  order.reserve(query_lens.size());
  for (size_t i = 0; i < query_lens.size(); ++i)
    if (query_lens[i] <= threshold) order.push_back(int32_t(i));
  for (size_t i = 0; i < query_lens.size(); ++i)
    if (query_lens[i] > threshold) order.push_back(int32_t(i));
  return order;
}

}  // namespace flashserve::backend
