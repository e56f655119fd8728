// y = x . W^T with W kept in bfloat16 or float16 and x, y in float32.
//
// On MLX's CPU backend a 16-bit matmul is several times slower than a float32 one, so
// mlxvlm used to convert a bf16 checkpoint's weights to float32, doubling their memory.
// This primitive keeps the 16-bit weights and computes in float32 (plus an optional
// float32 bias):
// - up to eight rows of x (decoding, one row per sequence of a batch): a gemv that
//   converts each weight row as it streams it (AVX-512, AVX2 or portable loops), split
//   over the CPU threads, every row of x against each weight row in registers, so that a
//   batched step reads and converts the weights once for all its sequences (the GEMM
//   below padded 8 rows to its 12-row tiles and packed the weights first); it reads half
//   the bytes a float32 gemv reads. Each row of x takes the same accumulations in the
//   same order whatever rows are beside it: a sequence's products in a batch are bit
//   for bit its products alone;
// - more rows (prefill): on CPUs with AVX-512, a blocked GEMM of our own that converts the
//   weights as it packs them (packed_gemm.h), where it measures faster; otherwise the
//   weight is converted in chunks of rows (at most 16 MB of float32 at a time) and each
//   chunk goes through the process's sgemm (OpenBLAS). compact_matmul.h holds the choice.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "compact_matmul.h"
#include "cpu_primitive.h"
#include "half_matmul.h"
#include "kernels.h"
#include "vector_math.h"

namespace mlxvlm {

using namespace mlx::core;

namespace {

template <Half kind>
void gemv_portable(const float* x, int64_t rows, int64_t K, const uint16_t* w,
                   int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; n++) {
    const uint16_t* row = w + n * K;
    for (int64_t m = 0; m < rows; m++) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; k++) acc += x[m * K + k] * half_to_float(row[k], kind);
      y[m * N + n] = acc;
    }
  }
}

#ifdef MLXVLM_X86
// How far ahead of the weight rows being read the gemv asks for the next ones. With
// several rows of x the FMAs on each cache line take long enough that the hardware's own
// prefetching no longer overlapped the reads with them (the time of 8 rows was a 1-row
// read plus an in-cache 8-row product); 4 KB ahead measured best of 1-8 KB
// (benchmarks/decoding-and-serving.md, "Batched decoding on a CPU").
constexpr int64_t kPrefetchBytes = 4096;

// The cache lines of the next `bytes` weight bytes from `at`, into L1 (a tile's k-step
// reads R rows x one vector of 16-bit weights; consecutive tiles' rows are contiguous, so
// the requests of a tile cover the bytes kPrefetchBytes beyond it).
template <int bytes>
inline void prefetch_ahead(const char* at) {
  for (int line = 0; line < (bytes + 63) / 64; line++) _mm_prefetch(at + 64 * line, _MM_HINT_T0);
}

// R weight rows at a time against M rows of x: R x M independent accumulators.
template <Half kind, int M, int R>
MLXVLM_AVX2 int64_t gemv_tile_avx2(const float* x, int64_t K, const uint16_t* w, int64_t n0,
                                  int64_t n1, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    const char* ahead = reinterpret_cast<const char*>(w + n * K) + kPrefetchBytes;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 xs[M];
      for (int m = 0; m < M; m++) xs[m] = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; r++) {
        __m256 wv = load_half8<kind>(w + (n + r) * K + k);
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_fmadd_ps(wv, xs[m], acc[r][m]);
      }
      prefetch_ahead<16 * R>(ahead + 2 * R * k);
    }
    for (int r = 0; r < R; r++) {
      for (int m = 0; m < M; m++) {
        float total = sum8(acc[r][m]);
        for (int64_t kk = k; kk < K; kk++)
          total += x[m * K + kk] * half_to_float(w[(n + r) * K + kk], kind);
        y[m * N + n + r] = total;
      }
    }
  }
  return n;
}

// Weight rows per tile: R x M accumulators and M rows of x within the 16 registers.
template <Half kind, int M>
MLXVLM_AVX2 void gemv_avx2(const float* x, int64_t K, const uint16_t* w, int64_t n0,
                           int64_t n1, float* y, int64_t N) {
  constexpr int R = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  int64_t n = gemv_tile_avx2<kind, M, R>(x, K, w, n0, n1, y, N);
  gemv_tile_avx2<kind, M, 1>(x, K, w, n, n1, y, N);
}
#endif

