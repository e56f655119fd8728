// Prefill's products with 16-bit weights on CPUs with AVX-512 (see packed_gemm.h): the
// bfloat16/float16 rows converted to float32 as they are packed, with no separate pass
// and 1-2 MB of packed weights per thread instead of the other path's 16 MB chunk (the
// weights converted a chunk at a time into the process's sgemm, compact_matmul.h).
#include "half_gemm.h"

#include "packed_gemm.h"

#ifdef MLXVLM_X86

namespace mlxvlm {

namespace {

template <Half kind>
struct HalfRows {
  const uint16_t* w;
  int64_t K;

  MLXVLM_AVX512 void row(int64_t n, int64_t k0, int64_t kc, float* out) const {
    const uint16_t* source = w + n * K + k0;
    int64_t k = 0;
    for (; k + 16 <= kc; k += 16) _mm512_storeu_ps(out + k, load_half16<kind>(source + k));
    for (; k < kc; k++) out[k] = half_to_float(source[k], kind);
  }
};

}  // namespace

void half_gemm_avx512(const float* x, int64_t rows, int64_t K, const uint16_t* w, Half kind,
                      int64_t N, float* y, bool accumulate) {
  if (kind == Half::bfloat16)
    packed_gemm(x, rows, K, HalfRows<Half::bfloat16>{w, K}, N, y, accumulate);
  else
    packed_gemm(x, rows, K, HalfRows<Half::float16>{w, K}, N, y, accumulate);
}

}  // namespace mlxvlm

#else  // not x86-64: half_linear.cpp never chooses this path (has_avx512() is false)

#include <stdexcept>

namespace mlxvlm {
void half_gemm_avx512(const float*, int64_t, int64_t, const uint16_t*, Half, int64_t, float*,
                      bool) {
  throw std::logic_error("half_gemm_avx512 needs an x86-64 CPU with AVX-512");
}
}  // namespace mlxvlm

#endif
