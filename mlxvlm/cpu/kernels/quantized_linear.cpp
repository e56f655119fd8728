// y = x . dequantize(W)^T (+ bias) for MLX's affine 4- and 8-bit weights, in float32.
//
// MLX's CPU quantized_matmul costs about as much per row as dequantizing the whole matrix
// (4-bit 1x1536x8960: 0.16 s; a float32 gemv: 0.011 s), so mlxvlm used to dequantize
// quantized checkpoints to float32 at load: fast, but 8x the memory of 4-bit weights.
// This primitive computes on the packed weights:
// - up to four rows of x (decoding): per output row and group, the dot product of x with
//   the unpacked integers, scaled, plus the group's bias times the sum of x over the
//   group (precomputed) -- sum_g (s_g x_g.q_g + b_g sum(x_g)), the dequantized product
//   rearranged (AVX-512, AVX2 or portable loops); rows split over the CPU threads;
// - more rows (prefill): the weights dequantized as mlxvlm's AVX-512 GEMM packs them
//   (packed_gemm.h), or a chunk of rows at a time into the process's sgemm, whichever
//   compact_matmul.h's prefill_choice() takes.
// Layout (mx.quantize, mode "affine"): each row's integers packed little-endian into
// bytes (4-bit: low nibble first), one scale and one bias per group of group_size
// consecutive columns, scales/biases in float32, bfloat16 or float16.
#include <algorithm>
#include <numeric>
#include <vector>

#include "compact_matmul.h"
#include "cpu_primitive.h"
#include "kernels.h"
#include "vector_math.h"

namespace mlxvlm {

using namespace mlx::core;

namespace {

enum class ScaleType { float32, bfloat16, float16 };

struct Quantized {
  const uint8_t* packed;  // N x (K * bits / 8) bytes
  const void* scales;     // N x (K / group_size)
  const void* biases;
  ScaleType scale_type;
  int bits, group_size;
  int64_t N, K;

  int64_t groups() const { return K / group_size; }
  const uint8_t* row(int64_t n) const { return packed + n * K * bits / 8; }
  float scale(int64_t n, int64_t g) const { return read(scales, n * groups() + g); }
  float bias(int64_t n, int64_t g) const { return read(biases, n * groups() + g); }
  float read(const void* p, int64_t i) const {
    switch (scale_type) {
      case ScaleType::float32: return static_cast<const float*>(p)[i];
      case ScaleType::bfloat16:
        return bfloat16_to_float(static_cast<const uint16_t*>(p)[i]);
      default: return float16_to_float(static_cast<const uint16_t*>(p)[i]);
    }
  }
  // The integer at column k of row `row`.
  int value(const uint8_t* row, int64_t k) const {
    if (bits == 8) return row[k];
    return (row[k / 2] >> (4 * (k % 2))) & 15;
  }
};

#ifdef MLXVLM_X86
// 8 integers starting at column k (a multiple of 8), as floats.
template <int bits>
MLXVLM_AVX2 inline __m256 unpack8(const uint8_t* row, int64_t k) {
  if constexpr (bits == 8) {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  } else {
    uint32_t word;
    std::memcpy(&word, row + k / 2, sizeof(word));
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(word)),
                                  _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  }
}

template <int bits, int M>
MLXVLM_AVX2 void gemv_avx2(const Quantized& w, const float* x, const float* group_sums,
                           int64_t n0, int64_t n1, float* y) {
  const int64_t groups = w.groups();
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w.row(n);
    __m256 total[M];
    float bias_terms[M] = {};
    for (int m = 0; m < M; m++) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      __m256 acc[M];
      for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
      for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; k += 8) {
        __m256 q = unpack8<bits>(row, k);
        for (int m = 0; m < M; m++)
          acc[m] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x + m * w.K + k), acc[m]);
      }
      __m256 scale = _mm256_set1_ps(w.scale(n, g));
      float bias = w.bias(n, g);
      for (int m = 0; m < M; m++) {
        total[m] = _mm256_fmadd_ps(scale, acc[m], total[m]);
        bias_terms[m] += bias * group_sums[m * groups + g];
      }
    }
    for (int m = 0; m < M; m++) y[m * w.N + n] = sum8(total[m]) + bias_terms[m];
  }
}

// 16 integers starting at column k (a multiple of 16), as floats.
template <int bits>
MLXVLM_AVX512 inline __m512 unpack16(const uint8_t* row, int64_t k) {
  if constexpr (bits == 8) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  } else {
    // 8 bytes, each doubled (b0 b0 b1 b1 ...), widened, then the low nibble of the even
    // lanes and the high nibble of the odd ones.
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
    __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
    v = _mm512_srlv_epi32(v, _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0));
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  }
}