#ifdef MLXVLM_X86
// The same with 16-wide vectors: half the instructions per weight byte, and R x M
// independent accumulators (8 for one row of x) to cover the FMA latency.
template <Half kind, int M, int R>
MLXVLM_AVX512 int64_t gemv_tile_avx512(const float* x, int64_t K, const uint16_t* w,
                                       int64_t n0, int64_t n1, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    const char* ahead = reinterpret_cast<const char*>(w + n * K) + kPrefetchBytes;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512 xs[M];
      for (int m = 0; m < M; m++) xs[m] = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; r++) {
        __m512 wv = load_half16<kind>(w + (n + r) * K + k);
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(wv, xs[m], acc[r][m]);
      }
      prefetch_ahead<32 * R>(ahead + 2 * R * k);
    }
    for (int r = 0; r < R; r++) {
      for (int m = 0; m < M; m++) {
        float total = _mm512_reduce_add_ps(acc[r][m]);
        for (int64_t kk = k; kk < K; kk++)
          total += x[m * K + kk] * half_to_float(w[(n + r) * K + kk], kind);
        y[m * N + n + r] = total;
      }
    }
  }
  return n;
}

// Weight rows per tile: R x M accumulators and M rows of x within the 32 registers.
template <Half kind, int M>
MLXVLM_AVX512 void gemv_avx512(const float* x, int64_t K, const uint16_t* w, int64_t n0,
                               int64_t n1, float* y, int64_t N) {
  constexpr int R = M == 1 ? 8 : M == 2 ? 4 : 2;
  int64_t n = gemv_tile_avx512<kind, M, R>(x, K, w, n0, n1, y, N);
  gemv_tile_avx512<kind, M, 1>(x, K, w, n, n1, y, N);
}
#endif

// Rows of x up to which the gemv runs (above it, prefill's GEMM): one pass over the
// weight rows with every row of x in registers. At 16 rows the GEMM measured faster.
constexpr int64_t kMaxHalfGemvRows = 8;

#ifdef MLXVLM_X86
#define MLXVLM_GEMV_CASES(ISA)                                  \
  switch (rows) {                                               \
    case 1: return gemv_##ISA<kind, 1>(x, K, w, n0, n1, y, N);  \
    case 2: return gemv_##ISA<kind, 2>(x, K, w, n0, n1, y, N);  \
    case 3: return gemv_##ISA<kind, 3>(x, K, w, n0, n1, y, N);  \
    case 4: return gemv_##ISA<kind, 4>(x, K, w, n0, n1, y, N);  \
    case 5: return gemv_##ISA<kind, 5>(x, K, w, n0, n1, y, N);  \
    case 6: return gemv_##ISA<kind, 6>(x, K, w, n0, n1, y, N);  \
    case 7: return gemv_##ISA<kind, 7>(x, K, w, n0, n1, y, N);  \
    case 8: return gemv_##ISA<kind, 8>(x, K, w, n0, n1, y, N);  \
  }
#endif

template <Half kind>
void gemv_rows(const float* x, int64_t rows, int64_t K, const uint16_t* w, int64_t n0,
               int64_t n1, float* y, int64_t N) {
#ifdef MLXVLM_X86
  if (has_avx512()) MLXVLM_GEMV_CASES(avx512)
  if (has_avx2()) MLXVLM_GEMV_CASES(avx2)
#endif
  gemv_portable<kind>(x, rows, K, w, n0, n1, y, N);
}

// A 16-bit weight's rows as float32, for compact_matmul's prefill.
struct HalfRows {
  const uint16_t* w;
  int64_t K;
  Half kind;

  void row(int64_t n, int64_t k0, int64_t kc, float* out) const {
    half_to_float(w + n * K + k0, out, kc, kind);
  }
};

}  // namespace

void half_gemv(const float* x, int64_t rows, int64_t K, const uint16_t* w, Half kind,
               int64_t n0, int64_t n1, float* y, int64_t N) {
  if (kind == Half::bfloat16)
    gemv_rows<Half::bfloat16>(x, rows, K, w, n0, n1, y, N);
  else
    gemv_rows<Half::float16>(x, rows, K, w, n0, n1, y, N);
}

