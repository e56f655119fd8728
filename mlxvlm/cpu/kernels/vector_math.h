// Vectorised row operations for the CPU kernels: softmax pieces and 16-bit -> float32
// conversion, with AVX2/FMA versions on x86-64 CPUs that have them (checked at run time)
// and portable loops everywhere else; and which instruction set the CPU offers.
//
// The exponential is Cephes' expf: e^x = 2^n e^r with n = round(x log2 e), r reduced
// with a two-part ln 2, e^r from a degree-6 polynomial; relative error ~2e-7 over
// [-87, 88], like the C library's; 0 below that range, inf above, NaN kept.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLXVLM_X86 1
#endif

namespace mlxvlm {

enum class Half { bfloat16, float16 };

// The widest instruction set the kernels use on this CPU: checked at run time, capped by
// MLXVLM_CPU_ISA ("avx512", "avx2" or "portable"), which lets the tests, and a user who
// suspects one, run the narrower code paths.
enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

// The cap, handed in by Python (mlxvlm/cpu/policy.py, the one reader of MLXVLM_*
// settings) through set_isa_cap before the first kernel runs: "" for none.
inline std::string& isa_cap_setting() {
  static std::string cap;
  return cap;
}

inline Isa detect_isa() {
#ifdef MLXVLM_X86
  Isa found = Isa::portable;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    found = Isa::avx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"))
      found = Isa::avx512;
  }
#else
  Isa found = Isa::portable;
#endif
  const std::string& cap = isa_cap_setting();
  Isa wanted = cap == "portable" ? Isa::portable : cap == "avx2" ? Isa::avx2 : Isa::avx512;
  if (wanted < found) found = wanted;
  return found;
}

inline Isa cpu_isa() {
  static const Isa value = detect_isa();
  return value;
}

inline bool has_avx2() { return cpu_isa() >= Isa::avx2; }
inline bool has_avx512() { return cpu_isa() >= Isa::avx512; }

inline const char* isa_name() {
  switch (cpu_isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

inline float bfloat16_to_float(uint16_t bits) {
  uint32_t word = uint32_t(bits) << 16;
  float out;
  std::memcpy(&out, &word, sizeof(out));
  return out;
}

inline float float16_to_float(uint16_t bits) {
  uint32_t sign = uint32_t(bits & 0x8000) << 16;
  uint32_t exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff, word;
  if (exponent == 0x1f) {  // inf / nan
    word = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    word = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    word = sign;
  } else {  // subnormal: renormalise
    int shift = 0;
    while ((mantissa & 0x400) == 0) {
      mantissa <<= 1;
      shift++;
    }
    word = sign | ((113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &word, sizeof(out));
  return out;
}

// expf, flushed to 0 below -87.34 (no subnormal results) like the vector version and
// MLX's exp.
inline float exp_scalar(float x) {
  return x < -87.3365478515625f ? 0.0f : std::exp(x);
}

inline float half_to_float(uint16_t bits, Half kind) {
  return kind == Half::bfloat16 ? bfloat16_to_float(bits) : float16_to_float(bits);
}

#ifdef MLXVLM_X86
#define MLXVLM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MLXVLM_AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma,f16c")))

// Cephes' expf constants: ln 2 in two parts (ln2_hi + ln2_lo), and the degree-6
// polynomial for e^r on [-ln2/2, ln2/2], highest degree first (the last two terms, r and
// 1, are added separately).
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f,
                kLn2Low = -2.12194440e-4f, kExpMin = -87.3365478515625f;
constexpr float kExpPolynomial[] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                    4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

MLXVLM_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(kExpMin);
  // Operand order keeps NaN: min/max return their second operand when one is NaN.
  __m256 t = _mm256_max_ps(lo, _mm256_min_ps(hi, x));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(kLog2e)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), t);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPolynomial[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  // Beyond the range, what expf gives: 0 below it, inf above.
  out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(out, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
}

MLXVLM_AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

MLXVLM_AVX2 inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

template <Half kind>
MLXVLM_AVX2 inline __m256 load_half8(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kind == Half::float16) return _mm256_cvtph_ps(raw);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 16 halves as float32 (AVX-512).
template <Half kind>
MLXVLM_AVX512 inline __m512 load_half16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kind == Half::bfloat16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else
    return _mm512_cvtph_ps(h);
}

MLXVLM_AVX2 inline float row_max_avx2(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float out = max8(m);
  for (; i < n; i++) out = std::fmax(out, x[i]);
  return out;
}

MLXVLM_AVX2 inline float exp_shifted_sum_avx2(float* x, int64_t n, float shift) {
  __m256 s = _mm256_set1_ps(shift), acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float out = sum8(acc);
  for (; i < n; i++) {
    x[i] = exp_scalar(x[i] - shift);
    out += x[i];
  }
  return out;
}

// Sums of x - shift and of its squares over the first n / 8 * 8 elements.
MLXVLM_AVX2 inline void moments_avx2(const float* x, int64_t n, float shift, float& sum,
                                     float& squares) {
  __m256 s = _mm256_setzero_ps(), q = _mm256_setzero_ps(), c = _mm256_set1_ps(shift);
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), c);
    s = _mm256_add_ps(s, d);
    q = _mm256_fmadd_ps(d, d, q);
  }
  sum = sum8(s);
  squares = sum8(q);
}

