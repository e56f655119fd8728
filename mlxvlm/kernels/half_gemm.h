// y (rows x N) = x (rows x K, float32) . W^T for W (N x K) in bfloat16/float16, on CPUs
// with AVX-512 (see half_gemm_avx512.cpp); with `accumulate`, added to what y holds (a
// bias or a residual put there first).
#pragma once

#include <cstdint>

#include "vector_math.h"

namespace mlxvlm {

void half_gemm_avx512(const float* x, int64_t rows, int64_t K, const uint16_t* w, Half kind,
                      int64_t N, float* y, bool accumulate);

}  // namespace mlxvlm
