// softmax(scale * q k^T + mask) v in float32, for MLX's CPU backend: the MLX primitive,
// and the path for CPUs without AVX-512 (those with it take attention_avx512.cpp's).
//
// MLX computes attention on the CPU as a score matmul, a softmax made of single-threaded
// element-wise kernels and a value matmul (one SigLIP layer over 1024 patches: ~190 ms;
// PyTorch's fused kernel: ~30 ms; the path here: ~55-65 ms; AVX-512's: ~30 ms). For each
// (batch, head) and block of query rows, so that the block's scores stay in cache:
//   scores = scale * q_block . k^T       sgemm (OpenBLAS, which threads itself)
//   + mask, row max, exp, row sums       vectorised, rows split over the CPU threads
//   out_block = weights . v, / row sums  sgemm, then the rows scaled
// (Register-tiled AVX2 products on mlxvlm's threads instead of sgemm measured no faster
// end to end on a 2-core machine: 70 ms on one thread, 57 on two, as the sgemm path.)
//
// Masks: none, causal (query i sees keys up to i + keys - queries; later keys are not
// computed), or an additive float32 (or boolean) mask with any broadcast strides over (batch, head,
// query, key). Grouped-query attention maps head h to kv head h / (heads / kv_heads).
// q, k and v are read through their strides (the usual (B, L, H, D) -> (B, H, L, D)
// transposes cost no copy), and the output is written as (B, L, H, D) and returned
// transposed, so a caller's transpose back and reshape to (B, L, H * D) is free too.
#include <algorithm>
#include <vector>

#include "attention.h"
#include "blas.h"
#include "cpu_parallel.h"
#include "cpu_primitive.h"
#include "kernels.h"
#include "mlx/fast.h"
#include "scratch.h"
#include "vector_math.h"

namespace mlxvlm {

namespace attention_cpu {

namespace {

// Scores per query block (1 MB of float32): measured fastest among 256 KB - 4 MB for a
// SigLIP layer (12 heads x 1024 x 1024) on a 2-core x86-64 machine.
constexpr int64_t kBlockScores = 1 << 18;

// Mask, maximum, exponentials and sum of one row of scores; returns 1 / sum (NaN when the
// row sees no key, as MLX gives).
float softmax_row(const Problem& p, float* row, int64_t b, int64_t h, int64_t query,
                  int64_t width) {
  int64_t seen = visible_keys(p, query);
  std::fill(row + seen, row + width, 0.0f);
  if (seen == 0) return NAN;
  if (p.mask.data) p.mask.add_to(row, b, h, query, 0, seen);
  return 1.0f / exp_shifted_sum(row, seen, row_max(row, seen));
}

}  // namespace

void attention_sgemm(const Problem& p) {
  const int64_t repeats = p.heads / p.kv_heads;
  const int64_t block = std::clamp<int64_t>(kBlockScores / std::max<int64_t>(1, p.keys), 1,
                                            p.queries);
  const int64_t out_row = p.heads * p.dims;
  Scratch scores(static_cast<size_t>(block * p.keys));
  std::vector<float> inv(static_cast<size_t>(block));
  for (int64_t b = 0; b < p.batch; b++) {
    for (int64_t h = 0; h < p.heads; h++) {
      const int64_t kv = h / repeats;
      for (int64_t i0 = 0; i0 < p.queries; i0 += block) {
        const int64_t rows = std::min(block, p.queries - i0);
        const int64_t visible =
            p.causal ? std::max<int64_t>(visible_keys(p, i0 + rows - 1), 1) : p.keys;
        sgemm(true, int(rows), int(visible), int(p.dims), p.scale, p.q.at(b, h, i0),
              int(p.q.row), p.k.at(b, kv, 0), int(p.k.row), 0.0f, scores.data(), int(visible));
        parallel_for(rows, 8, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; r++)
            inv[r] = softmax_row(p, scores.data() + r * visible, b, h, i0 + r, visible);
        });
        float* out = p.out + (b * p.queries + i0) * out_row + h * p.dims;
        sgemm(false, int(rows), int(p.dims), int(visible), 1.0f, scores.data(), int(visible),
              p.v.at(b, kv, 0), int(p.v.row), 0.0f, out, int(out_row));
        for (int64_t r = 0; r < rows; r++)
          for (int64_t d = 0; d < p.dims; d++) out[r * out_row + d] *= inv[r];
      }
    }
  }
}

}  // namespace attention_cpu

