// softmax(scale * q k^T + mask) v in float32, for MLX's CPU backend.
//
// MLX computes attention on the CPU as a score matmul, a softmax made of single-threaded
// element-wise kernels, and a value matmul; the softmax dominated (one SigLIP layer over
// 1024 patches: ~220 ms of attention, most of it outside the matmuls). Here, for each
// (batch, head) and block of query rows (~1 MB of scores, so they stay in cache):
//   scores = scale * q_block . k^T            sgemm (OpenBLAS, its own threads)
//   mask, row max, exp and row sums           vectorised, rows split over the pool
//   out_block = weights . v, / row sums       sgemm, then the pool
// Masks: none, causal (query i sees keys up to i + keys - queries), or an additive float32
// mask with any broadcast strides over (batch, head, query, key). Keys past the causal
// limit are not computed at all. Grouped-query attention maps head h to kv head
// h / (heads / kv_heads).
#include <algorithm>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "blas.h"
#include "cpu_parallel.h"
#include "kernels.h"
#include "vector_math.h"

namespace mlxvlm {

using namespace mlx::core;

namespace {

constexpr int64_t kBlockScores = 1 << 18;  // float32 scores per query block (1 MB)

struct AttentionShape {
  int64_t batch, heads, kv_heads, queries, keys, dims;
};

struct MaskView {
  const float* data = nullptr;  // null: no mask
  int64_t batch_stride = 0, head_stride = 0, query_stride = 0, key_stride = 0;
};

void attention(const float* q, const float* k, const float* v, const MaskView& mask,
               bool causal, float scale, const AttentionShape& s, float* out) {
  const int64_t repeats = s.heads / s.kv_heads;
  const int64_t causal_offset = s.keys - s.queries;
  const int64_t block = std::clamp<int64_t>(kBlockScores / std::max<int64_t>(1, s.keys), 1,
                                            s.queries);
  std::vector<float> scores(static_cast<size_t>(block * s.keys));
  std::vector<float> row_sums(static_cast<size_t>(block));
  for (int64_t b = 0; b < s.batch; b++) {
    for (int64_t h = 0; h < s.heads; h++) {
      const int64_t kv = b * s.kv_heads + h / repeats;
      const float* keys = k + kv * s.keys * s.dims;
      const float* values = v + kv * s.keys * s.dims;
      const float* queries = q + (b * s.heads + h) * s.queries * s.dims;
      float* output = out + (b * s.heads + h) * s.queries * s.dims;
      const float* mask_head =
          mask.data ? mask.data + b * mask.batch_stride + h * mask.head_stride : nullptr;
      for (int64_t i0 = 0; i0 < s.queries; i0 += block) {
        const int64_t rows = std::min(block, s.queries - i0);
        // Keys any row of this block may see; later ones are never computed.
        const int64_t visible =
            causal ? std::clamp<int64_t>(i0 + rows + causal_offset, 0, s.keys) : s.keys;
        if (visible == 0) {  // no key visible to any row: MLX gives NaN; so do we
          std::fill(output + i0 * s.dims, output + (i0 + rows) * s.dims, NAN);
          continue;
        }
        sgemm(true, int(rows), int(visible), int(s.dims), scale, queries + i0 * s.dims,
              int(s.dims), keys, int(s.dims), 0.0f, scores.data(), int(visible));
        parallel_for(rows, 8, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; r++) {
            float* row = scores.data() + r * visible;
            int64_t seen = visible;
            if (causal) {
              seen = std::clamp<int64_t>(i0 + r + causal_offset + 1, 0, visible);
              std::fill(row + seen, row + visible, 0.0f);
            }
            if (mask_head) {
              const float* m = mask_head + (i0 + r) * mask.query_stride;
              for (int64_t j = 0; j < seen; j++) row[j] += m[j * mask.key_stride];
            }
            if (seen == 0) {
              row_sums[r] = NAN;
              continue;
            }
            row_sums[r] = exp_shifted_sum(row, seen, row_max(row, seen));
          }
        });
        sgemm(false, int(rows), int(s.dims), int(visible), 1.0f, scores.data(), int(visible),
              values, int(s.dims), 0.0f, output + i0 * s.dims, int(s.dims));
        parallel_for(rows * s.dims, 1 << 14, [&](int64_t e0, int64_t e1) {
          for (int64_t e = e0; e < e1; e++) output[i0 * s.dims + e] /= row_sums[e / s.dims];
        });
      }
    }
  }
}

class Attention : public UnaryPrimitive {
 public:
  Attention(Stream stream, float scale, bool causal, bool has_mask)
      : UnaryPrimitive(stream), scale_(scale), causal_(causal), has_mask_(has_mask) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& q = inputs[0];
    const array& k = inputs[1];
    const array& v = inputs[2];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    AttentionShape shape{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3)};
    MaskView mask;
    if (has_mask_) {
      const array& m = inputs[3];
      mask = {m.data<float>(), m.strides(0), m.strides(1), m.strides(2), m.strides(3)};
    }
    encoder.dispatch([qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(),
                      op = out.data<float>(), mask, shape, scale = scale_, causal = causal_]() {
      attention(qp, kp, vp, mask, causal, scale, shape, op);
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[mlxvlm.Attention] CPU only");
  }

  const char* name() const override { return "MlxvlmAttention"; }
  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && has_mask_ == o.has_mask_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_, has_mask_;
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
  auto prepare = [&](const array& a) {
    return contiguous(astype(a, float32, stream), false, stream);
  };
  std::vector<array> inputs{prepare(q), prepare(k), prepare(v)};
  if (mask) {
    Shape scores{q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    inputs.push_back(broadcast_to(astype(*mask, float32, stream), scores, stream));
  }
  return array(q.shape(), float32,
               std::make_shared<Attention>(stream, scale, causal, mask.has_value()),
               std::move(inputs));
}

}  // namespace mlxvlm
