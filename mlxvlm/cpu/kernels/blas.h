// The float32 matrix product the kernels use: the process's cblas_sgemm (OpenBLAS when
// mlxvlm loaded it, see mlxvlm/cpu/blas.py), whose address Python hands over at start-up
// so that this library needs no link-time BLAS.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace mlxvlm {

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int,
                          const float*, int, float, float*, int);

inline sgemm_fn& sgemm_pointer() {
  static sgemm_fn pointer = nullptr;
  return pointer;
}

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };

// C (m x n, row stride ldc) = alpha * A (m x k) . op(B) + beta * C, row-major.
inline void sgemm(bool transpose_b, int m, int n, int k, float alpha, const float* a,
                  int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  sgemm_fn f = sgemm_pointer();
  if (f == nullptr) throw std::runtime_error("mlxvlm kernels: no cblas_sgemm was set");
  f(kRowMajor, kNoTrans, transpose_b ? kTrans : kNoTrans, m, n, k, alpha, a, lda, b, ldb,
    beta, c, ldc);
}

}  // namespace mlxvlm
