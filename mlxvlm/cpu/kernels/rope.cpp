// Rotary position embedding (RoPE) in float32, as one operation.
//
// MLX's CPU backend has no RoPE kernel: `mx.fast.rope` becomes its composition of ~20
// operations (positions, inverse frequencies, cos, sin, two half products, concatenate,
// and the broadcasts between them), twice per decoder layer. For a decoding step each
// of those costs ~10 us of dispatch for a few hundred floats of work; this primitive is
// one operation. The maths is MLX's (mlx/fast.cpp):
//   position p = (t + offset) * scale, frequency f_i = base^(-i / (dims / 2)) or
//   1 / freqs[i], angle p * f_i (float32); the pair (x_a, x_b) becomes
//   (x_a cos - x_b sin, x_a sin + x_b cos), with a = i, b = i + dims/2 (or a = 2i,
//   b = 2i + 1 when traditional); features past `dims` pass through. The inverse
//   rotation (sin negated) is the vector-Jacobian product.
//
// `rotary` is the same rotation from cos/sin tables that a model computed itself
// (transformers' `x * cos + rotate_half(x) * sin`: Qwen's M-RoPE, whose angles come from
// three position axes), one operation where MLX composes seven.
#include <cmath>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_primitive.h"
#include "kernels.h"

namespace mlxvlm {

using namespace mlx::core;

namespace {

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool forward;
  bool has_freqs;
};

class RopePrimitive : public CpuPrimitive {
 public:
  RopePrimitive(Stream stream, RopeParams p) : CpuPrimitive(stream), p_(p) {}

  void dispatch(const std::vector<array>& inputs, array& out,
                cpu::CommandEncoder& encoder) override {
    encoder.dispatch([x = inputs[0], offsets = inputs[1],
                      freqs = p_.has_freqs ? inputs[2] : inputs[1], p = p_,
                      y = out.data<float>()]() {
      int64_t D = x.shape(-1), T = x.shape(-2), half = p.dims / 2;
      int64_t rows = x.size() / D;
      // The offset vector has one entry per batch entry (x's first axis).
      int64_t batches = int64_t(offsets.size()), per_batch = rows / x.shape(0);
      std::vector<float> inverse(half);
      for (int64_t i = 0; i < half; i++) {
        inverse[i] = p.has_freqs
            ? 1.0f / freqs.data<float>()[i]
            : float(std::exp(-double(i) * (std::log(double(p.base)) / double(half))));
      }
      // cos and sin for each (batch entry, position), shared by every head.
      std::vector<float> table(size_t(batches * T * half * 2));
      parallel_for(batches * T, std::max<int64_t>(1, 2048 / half), [&](int64_t s0, int64_t s1) {
        for (int64_t bt = s0; bt < s1; bt++) {
          int32_t offset = offsets.data<int32_t>()[elem_to_loc(int(bt / T), offsets)];
          float position = (float(bt % T) + float(offset)) * p.scale;
          float* row = table.data() + bt * half * 2;
          for (int64_t i = 0; i < half; i++) {
            double angle = double(position * inverse[i]);
            row[i] = float(std::cos(angle));
            row[half + i] = float(p.forward ? std::sin(angle) : -std::sin(angle));
          }
        }
      });
      const float* source = x.data<float>();
      const auto& shape = x.shape();
      const auto& strides = x.strides();
      int64_t last_stride = strides.back();
      parallel_for(rows, std::max<int64_t>(1, (1 << 14) / D), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
          int64_t loc = 0;  // where row r starts in x's buffer
          for (int64_t axis = x.ndim() - 2, rest = r; axis >= 0; axis--) {
            loc += (rest % shape[axis]) * strides[axis];
            rest /= shape[axis];
          }
          const float* in = source + loc;
          float* o = y + r * D;
          int64_t b = batches > 1 ? r / per_batch : 0;
          const float* cs = table.data() + (b * T + r % T) * half * 2;
          const float* sn = cs + half;
          for (int64_t i = 0; i < half; i++) {
            int64_t a = p.traditional ? 2 * i : i, c = p.traditional ? 2 * i + 1 : i + half;
            float xa = in[a * last_stride], xb = in[c * last_stride];
            o[a] = xa * cs[i] - xb * sn[i];
            o[c] = xa * sn[i] + xb * cs[i];
          }
          for (int64_t d = p.dims; d < D; d++) o[d] = in[d * last_stride];
        }
      });
    });
  }

  std::vector<array> vjp(const std::vector<array>& primals,
                         const std::vector<array>& cotangents,
                         const std::vector<int>& argnums,
                         const std::vector<array>&) override {
    for (int arg : argnums)
      if (arg != 0) throw std::invalid_argument("[rope] no gradient for offsets or freqs");
    return {inverse(cotangents[0], primals)};
  }

  std::vector<array> jvp(const std::vector<array>& primals,
                         const std::vector<array>& tangents,
                         const std::vector<int>& argnums) override {
    for (int arg : argnums)
      if (arg != 0) throw std::invalid_argument("[rope] no derivative for offsets or freqs");
    return {rotated(tangents[0], primals, p_.forward)};
  }

  const char* name() const override { return "MlxvlmRoPE"; }
  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const RopePrimitive&>(other).p_;
    return p_.dims == o.dims && p_.traditional == o.traditional && p_.base == o.base &&
        p_.scale == o.scale && p_.forward == o.forward && p_.has_freqs == o.has_freqs;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  // The same rotation (or its inverse) of `x`, with this primitive's offsets and freqs.
  array rotated(const array& x, const std::vector<array>& primals, bool forward) {
    RopeParams p = p_;
    p.forward = forward;
    std::vector<array> inputs{astype(x, float32, stream())};
    inputs.insert(inputs.end(), primals.begin() + 1, primals.end());
    return array(x.shape(), float32, std::make_shared<RopePrimitive>(stream(), p),
                 std::move(inputs));
  }
  array inverse(const array& x, const std::vector<array>& primals) {
    return rotated(x, primals, !p_.forward);
  }

  RopeParams p_;
};

// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[half:], x[:half]]: the
// composition whose derivatives the kernel below takes.
std::vector<array> rotary_reference(const std::vector<array>& in, Stream s) {
  const array &x = in[0], &cos = in[1], &sin = in[2];
  int half = x.shape(-1) / 2;
  Shape start(x.ndim(), 0), middle = x.shape();
  middle.back() = half;
  Shape upper(x.ndim(), 0);
  upper.back() = half;
  array rotated = concatenate(
      {negative(slice(x, upper, x.shape(), s), s), slice(x, start, middle, s)}, -1, s);
  return {add(multiply(x, cos, s), multiply(rotated, sin, s), s)};
}

class RotaryTablePrimitive : public ReferencedPrimitive {
 public:
  using ReferencedPrimitive::ReferencedPrimitive;

  void dispatch(const std::vector<array>& inputs, array& out,
                cpu::CommandEncoder& encoder) override {
    encoder.dispatch([x = inputs[0], cos = inputs[1], sin = inputs[2], y = out.data<float>()]() {
      int64_t D = x.shape(-1), half = D / 2, rows = x.size() / D, ndim = x.ndim();
      // Each table's strides over x's axes: 0 where it broadcasts.
      auto aligned = [&](const array& t) {
        std::vector<int64_t> strides(ndim, 0);
        for (int64_t axis = 0; axis < t.ndim(); axis++) {
          int64_t target = ndim - t.ndim() + axis;
          if (t.shape(axis) != 1) strides[target] = t.strides()[axis];
        }
        return strides;
      };
      std::vector<int64_t> x_strides(x.strides().begin(), x.strides().end());
      std::vector<int64_t> cos_strides = aligned(cos), sin_strides = aligned(sin);
      const float *xs = x.data<float>(), *cs = cos.data<float>(), *ss = sin.data<float>();
      parallel_for(rows, std::max<int64_t>(1, (1 << 14) / D), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
          int64_t xl = 0, cl = 0, sl = 0;  // where row r starts in each buffer
          for (int64_t axis = ndim - 2, rest = r; axis >= 0; axis--) {
            int64_t i = rest % x.shape(axis);
            rest /= x.shape(axis);
            xl += i * x_strides[axis];
            cl += i * cos_strides[axis];
            sl += i * sin_strides[axis];
          }
          const float *in = xs + xl, *c = cs + cl, *sn = ss + sl;
          int64_t xd = x_strides.back(), cd = cos_strides.back(), sd = sin_strides.back();
          float* o = y + r * D;
          for (int64_t i = 0; i < half; i++) {
            float a = in[i * xd], b = in[(i + half) * xd];
            o[i] = a * c[i * cd] - b * sn[i * sd];
            o[i + half] = b * c[(i + half) * cd] + a * sn[(i + half) * sd];
          }
        }
      });
    });
  }

  std::vector<array> reference(const std::vector<array>& in) override {
    return rotary_reference(in, stream());
  }

  const char* name() const override { return "MlxvlmRotary"; }
  bool is_equivalent(const Primitive&) const override { return true; }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
};

}  // namespace

array rotary(const array& x, const array& cos, const array& sin, StreamOrDevice s) {
  if (x.dtype() != float32 || cos.dtype() != float32 || sin.dtype() != float32)
    throw std::invalid_argument("[rotary] x, cos and sin must be float32");
  if (x.ndim() < 1 || x.shape(-1) % 2)
    throw std::invalid_argument("[rotary] x's last axis must be even");
  for (const array* table : {&cos, &sin}) {
    if (table->ndim() > x.ndim() || broadcast_shapes(table->shape(), x.shape()) != x.shape())
      throw std::invalid_argument("[rotary] cos and sin must broadcast to x's shape");
  }
  return array(x.shape(), float32, std::make_shared<RotaryTablePrimitive>(to_stream(s)),
               {x, cos, sin});
}

array rope(const array& x, int dims, bool traditional, std::optional<float> base, float scale,
           const array& offset, const std::optional<array>& freqs, StreamOrDevice s) {
  if (x.ndim() < 3) throw std::invalid_argument("[rope] x needs at least 3 axes");
  if (x.dtype() != float32) throw std::invalid_argument("[rope] x must be float32");
  if (dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("[rope] dims must be even, positive and at most x's last axis");
  if (offset.ndim() > 1 || (offset.size() != 1 && int(offset.size()) != x.shape(0)))
    throw std::invalid_argument("[rope] offset must be a scalar or one per batch entry");
  if (!issubdtype(offset.dtype(), integer))
    throw std::invalid_argument("[rope] offset must be an integer");
  if (freqs.has_value() == base.has_value())
    throw std::invalid_argument("[rope] give exactly one of base and freqs");
  Stream stream = to_stream(s);
  std::vector<array> inputs{x, astype(offset, int32, stream)};
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)
      throw std::invalid_argument("[rope] freqs must have dims / 2 entries");
    inputs.push_back(contiguous_parameter(astype(*freqs, float32, stream), stream));
  }
  RopeParams p{dims, traditional, base.value_or(1.0f), scale, true, freqs.has_value()};
  return array(x.shape(), float32, std::make_shared<RopePrimitive>(stream, p),
               std::move(inputs));
}

}  // namespace mlxvlm
