// The attention problem as the CPU kernels see it (attention.cpp builds it from MLX's
// arrays): float32 q, k, v read through strides with unit-stride columns, an optional
// additive or boolean mask with broadcast strides, and the output written (batch, query, head, dim).
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

// The mask: additive float32 values, or booleans (true: attend), whose false entries add
// the most negative finite float, exactly as their additive form would (a row that sees
// no key then gets uniform weights, not NaN, as models/layers/attention.py's MLX path).
struct MaskView {
  const void* data = nullptr;  // null: no mask
  bool boolean = false;
  int64_t batch = 0, head = 0, query = 0, key = 0;

  // row[j] += the mask's entry for key first_key + j, j < n, of query `query_index`.
  void add_to(float* row, int64_t b, int64_t h, int64_t query_index, int64_t first_key,
              int64_t n) const {
    const int64_t offset = b * batch + h * head + query_index * query + first_key * key;
    if (boolean) {
      const bool* m = static_cast<const bool*>(data) + offset;
      for (int64_t j = 0; j < n; j++)
        if (!m[j * key]) row[j] += kMaskedOut;
      return;
    }
    const float* m = static_cast<const float*>(data) + offset;
    if (key == 1) {
      for (int64_t j = 0; j < n; j++) row[j] += m[j];
    } else {
      for (int64_t j = 0; j < n; j++) row[j] += m[j * key];
    }
  }

  static constexpr float kMaskedOut = -3.40282347e+38f;  // the lowest finite float
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