using namespace mlx::core;
using namespace attention_cpu;

namespace {

// A unit-stride-columns view of `a` (B, H, L, D), copying it into `storage` if its
// columns or rows are not laid out for that.
View view_of(const array& a, std::vector<float>& storage) {
  const auto& st = a.strides();
  int64_t B = a.shape(0), H = a.shape(1), L = a.shape(2), D = a.shape(3);
  if (st[3] == 1 && st[2] >= D) return {a.data<float>(), st[0], st[1], st[2]};
  storage.resize(static_cast<size_t>(B * H * L * D));
  const float* src = a.data<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t l = 0; l < L; l++)
        for (int64_t d = 0; d < D; d++)
          storage[((b * H + h) * L + l) * D + d] = src[b * st[0] + h * st[1] + l * st[2] + d * st[3]];
  return {storage.data(), H * L * D, L * D, D};
}

class Attention : public ReferencedPrimitive {
 public:
  Attention(Stream stream, float scale, bool causal, bool has_mask, bool boolean_mask)
      : ReferencedPrimitive(stream), scale_(scale), causal_(causal), has_mask_(has_mask),
        boolean_mask_(boolean_mask) {}

  void dispatch(const std::vector<array>& inputs, array& out,
                cpu::CommandEncoder& encoder) override {
    const array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    Problem p{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
              {}, {}, {}, {}, causal_, scale_, out.data<float>()};
    if (has_mask_) {
      const array& m = inputs[3];
      p.mask = {m.data<void>(), boolean_mask_, m.strides(0), m.strides(1), m.strides(2),
                m.strides(3)};
    }
    // Arrays are captured so their buffers outlive the task; views are taken in it.
    encoder.dispatch([p, q, k, v]() mutable {
      std::vector<float> q_copy, k_copy, v_copy;
      p.q = view_of(q, q_copy);
      p.k = view_of(k, k_copy);
      p.v = view_of(v, v_copy);
      if (has_avx512())
        attention_avx512(p);
      else
        attention_sgemm(p);
    });
  }

  const char* name() const override { return "MlxvlmAttention"; }
  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && has_mask_ == o.has_mask_ &&
        boolean_mask_ == o.boolean_mask_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    const Shape& q = inputs[0].shape();
    return {{q[0], q[2], q[1], q[3]}};
  }

 private:
  // MLX's attention of (q, k, v[, mask]) (a boolean mask in its additive form, as here)
  // in this primitive's output layout (B, L, H, D): the derivatives' reference.
  std::vector<array> reference(const std::vector<array>& in) override {
    std::optional<array> mask;
    if (in.size() > 3)
      mask = boolean_mask_ ? where(in[3], array(0.0f), array(MaskView::kMaskedOut), stream())
                           : in[3];
    array out = fast::scaled_dot_product_attention(in[0], in[1], in[2], scale_,
                                                   causal_ ? "causal" : (mask ? "array" : ""),
                                                   mask, {}, false, stream());
    return {transpose(out, {0, 2, 1, 3}, stream())};
  }

  float scale_;
  bool causal_, has_mask_, boolean_mask_;
};

}  // namespace

array attention(const array& q, const array& k, const array& v, float scale, bool causal,
                const std::optional<array>& mask, StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument("[attention] q, k, v must be (batch, heads, length, dims)");
  if (k.shape() != v.shape() || k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) ||
      k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("[attention] k/v shapes do not fit q");
  Stream stream = to_stream(s);
  std::vector<array> inputs{astype(q, float32, stream), astype(k, float32, stream),
                            astype(v, float32, stream)};
  const bool boolean_mask = mask && mask->dtype() == bool_;
  if (mask) {  // read in place through broadcast strides; a boolean one as it is
    Shape scores{q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    inputs.push_back(broadcast_to(boolean_mask ? *mask : astype(*mask, float32, stream),
                                  scores, stream));
  }
  Shape out_shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)};  // (B, L, H, D)
  array out(out_shape, float32,
            std::make_shared<Attention>(stream, scale, causal, mask.has_value(), boolean_mask),
            std::move(inputs));
  return transpose(out, {0, 2, 1, 3}, stream);
}

}  // namespace mlxvlm