// R output rows at a time against M rows of x (independent accumulators: the FMA chains
// of one row alone are latency-bound). `dot(n, g, acc)` adds group g's products of the
// integers of rows n..n+R-1 with x into acc[r][m]; the scales, biases and sums are here.
template <int M, int R, class GroupDot>
MLXVLM_AVX512 int64_t quantized_tile_avx512(const Quantized& w, const float* group_sums,
                                            int64_t n0, int64_t n1, float* y,
                                            const GroupDot& dot) {
  const int64_t groups = w.groups();
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 total[R][M];
    float bias_terms[R][M] = {};
    for (int r = 0; r < R; r++)
      for (int m = 0; m < M; m++) total[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      __m512 acc[R][M];
      for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
      dot.template add<M, R>(n, g, acc);
      for (int r = 0; r < R; r++) {
        __m512 scale = _mm512_set1_ps(w.scale(n + r, g));
        float bias = w.bias(n + r, g);
        for (int m = 0; m < M; m++) {
          total[r][m] = _mm512_fmadd_ps(scale, acc[r][m], total[r][m]);
          bias_terms[r][m] += bias * group_sums[m * groups + g];
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int m = 0; m < M; m++)
        y[m * w.N + n + r] = _mm512_reduce_add_ps(total[r][m]) + bias_terms[r][m];
  }
  return n;
}

// Group products 16 columns at a time (group_size a multiple of 16).
template <int bits>
struct UnpackedDot {
  const Quantized& w;
  const float* x;
  template <int M, int R>
  MLXVLM_AVX512 __attribute__((always_inline)) void add(int64_t n, int64_t g,
                                                       __m512 (&acc)[R][M]) const {
    for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; k += 16) {
      __m512 xs[M];
      for (int m = 0; m < M; m++) xs[m] = _mm512_loadu_ps(x + m * w.K + k);
      for (int r = 0; r < R; r++) {
        __m512 q = unpack16<bits>(w.row(n + r), k);
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(q, xs[m], acc[r][m]);
      }
    }
  }
};

// 4-bit: 16 bytes hold 32 columns, the low nibbles the even ones and the high nibbles
// the odd ones; against x's even and odd columns (`x_split`: per row of x, its K/2 even
// columns then its K/2 odd ones) a vector of bytes needs one widening, not two.
// group_size a multiple of 32.
struct PairedNibbleDot {
  const Quantized& w;
  const float* x_split;
  template <int M, int R>
  MLXVLM_AVX512 __attribute__((always_inline)) void add(int64_t n, int64_t g,
                                                       __m512 (&acc)[R][M]) const {
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t j = g * w.group_size / 2; j < (g + 1) * w.group_size / 2; j += 16) {
      __m512 even[M], odd[M];
      for (int m = 0; m < M; m++) {
        even[m] = _mm512_loadu_ps(x_split + m * w.K + j);
        odd[m] = _mm512_loadu_ps(x_split + m * w.K + w.K / 2 + j);
      }
      for (int r = 0; r < R; r++) {
        __m512i bytes = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.row(n + r) + j)));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        for (int m = 0; m < M; m++)
          acc[r][m] = _mm512_fmadd_ps(hi, odd[m], _mm512_fmadd_ps(lo, even[m], acc[r][m]));
      }
    }
  }
};

template <int bits, int M>
MLXVLM_AVX512 void gemv_avx512(const Quantized& w, const float* x, const float* x_split,
                               const float* group_sums, int64_t n0, int64_t n1, float* y) {
  constexpr int R = M == 1 ? 4 : 2;
  auto run = [&](const auto& dot) {
    int64_t n = quantized_tile_avx512<M, R>(w, group_sums, n0, n1, y, dot);
    quantized_tile_avx512<M, 1>(w, group_sums, n, n1, y, dot);
  };
  if (bits == 4 && w.group_size % 32 == 0)
    run(PairedNibbleDot{w, x_split});
  else
    run(UnpackedDot<bits>{w, x});
}

// W[n][k0 : k0 + kc) dequantized (k0 a multiple of 16; MLX's group sizes are multiples
// of 16 too, so no step of 16, or 8, columns crosses a group). Sixteen wide where the CPU
// has AVX-512: 4-bit prefill products 10% faster than with the 8-wide loop.
template <int bits>
MLXVLM_AVX512 int64_t dequantize_avx512(const Quantized& w, int64_t n, int64_t k0, int64_t kc,
                                        float* out) {
  int64_t k = 0;
  for (; k + 16 <= kc; k += 16) {
    const int64_t g = (k0 + k) / w.group_size;
    _mm512_storeu_ps(out + k, _mm512_fmadd_ps(unpack16<bits>(w.row(n), k0 + k),
                                              _mm512_set1_ps(w.scale(n, g)),
                                              _mm512_set1_ps(w.bias(n, g))));
  }
  return k;
}

