// The driver shared by the 16-bit and the quantized linear kernels: y = x . W^T (+ bias)
// (+ addend, a (rows x N) row-major matrix: a residual that the layer's output is added
// to, which may be y's own buffer in prefill) for a weight stored compactly, known
// through
//   gemv(n0, n1):                for up to `max_gemv_rows` rows of x (kMaxGemvRows unless
//                                the kernel says more), y[:, n0:n1) from the compact
//                                weight directly (decoding, one row per sequence of a
//                                batch: reads the fewest bytes);
//   weights.row(n, k0, kc, out): W[n][k0 : k0 + kc) as float32 (k0 a multiple of 16), for
//                                more rows (prefill), either packed by mlxvlm's AVX-512
//                                GEMM as it goes (packed_gemm.h) or a chunk of whole rows
//                                at a time handed to the process's sgemm, whichever
//                                prefill_choice() says is faster here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "blas.h"
#include "cpu_parallel.h"
#include "packed_gemm.h"
#include "scratch.h"

namespace mlxvlm {

constexpr int64_t kMaxGemvRows = 4;
// float32 scratch per converted chunk (16 MB): whole layers of small models in one sgemm
// (SigLIP's 3072 x 768 MLP: 9 MB), thousands of rows at a time for large ones.
constexpr int64_t kChunkFloats = 1 << 22;
// Below this many weight elements per worker a gemv stays on one thread.
constexpr int64_t kMinGemvPerWorker = 1 << 17;

// y[:, n0:n1) = addend (+ bias), or bias, for a product then added to it (sgemm's
// beta = 1); nothing without either. The addend may be y itself.
inline void put_bias_and_addend(int64_t rows, int64_t N, int64_t n0, int64_t n1,
                                const float* bias, const float* addend, float* y) {
  if (!bias && !addend) return;
  parallel_for(rows, 16, [&](int64_t start, int64_t stop) {
    for (int64_t m = start; m < stop; m++) {
      float* out = y + m * N;
      if (addend && addend != y) std::copy(addend + m * N + n0, addend + m * N + n1, out + n0);
      if (!addend) std::copy(bias + n0, bias + n1, out + n0);
      else if (bias)
        for (int64_t n = n0; n < n1; n++) out[n] += bias[n];
    }
  });
}

// How prefill's products run: decided once per process (defined in half_linear.cpp, which
// measures both on a 16-bit product), or forced (the measurement itself).
enum class Prefill { chosen, packed_gemm, sgemm };
struct PrefillChoice {
  bool packed_gemm;
  std::string why;  // for --verbose
};
const PrefillChoice& prefill_choice();

// MLXVLM_HALF_GEMM's value ("own", "blas", "" for unset, or anything else, which
// prefill_choice says it ignores), handed in by Python (mlxvlm/cpu/policy.py, the one
// reader of MLXVLM_* settings) through set_half_gemm before the first kernel runs.
inline std::string& half_gemm_setting() {
  static std::string value;
  return value;
}

template <class Gemv, class Weights>
void compact_matmul(const float* x, int64_t rows, int64_t K, int64_t N, const float* bias,
                    const float* addend, float* y, Gemv&& gemv, const Weights& weights,
                    Prefill prefill = Prefill::chosen, int64_t max_gemv_rows = kMaxGemvRows) {
  if (rows <= max_gemv_rows) {  // the gemv writes y first: addend must not be y here
    parallel_for(N, std::max<int64_t>(1, kMinGemvPerWorker / K), [&](int64_t n0, int64_t n1) {
      gemv(n0, n1);
      for (int64_t m = 0; m < rows; m++) {
        float* out = y + m * N;
        if (bias)
          for (int64_t n = n0; n < n1; n++) out[n] += bias[n];
        if (addend)
          for (int64_t n = n0; n < n1; n++) out[n] += addend[m * N + n];
      }
    });
    return;
  }
#ifdef MLXVLM_X86
  if (prefill == Prefill::packed_gemm ||
      (prefill == Prefill::chosen && prefill_choice().packed_gemm)) {
    put_bias_and_addend(rows, N, 0, N, bias, addend, y);
    return packed_gemm(x, rows, K, weights, N, y, bias || addend);
  }
#endif
  int64_t chunk = std::min<int64_t>(N, std::max<int64_t>(64, kChunkFloats / K));
  Scratch converted(static_cast<size_t>(chunk * K));
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    int64_t n1 = std::min(N, n0 + chunk);
    parallel_for(n1 - n0, 16, [&](int64_t start, int64_t stop) {
      for (int64_t n = n0 + start; n < n0 + stop; n++)
        weights.row(n, 0, K, converted.data() + (n - n0) * K);
    });
    // The product is added to the bias and addend rows (sgemm's beta = 1): no extra pass.
    put_bias_and_addend(rows, N, n0, n1, bias, addend, y);
    sgemm(true, int(rows), int(n1 - n0), int(K), 1.0f, x, int(K), converted.data(), int(K),
          bias || addend ? 1.0f : 0.0f, y + n0, int(N));
  }
}

}  // namespace mlxvlm
