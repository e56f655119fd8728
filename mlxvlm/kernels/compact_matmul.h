// The driver shared by the 16-bit and the quantized linear kernels: y = x . W^T (+ bias)
// for a weight stored compactly, known through two callbacks.
//   gemv(n0, n1):          for up to kMaxGemvRows rows of x, y[:, n0:n1) from the
//                          compact weight directly (decoding: reads the fewest bytes);
//   to_float(n0, n1, out): weight rows [n0, n1) as float32, row-major (prefill: a chunk
//                          at a time, each through the process's sgemm).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "blas.h"
#include "cpu_parallel.h"
#include "scratch.h"

namespace mlxvlm {

constexpr int64_t kMaxGemvRows = 4;
// float32 scratch per converted chunk (16 MB): whole layers of small models in one sgemm
// (SigLIP's 3072 x 768 MLP: 9 MB), thousands of rows at a time for large ones.
constexpr int64_t kChunkFloats = 1 << 22;
// Below this many weight elements per worker a gemv stays on one thread.
constexpr int64_t kMinGemvPerWorker = 1 << 17;

template <class Gemv, class ToFloat>
void compact_matmul(const float* x, int64_t rows, int64_t K, int64_t N, const float* bias,
                    float* y, Gemv&& gemv, ToFloat&& to_float) {
  if (rows <= kMaxGemvRows) {
    parallel_for(N, std::max<int64_t>(1, kMinGemvPerWorker / K), [&](int64_t n0, int64_t n1) {
      gemv(n0, n1);
      if (bias)
        for (int64_t m = 0; m < rows; m++)
          for (int64_t n = n0; n < n1; n++) y[m * N + n] += bias[n];
    });
    return;
  }
  int64_t chunk = std::min<int64_t>(N, std::max<int64_t>(64, kChunkFloats / K));
  Scratch converted(static_cast<size_t>(chunk * K));
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    int64_t n1 = std::min(N, n0 + chunk);
    parallel_for(n1 - n0, 16, [&](int64_t start, int64_t stop) {
      to_float(n0 + start, n0 + stop, converted.data() + start * K);
    });
    if (bias) {  // the product is added to the bias rows (sgemm's beta = 1): no extra pass
      parallel_for(rows, 16, [&](int64_t start, int64_t stop) {
        for (int64_t m = start; m < stop; m++) std::copy(bias + n0, bias + n1, y + m * N + n0);
      });
    }
    sgemm(true, int(rows), int(n1 - n0), int(K), 1.0f, x, int(K), converted.data(), int(K),
          bias ? 1.0f : 0.0f, y + n0, int(N));
  }
}

}  // namespace mlxvlm