template <int bits>
MLXVLM_AVX2 int64_t dequantize_avx2(const Quantized& w, int64_t n, int64_t k0, int64_t kc,
                                    float* out) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    const int64_t g = (k0 + k) / w.group_size;
    _mm256_storeu_ps(out + k, _mm256_fmadd_ps(unpack8<bits>(w.row(n), k0 + k),
                                              _mm256_set1_ps(w.scale(n, g)),
                                              _mm256_set1_ps(w.bias(n, g))));
  }
  return k;
}
#endif

void gemv_portable(const Quantized& w, const float* x, int64_t rows, const float* group_sums,
                   int64_t n0, int64_t n1, float* y) {
  const int64_t groups = w.groups();
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w.row(n);
    for (int64_t m = 0; m < rows; m++) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; g++) {
        float acc = 0.0f;
        for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; k++)
          acc += x[m * w.K + k] * float(w.value(row, k));
        total += w.scale(n, g) * acc + w.bias(n, g) * group_sums[m * groups + g];
      }
      y[m * w.N + n] = total;
    }
  }
}

void gemv_rows(const Quantized& w, const float* x, const float* x_split, int64_t rows,
               const float* group_sums, int64_t n0, int64_t n1, float* y) {
#ifdef MLXVLM_X86
#define MLXVLM_QUANTIZED_GEMV(ISA, BITS, ...)                                      \
  switch (rows) {                                                                  \
    case 1: return gemv_##ISA<BITS, 1>(w, x, __VA_ARGS__ group_sums, n0, n1, y);   \
    case 2: return gemv_##ISA<BITS, 2>(w, x, __VA_ARGS__ group_sums, n0, n1, y);   \
    case 3: return gemv_##ISA<BITS, 3>(w, x, __VA_ARGS__ group_sums, n0, n1, y);   \
    case 4: return gemv_##ISA<BITS, 4>(w, x, __VA_ARGS__ group_sums, n0, n1, y);   \
  }
  if (has_avx512() && w.group_size % 16 == 0) {
    if (w.bits == 4) { MLXVLM_QUANTIZED_GEMV(avx512, 4, x_split,) }
    else { MLXVLM_QUANTIZED_GEMV(avx512, 8, x_split,) }
  }
  if (has_avx2()) {
    if (w.bits == 4) { MLXVLM_QUANTIZED_GEMV(avx2, 4) }
    else { MLXVLM_QUANTIZED_GEMV(avx2, 8) }
  }
#undef MLXVLM_QUANTIZED_GEMV
#endif
  gemv_portable(w, x, rows, group_sums, n0, n1, y);
}

// The weight's rows dequantized to float32, for compact_matmul's prefill.
struct DequantizedRows {
  const Quantized& w;

  void row(int64_t n, int64_t k0, int64_t kc, float* out) const {
    int64_t k = 0;
#ifdef MLXVLM_X86
    if (has_avx512() && w.group_size % 16 == 0)
      k = w.bits == 4 ? dequantize_avx512<4>(w, n, k0, kc, out)
                      : dequantize_avx512<8>(w, n, k0, kc, out);
    else if (has_avx2())
      k = w.bits == 4 ? dequantize_avx2<4>(w, n, k0, kc, out)
                      : dequantize_avx2<8>(w, n, k0, kc, out);
#endif
    for (; k < kc; k++) {
      const int64_t g = (k0 + k) / w.group_size;
      out[k] = w.scale(n, g) * float(w.value(w.row(n), k0 + k)) + w.bias(n, g);
    }
  }
};

void quantized_matmul(const Quantized& w, const float* x, int64_t rows, const float* bias,
                      float* y) {
  std::vector<float> group_sums;  // sum of x over each group, for the gemv's bias terms
  std::vector<float> x_split;     // 4-bit: each row of x's even columns, then its odd ones
  if (rows <= kMaxGemvRows) {
    group_sums.resize(static_cast<size_t>(rows * w.groups()));
    for (int64_t m = 0; m < rows; m++)
      for (int64_t g = 0; g < w.groups(); g++) {
        const float* part = x + m * w.K + g * w.group_size;
        group_sums[m * w.groups() + g] = std::accumulate(part, part + w.group_size, 0.0f);
      }
    if (w.bits == 4) {
      x_split.resize(static_cast<size_t>(rows * w.K));
      for (int64_t m = 0; m < rows; m++)
        for (int64_t k = 0; k < w.K; k++)
          x_split[m * w.K + (k % 2) * (w.K / 2) + k / 2] = x[m * w.K + k];
    }
  }
  compact_matmul(
      x, rows, w.K, w.N, bias, nullptr, y,
      [&](int64_t n0, int64_t n1) {
        gemv_rows(w, x, x_split.data(), rows, group_sums.data(), n0, n1, y);
      },
      DequantizedRows{w});
}

