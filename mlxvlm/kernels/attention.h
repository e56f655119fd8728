// The attention problem as the CPU kernels see it (attention.cpp builds it from MLX's
// arrays): float32 q, k, v read through strides with unit-stride columns, an optional
// additive mask with broadcast strides, and the output written (batch, query, head, dim).
#pragma once

#include <algorithm>
#include <cstdint>

namespace mlxvlm::attention_cpu {

// A (batch, head, row, column) float32 tensor read through strides, columns unit-stride.
struct View {
  const float* data = nullptr;
  int64_t batch = 0, head = 0, row = 0;
  const float* at(int64_t b, int64_t h, int64_t r) const {
    return data + b * batch + h * head + r * row;
  }
};

struct MaskView {
  const float* data = nullptr;  // null: no mask
  int64_t batch = 0, head = 0, query = 0, key = 0;
  const float* row(int64_t b, int64_t h, int64_t query_index) const {
    return data + b * batch + h * head + query_index * query;
  }
};

struct Problem {
  int64_t batch, heads, kv_heads, queries, keys, dims;
  View q, k, v;
  MaskView mask;
  bool causal;
  float scale;
  float* out;  // (batch, queries, heads, dims), contiguous
};

// How many keys query `query` sees: all of them, or under the causal mask those up to
// query + keys - queries (the queries are the last `queries` positions).
inline int64_t visible_keys(const Problem& p, int64_t query) {
  if (!p.causal) return p.keys;
  return std::clamp<int64_t>(query + p.keys - p.queries + 1, 0, p.keys);
}

// The two implementations (attention.cpp picks one): OpenBLAS's sgemm around a
// vectorised softmax, on any CPU; and register-tiled AVX-512 products fused with an
// online softmax (attention_avx512.cpp).
void attention_sgemm(const Problem& p);
void attention_avx512(const Problem& p);

}  // namespace mlxvlm::attention_cpu
