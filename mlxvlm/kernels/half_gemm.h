// y (rows x N) = x (rows x K, float32) . W^T for W (N x K) in bfloat16/float16, on CPUs
// with AVX-512 (see half_gemm_avx512.cpp); with `accumulate`, added to what y holds (a
// bias or a residual put there first).
#pragma once

#include <cstdint>
#include <string>

#include "vector_math.h"

namespace mlxvlm {

void half_gemm_avx512(const float* x, int64_t rows, int64_t K, const uint16_t* w, Half kind,
                      int64_t N, float* y, bool accumulate);

// Whether half_linear's prefill products use half_gemm_avx512 or convert the weights into
// the process's sgemm, and why (decided at first use; see half_linear.cpp).
struct PrefillChoice {
  bool own_gemm;
  double own_ms, blas_ms;  // the calibration's times (0 when it did not run)
  std::string why;
};
const PrefillChoice& prefill_choice();

}  // namespace mlxvlm