ScaleType scale_type(Dtype dtype) {
  if (dtype == float32) return ScaleType::float32;
  if (dtype == bfloat16) return ScaleType::bfloat16;
  if (dtype == float16) return ScaleType::float16;
  throw std::invalid_argument("[quantized_linear] scales must be float32, bfloat16 or float16");
}

class QuantizedLinear : public CpuPrimitive {
 public:
  QuantizedLinear(Stream stream, int group_size, int bits, bool has_bias)
      : CpuPrimitive(stream), group_size_(group_size), bits_(bits), has_bias_(has_bias) {}

  void dispatch(const std::vector<array>& inputs, array& out,
                cpu::CommandEncoder& encoder) override {
    const array &x = inputs[0], &packed = inputs[1], &scales = inputs[2], &biases = inputs[3];
    Quantized w{packed.data<uint8_t>(), scales.data<uint8_t>(), biases.data<uint8_t>(),
                scale_type(scales.dtype()), bits_, group_size_, packed.shape(0),
                packed.shape(1) * 32 / bits_};
    const float* bias = has_bias_ ? inputs[4].data<float>() : nullptr;
    encoder.dispatch([w, x, rows = int64_t(x.size()) / w.K, bias, yp = out.data<float>()]() {
      std::vector<float> x_copy;
      quantized_matmul(w, row_major(x, x_copy), rows, bias, yp);
    });
  }

  std::vector<array> vjp(const std::vector<array>& primals,
                         const std::vector<array>& cotangents,
                         const std::vector<int>& argnums,
                         const std::vector<array>&) override {
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        array weight = dequantize(primals[1], primals[2], primals[3], group_size_, bits_,
                                  "affine", std::nullopt, float32, stream());
        grads.push_back(matmul(cotangents[0], weight, stream()));
      } else if (arg == 4) {
        int N = primals[1].shape(0);
        grads.push_back(sum(reshape(cotangents[0], {-1, N}, stream()), 0, false, stream()));
      } else {
        throw std::invalid_argument("[quantized_linear] no gradient for the quantized weight");
      }
    }
    return grads;
  }

  const char* name() const override { return "MlxvlmQuantizedLinear"; }
  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const QuantizedLinear&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && has_bias_ == o.has_bias_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_, bits_;
  bool has_bias_;
};

}  // namespace

array quantized_linear(const array& x, const array& packed, const array& scales,
                       const array& biases, int group_size, int bits,
                       const std::optional<array>& bias, StreamOrDevice s) {
  if (bits != 4 && bits != 8)
    throw std::invalid_argument("[quantized_linear] 4- and 8-bit weights only");
  if (packed.dtype() != uint32 || packed.ndim() != 2)
    throw std::invalid_argument("[quantized_linear] weight must be MLX's packed uint32 matrix");
  int64_t K = packed.shape(1) * 32 / bits, N = packed.shape(0);
  if (group_size % 8 != 0 || K % group_size != 0 ||
      scales.shape() != Shape{int(N), int(K / group_size)} || biases.shape() != scales.shape())
    throw std::invalid_argument("[quantized_linear] scales/biases do not fit the weight");
  if (x.ndim() < 1 || x.shape(-1) != K)
    throw std::invalid_argument("[quantized_linear] x's last axis must match the weight");
  scale_type(scales.dtype());  // throws for other dtypes
  Stream stream = to_stream(s);
  auto parameter = [&](const array& a) { return contiguous_parameter(a, stream); };
  std::vector<array> inputs{astype(x, float32, stream), parameter(packed), parameter(scales),
                            parameter(astype(biases, scales.dtype(), stream))};
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != N)
      throw std::invalid_argument("[quantized_linear] bias must have one value per output");
    inputs.push_back(parameter(astype(*bias, float32, stream)));
  }
  Shape shape = x.shape();
  shape.back() = int(N);
  return array(shape, float32,
               std::make_shared<QuantizedLinear>(stream, group_size, bits, bias.has_value()),
               std::move(inputs));
}

}  // namespace mlxvlm
