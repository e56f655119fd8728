// The 16-bit-weight product itself (half_linear.cpp), for the kernels built on it: the
// linear layer's and the mixture-of-experts bank's (gathered_half_linear.cpp).
#pragma once

#include <cstdint>

#include "compact_matmul.h"
#include "vector_math.h"

namespace mlxvlm {

// y (rows x N) = x (rows x K) . w^T (+ bias) (+ residual), w 16-bit (N x K), all
// row-major; called inside a dispatched kernel (it spreads the work over the CPU threads).
void half_matmul(const float* x, int64_t rows, int64_t K, const uint16_t* w, Half kind,
                 int64_t N, const float* bias, const float* residual, float* y,
                 Prefill prefill = Prefill::chosen);

// y[:, n0:n1) (y: rows x N) = x (rows x K, rows <= kMaxGemvRows) . w[n0:n1)^T on this
// thread: the gemv half_matmul spreads over the threads, for a caller that spreads
// several products' columns over them at once.
void half_gemv(const float* x, int64_t rows, int64_t K, const uint16_t* w, Half kind,
               int64_t n0, int64_t n1, float* y, int64_t N);

}  // namespace mlxvlm