void half_matmul(const float* x, int64_t rows, int64_t K, const uint16_t* w, Half kind,
                 int64_t N, const float* bias, const float* residual, float* y,
                 Prefill prefill) {
  compact_matmul(
      x, rows, K, N, bias, residual, y,
      [&](int64_t n0, int64_t n1) {
        if (kind == Half::bfloat16)
          gemv_rows<Half::bfloat16>(x, rows, K, w, n0, n1, y, N);
        else
          gemv_rows<Half::float16>(x, rows, K, w, n0, n1, y, N);
      },
      HalfRows{w, K, kind}, prefill, kMaxHalfGemvRows);
}

namespace {

// How prefill's products run (compact_matmul.h), decided once per process:
// MLXVLM_HALF_GEMM ("own" or "blas") if set, else the faster of the two on a 192 x 768 x
// 768 16-bit product (the best of four alternating runs each, ~10 ms in all). On a Zen 5
// EPYC whose OpenBLAS runs its AVX2 kernels the GEMM takes ~0.55x the time; a CPU whose
// AVX-512 units are no wider than its AVX2 ones (Zen 4 runs 512-bit operations in two
// halves) may do better with the BLAS.
PrefillChoice choose_prefill() {
  const std::string& wanted = half_gemm_setting();
  // An unknown value is said and left aside (like MLXVLM_CPU_ISA's).
  const std::string ignored = wanted.empty() || wanted == "own" || wanted == "blas" ? ""
      : "; MLXVLM_HALF_GEMM='" + wanted + "' ignored (expected own or blas)";
  // The BLAS, when asked for, is said to be so on any CPU: it is then the user's choice
  // as well as the only path a CPU without AVX-512 has.
  if (wanted == "blas") return {false, "conversion + sgemm (MLXVLM_HALF_GEMM=blas)"};
  if (!has_avx512()) return {false, "conversion + sgemm (the GEMM needs AVX-512)" + ignored};
  if (wanted == "own") return {true, "mlxvlm's AVX-512 GEMM (MLXVLM_HALF_GEMM=own)"};
  if (sgemm_pointer() == nullptr) return {true, "mlxvlm's AVX-512 GEMM (no sgemm)" + ignored};
  constexpr int64_t rows = 192, K = 768, N = 768;
  std::vector<float> x(rows * K), y(rows * N);
  std::vector<uint16_t> w(N * K);
  uint32_t state = 12345;
  auto next = [&state] { state = state * 1664525u + 1013904223u; return state; };
  for (auto& v : x) v = float(int(next() >> 9) - (1 << 22)) / float(1 << 22);
  for (auto& v : w) v = uint16_t(0x3c00 | (next() >> 22));  // bf16 in [2^-7, 2)
  auto milliseconds = [&](Prefill prefill) {
    auto start = std::chrono::steady_clock::now();
    half_matmul(x.data(), rows, K, w.data(), Half::bfloat16, N, nullptr, nullptr, y.data(),
                prefill);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
  };
  double own = INFINITY, blas = INFINITY;
  for (int round = 0; round < 4; round++) {
    own = std::min(own, milliseconds(Prefill::packed_gemm));
    blas = std::min(blas, milliseconds(Prefill::sgemm));
  }
  char why[160];
  std::snprintf(why, sizeof why, "%s (%.2f ms against %.2f ms for %s, measured at first use)",
                own < blas ? "mlxvlm's AVX-512 GEMM" : "conversion + sgemm",
                own < blas ? own : blas, own < blas ? blas : own,
                own < blas ? "conversion + sgemm" : "the AVX-512 GEMM");
  return {own < blas, why + ignored};
}

}  // namespace

const PrefillChoice& prefill_choice() {
  static const PrefillChoice choice = choose_prefill();
  return choice;
}

namespace {

// Inputs: x, the weight, then the bias and the residual where there are ones.
class HalfLinear : public CpuPrimitive {
 public:
  HalfLinear(Stream stream, bool has_bias, bool has_residual, bool residual_in_place)
      : CpuPrimitive(stream), has_bias_(has_bias), has_residual_(has_residual),
        residual_in_place_(residual_in_place) {}

  void dispatch(const std::vector<array>& inputs, array& out,
                cpu::CommandEncoder& encoder) override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    int64_t K = w.shape(1), N = w.shape(0), rows = x.size() / K;
    Half kind = w.dtype() == bfloat16 ? Half::bfloat16 : Half::float16;
    const float* bias = has_bias_ ? inputs[2].data<float>() : nullptr;
    std::optional<array> residual;
    if (has_residual_) residual = inputs[residual_index()];
    encoder.dispatch([x, residual, wp = w.data<uint16_t>(), yp = out.data<float>(), bias, rows,
                      K, N, kind]() {
      std::vector<float> x_copy, residual_copy;
      // Taken over as the output (in_place_input), the residual is y itself.
      const float* added = !residual ? nullptr
          : residual->data<float>() == yp ? yp
          : row_major(*residual, residual_copy);
      half_matmul(row_major(x, x_copy), rows, K, wp, kind, N, bias, added, yp);
    });
  }

