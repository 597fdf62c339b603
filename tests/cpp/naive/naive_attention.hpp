// The independent fp64 oracle for attention (SPEC.md §2), written from the spec alone: plain
// loops over logical dense data already dequantized to double. It shares no code with
// src/reference; the tests compare the library against it.
#pragma once

#include <cstdint>
#include <vector>

namespace fstest {

// One sequence's operands, dense row-major, in double.
struct NaiveSequence {
  int64_t sq = 0, sk = 0;               // query rows, KV tokens
  int64_t H = 1, H_kv = 1, D = 0, Dv = 0;
  std::vector<double> q;                // [sq, H, D]
  std::vector<double> k;                // [sk, H_kv, D]
  std::vector<double> v;                // [sk, H_kv, Dv]
  std::vector<double> q_v;              // [sq, H, Dv], or empty (no q_v)
};

// The score modifiers of SPEC.md §2, resolved for this sequence.
struct NaiveFeatures {
  double scale = 1.0;                   // the resolved softmax scale (no default applied here)
  double softcap = 0.0;                 // > 0 enables softcap * tanh(s / softcap)
  std::vector<double> alibi;            // [H] slopes of this sequence, or empty
  bool alibi_sqrt = false;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // -1: unbounded on that side
  int64_t chunk = 0;                    // > 0: chunked local attention
  std::vector<double> sinks;            // [H] sink logits, or empty
};

struct NaiveResult {
  std::vector<double> out;              // [sq, H, Dv]
  std::vector<double> lse;              // [H, sq]; -inf for a row with no visible key and no sink
  std::vector<uint8_t> no_keys;         // [H, sq]: 1 when the row sees no key (out is exactly 0)
};

// Whether key j is visible from query row i (SPEC.md §2.4), with i' = i + sk - sq.
bool naive_visible(const NaiveFeatures& f, int64_t i, int64_t j, int64_t sq, int64_t sk);

// The pre-softmax logit of (row i, head h, key j) after scale, soft-cap and ALiBi.
double naive_logit(const NaiveSequence& s, const NaiveFeatures& f, int64_t i, int64_t h, int64_t j);

NaiveResult naive_attention(const NaiveSequence& s, const NaiveFeatures& f);

}  // namespace fstest
