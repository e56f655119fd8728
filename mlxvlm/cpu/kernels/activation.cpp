// Element-wise activations in float32, optionally gated: act(x) or act(x) * up.
//
// MLX's x86-64 CPU wheel evaluates exp/tanh/sigmoid one float at a time (see
// models/layers/fast_math.py); GELU over one SigLIP MLP's 1024 x 3072 activations took
// ~38 ms there even on fast_math's compiled polynomial, against ~2-3 ms here with AVX2
// and the work split over the CPU threads. All of them are x * sigmoid(z) for some z:
//   gelu_tanh   z = 2 sqrt(2/pi) (x + 0.044715 x^3)   (0.5 x (1 + tanh(z/2)))
//   quick_gelu  z = 1.702 x
//   silu        z = x
// and exp, for softmax-like uses.
#include <vector>

#include "cpu_parallel.h"
#include "cpu_primitive.h"
#include "kernels.h"
#include "vector_math.h"

namespace mlxvlm {

using namespace mlx::core;

namespace {

constexpr int64_t kMinPerWorker = 1 << 15;
constexpr float kGeluTanh = 1.5957691216057308f;  // 2 sqrt(2 / pi)

inline float sigmoid_argument(float x, Activation kind) {
  switch (kind) {
    case Activation::gelu_tanh: return kGeluTanh * (x + 0.044715f * x * x * x);
    case Activation::quick_gelu: return 1.702f * x;
    default: return x;
  }
}

inline float activate(float x, Activation kind) {
  if (kind == Activation::exp) return exp_scalar(x);
  return x / (1.0f + exp_scalar(-sigmoid_argument(x, kind)));
}

#ifdef MLXVLM_X86
template <Activation kind>
MLXVLM_AVX2 inline __m256 activate8(__m256 x) {
  if constexpr (kind == Activation::exp) return exp8(x);
  __m256 z = x;
  if constexpr (kind == Activation::gelu_tanh) {
    __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    z = _mm256_mul_ps(_mm256_set1_ps(kGeluTanh),
                      _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
  } else if constexpr (kind == Activation::quick_gelu) {
    z = _mm256_mul_ps(_mm256_set1_ps(1.702f), x);
  }
  __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

template <Activation kind>
MLXVLM_AVX2 void activate_avx2(const float* x, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 y = activate8<kind>(_mm256_loadu_ps(x + i));
    if (up) y = _mm256_mul_ps(y, _mm256_loadu_ps(up + i));
    _mm256_storeu_ps(out + i, y);
  }
  for (; i < n; i++) out[i] = activate(x[i], kind) * (up ? up[i] : 1.0f);
}
#endif

void activate_range(const float* x, const float* up, float* out, int64_t n, Activation kind) {
#ifdef MLXVLM_X86
  if (has_avx2()) {
    switch (kind) {
      case Activation::gelu_tanh: return activate_avx2<Activation::gelu_tanh>(x, up, out, n);
      case Activation::quick_gelu: return activate_avx2<Activation::quick_gelu>(x, up, out, n);
      case Activation::silu: return activate_avx2<Activation::silu>(x, up, out, n);
      case Activation::exp: return activate_avx2<Activation::exp>(x, up, out, n);
    }
  }
#endif
  for (int64_t i = 0; i < n; i++) out[i] = activate(x[i], kind) * (up ? up[i] : 1.0f);
}

// Its derivatives are those of MLX's own functions (mlx.nn's gelu_approx, gelu_fast_approx
// and silu, mx.exp; times up when gated), written with the same operations below. Being
// the primitive's own (not an mx.custom_function around it, which holds on to x), x's
// buffer can be taken over as the output.
class ActivationPrimitive : public ReferencedPrimitive {
 public:
  ActivationPrimitive(Stream stream, Activation kind)
      : ReferencedPrimitive(stream), kind_(kind) {}

  void dispatch(const std::vector<array>& inputs, array& out,
                cpu::CommandEncoder& encoder) override {
    std::optional<array> up;
    if (inputs.size() > 1) up = inputs[1];
    encoder.dispatch([x = inputs[0], up, y = out.data<float>(), n = int64_t(out.size()),
                      kind = kind_]() {
      std::vector<float> x_copy, up_copy;
      const float* xp = row_major(x, x_copy);
      const float* upp = up ? row_major(*up, up_copy) : nullptr;
      parallel_for(n, kMinPerWorker, [&](int64_t start, int64_t stop) {
        activate_range(xp + start, upp ? upp + start : nullptr, y + start, stop - start, kind);
      });
    });
  }

  // activate_range reads x[i] (and up[i]) before writing out[i]: x's buffer can be reused.
  int in_place_input() const override { return 0; }

  const char* name() const override { return "MlxvlmActivation"; }

  bool is_equivalent(const Primitive& other) const override {
    return kind_ == static_cast<const ActivationPrimitive&>(other).kind_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

 protected:
  std::vector<array> reference(const std::vector<array>& in) override {
    const Stream s = stream();
    const array& x = in[0];
    auto scalar = [](double v) { return array(float(v), float32); };
    array y = [&]() -> array {
      switch (kind_) {
        case Activation::exp: return exp(x, s);
        case Activation::gelu_tanh: {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
          array inner = multiply(scalar(0.7978845608028654),
                                 add(x, multiply(scalar(0.044715), power(x, scalar(3), s), s), s), s);
          return multiply(multiply(scalar(0.5), x, s), add(scalar(1), tanh(inner, s), s), s);
        }
        case Activation::quick_gelu: return multiply(x, sigmoid(multiply(scalar(1.702), x, s), s), s);
        default: return multiply(x, sigmoid(x, s), s);  // silu
      }
    }();
    return {in.size() > 1 ? multiply(y, in[1], s) : y};
  }

 private:
  Activation kind_;
};

}  // namespace

array activation(const array& x, Activation kind, const std::optional<array>& up,
                 StreamOrDevice s) {
  Stream stream = to_stream(s);
  std::vector<array> inputs{astype(x, float32, stream)};
  if (up) {
    if (up->shape() != x.shape())
      throw std::invalid_argument("[activation] up must have x's shape");
    inputs.push_back(astype(*up, float32, stream));
  }
  return array(x.shape(), float32, std::make_shared<ActivationPrimitive>(stream, kind),
               std::move(inputs));
}

}  // namespace mlxvlm