// y = (x - shift) * scale (* weight) (+ bias).
MLXVLM_AVX2 inline void scale_shift_avx2(const float* x, float* y, int64_t n, float shift,
                                         float scale, const float* weight, const float* bias) {
  __m256 c = _mm256_set1_ps(shift), k = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), c), k);
    if (weight) v = _mm256_mul_ps(v, _mm256_loadu_ps(weight + i));
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
    _mm256_storeu_ps(y + i, v);
  }
  for (; i < n; i++) {
    float v = (x[i] - shift) * scale;
    if (weight) v *= weight[i];
    if (bias) v += bias[i];
    y[i] = v;
  }
}

template <Half kind>
MLXVLM_AVX2 inline void half_to_float_avx2(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load_half8<kind>(in + i));
  for (; i < n; i++) out[i] = half_to_float(in[i], kind);
}
#endif  // MLXVLM_X86

inline float row_max(const float* x, int64_t n) {
#ifdef MLXVLM_X86
  if (has_avx2()) return row_max_avx2(x, n);
#endif
  float out = -INFINITY;
  for (int64_t i = 0; i < n; i++) out = std::fmax(out, x[i]);
  return out;
}

// x[i] = exp(x[i] - shift) for i < n; returns their sum.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
#ifdef MLXVLM_X86
  if (has_avx2()) return exp_shifted_sum_avx2(x, n, shift);
#endif
  float out = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    x[i] = exp_scalar(x[i] - shift);
    out += x[i];
  }
  return out;
}

inline void scale_shift_row(const float* x, float* y, int64_t n, float shift, float scale,
                            const float* weight, const float* bias) {
#ifdef MLXVLM_X86
  if (has_avx2()) return scale_shift_avx2(x, y, n, shift, scale, weight, bias);
#endif
  for (int64_t i = 0; i < n; i++) {
    float v = (x[i] - shift) * scale;
    if (weight) v *= weight[i];
    if (bias) v += bias[i];
    y[i] = v;
  }
}

#ifdef MLXVLM_X86
template <Half kind>
MLXVLM_AVX512 inline void half_to_float_avx512(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, load_half16<kind>(in + i));
  for (; i < n; i++) out[i] = half_to_float(in[i], kind);
}
#endif

inline void half_to_float(const uint16_t* in, float* out, int64_t n, Half kind) {
#ifdef MLXVLM_X86
  if (has_avx512()) {
    if (kind == Half::bfloat16) return half_to_float_avx512<Half::bfloat16>(in, out, n);
    return half_to_float_avx512<Half::float16>(in, out, n);
  }
  if (has_avx2()) {
    if (kind == Half::bfloat16) return half_to_float_avx2<Half::bfloat16>(in, out, n);
    return half_to_float_avx2<Half::float16>(in, out, n);
  }
#endif
  for (int64_t i = 0; i < n; i++) out[i] = half_to_float(in[i], kind);
}

}  // namespace mlxvlm