  // The output takes over the residual's buffer when nothing else holds it, in prefill
  // (the small-row gemv writes the output before it reads the residual).
  int in_place_input() const override { return residual_in_place_ ? residual_index() : -1; }

  std::vector<array> vjp(const std::vector<array>& primals,
                         const std::vector<array>& cotangents,
                         const std::vector<int>& argnums,
                         const std::vector<array>&) override {
    const array& x = primals[0];
    const array& w = primals[1];
    const array& cotangent = cotangents[0];
    std::vector<array> grads;
    for (int arg : argnums) {
      int64_t N = w.shape(0);
      if (arg == 0) {
        grads.push_back(matmul(cotangent, astype(w, float32, stream()), stream()));
      } else if (has_residual_ && arg == residual_index()) {
        grads.push_back(cotangent);
      } else if (has_bias_ && arg == 2) {
        grads.push_back(sum(reshape(cotangent, {-1, int(N)}, stream()), 0, false, stream()));
      } else {
        int64_t K = w.shape(1);
        array flat_cotangent = reshape(cotangent, {-1, int(N)}, stream());
        array flat_x = reshape(x, {-1, int(K)}, stream());
        grads.push_back(astype(matmul(transpose(flat_cotangent, stream()), flat_x, stream()),
                               w.dtype(), stream()));
      }
    }
    return grads;
  }

  std::vector<array> jvp(const std::vector<array>& primals,
                         const std::vector<array>& tangents,
                         const std::vector<int>& argnums) override {
    const array& x = primals[0];
    const array& w = primals[1];
    std::optional<array> out;
    for (size_t i = 0; i < argnums.size(); i++) {
      const int arg = argnums[i];
      array term = arg == 0 ? half_linear(tangents[i], w, std::nullopt, std::nullopt, stream())
          : has_residual_ && arg == residual_index() ? tangents[i]
          : has_bias_ && arg == 2
          ? broadcast_to(tangents[i], output_shapes(primals)[0], stream())
          : matmul(x, transpose(astype(tangents[i], float32, stream()), stream()), stream());
      out = out ? add(*out, term, stream()) : term;
    }
    return {*out};
  }

  const char* name() const override { return "MlxvlmHalfLinear"; }
  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const HalfLinear&>(other);
    return has_bias_ == o.has_bias_ && has_residual_ == o.has_residual_ &&
           residual_in_place_ == o.residual_in_place_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int residual_index() const { return has_bias_ ? 3 : 2; }

  bool has_bias_, has_residual_, residual_in_place_;
};

}  // namespace

array half_linear(const array& x, const array& weight, const std::optional<array>& bias,
                  const std::optional<array>& residual, StreamOrDevice s) {
  if (weight.ndim() != 2 || (weight.dtype() != bfloat16 && weight.dtype() != float16))
    throw std::invalid_argument("[half_linear] weight must be a 2-D bfloat16/float16 matrix");
  if (x.ndim() < 1 || x.shape(-1) != weight.shape(1))
    throw std::invalid_argument("[half_linear] x's last axis must match the weight's columns");
  Stream stream = to_stream(s);
  std::vector<array> inputs{astype(x, float32, stream), contiguous_parameter(weight, stream)};
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != weight.shape(0))
      throw std::invalid_argument("[half_linear] bias must have one value per output");
    inputs.push_back(contiguous_parameter(astype(*bias, float32, stream), stream));
  }
  Shape shape = x.shape();
  shape.back() = weight.shape(0);
  if (residual) {
    if (residual->shape() != shape)
      throw std::invalid_argument("[half_linear] residual must have the output's shape");
    inputs.push_back(astype(*residual, float32, stream));
  }
  const bool prefill = x.size() / weight.shape(1) > kMaxHalfGemvRows;
  return array(shape, float32,
               std::make_shared<HalfLinear>(stream, bias.has_value(), residual.has_value(),
                                            residual.has_value() && prefill),
               std::move(inputs));
}

}  // namespace mlxvlm
