// y[r] = x[r] . bank[expert[r]]^T for a mixture-of-experts bank of 16-bit matrices
// (experts x N x K), x and y float32: what mlx-lm's SwitchLinear computes with gather_mm,
// without the float32 copy of the bank that gather_mm needs on the CPU backend (MoE
// checkpoints are mostly their banks, so that copy doubled their memory).
//
// The rows are grouped by expert and each expert's rows go through half_linear's product
// (half_matmul.h): a decoding token's k experts are k gemvs that read only those experts'
// matrices, converting them as they stream, spread over the threads together; a prefill
// chunk's rows of one expert are one GEMM over that expert's matrix, where gather_mm runs
// one product per row. Rows already grouped (mlx-lm's SwitchGLU sorts long inputs by
// expert) are read and written in place.
#include <algorithm>
#include <optional>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_primitive.h"
#include "half_matmul.h"
#include "kernels.h"

namespace mlxvlm {

using namespace mlx::core;

namespace {

// One expert's rows of a call: read from x and written to y in place when they are
// consecutive there, else packed into scratch rows and scattered back after.
struct Group {
  int64_t expert, count;
  const int64_t* rows;  // ascending
  const float* x;
  float* y;
  bool packed;
};

// A row naming no expert of the bank (an index out of range) gets zeros: the kernel runs
// inside MLX's evaluation, where it cannot raise.
void gathered_matmul(const float* x, const uint32_t* experts, int64_t rows, int64_t K,
                     const uint16_t* bank, Half kind, int64_t E, int64_t N, float* y) {
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t r = 0; r < rows; r++) {
    if (experts[r] < E) start[experts[r] + 1]++;
    else std::fill(y + r * N, y + (r + 1) * N, 0.0f);
  }
  for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
  std::vector<int64_t> order(start[E]), next(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < rows; r++)
    if (experts[r] < E) order[next[experts[r]]++] = r;
  std::vector<Group> groups;
  int64_t packed_rows = 0, most = 0;
  for (int64_t e = 0; e < E; e++) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) continue;
    const int64_t* group = order.data() + start[e];
    const bool packed = group[count - 1] - group[0] != count - 1;
    groups.push_back({e, count, group, x + group[0] * K, y + group[0] * N, packed});
    packed_rows += packed ? count : 0;
    most = std::max(most, count);
  }
  std::vector<float> xs(packed_rows * K), ys(packed_rows * N);
  for (int64_t i = 0, offset = 0; i < int64_t(groups.size()); i++) {
    Group& g = groups[i];
    if (!g.packed) continue;
    for (int64_t j = 0; j < g.count; j++)
      std::copy(x + g.rows[j] * K, x + (g.rows[j] + 1) * K, xs.data() + (offset + j) * K);
    g.x = xs.data() + offset * K;
    g.y = ys.data() + offset * N;
    offset += g.count;
  }
  if (most <= kMaxGemvRows) {
    // Decoding: every expert's product is a gemv, all of them spread over the threads in
    // one pass over their output columns (a pool dispatch each costs more than a gemv).
    const int64_t G = groups.size();
    parallel_for(G * N, std::max<int64_t>(1, kMinGemvPerWorker / K), [&](int64_t a, int64_t b) {
      while (a < b) {
        const Group& g = groups[a / N];
        const int64_t n0 = a % N, n1 = std::min(N, n0 + (b - a));
        half_gemv(g.x, g.count, K, bank + g.expert * N * K, kind, n0, n1, g.y, N);
        a += n1 - n0;
      }
    });
  } else {
    for (const Group& g : groups)
      half_matmul(g.x, g.count, K, bank + g.expert * N * K, kind, N, nullptr, nullptr, g.y);
  }
  for (const Group& g : groups)
    if (g.packed)
      for (int64_t j = 0; j < g.count; j++)
        std::copy(g.y + j * N, g.y + (j + 1) * N, y + g.rows[j] * N);
}

// MLX's own computation of the same function: gather_mm over the bank in float32. Its
// reverse-mode derivatives are the kernel's (the expert indices have none).
array reference(const array& x, const array& bank, const array& experts, Stream s) {
  array rhs = swapaxes(astype(bank, float32, s), -1, -2, s);
  return squeeze(gather_mm(expand_dims(x, -2, s), rhs, std::nullopt, experts, false, s), -2, s);
}

// Inputs: x (..., K) float32, the bank (E, N, K), one uint32 expert per row of x.
class GatheredHalfLinear : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void dispatch(const std::vector<array>& inputs, array& out,
                cpu::CommandEncoder& encoder) override {
    const array& x = inputs[0];
    const array& bank = inputs[1];
    const array& experts = inputs[2];
    int64_t E = bank.shape(0), N = bank.shape(1), K = bank.shape(2), rows = x.size() / K;
    Half kind = bank.dtype() == bfloat16 ? Half::bfloat16 : Half::float16;
    encoder.dispatch([x, experts, wp = bank.data<uint16_t>(), yp = out.data<float>(), rows, K,
                      E, N, kind]() {
      std::vector<float> x_copy;
      std::vector<uint32_t> experts_copy;
      gathered_matmul(row_major(x, x_copy), row_major(experts, experts_copy), rows, K, wp,
                      kind, E, N, yp);
    });
  }

  std::vector<array> vjp(const std::vector<array>& primals,
                         const std::vector<array>& cotangents, const std::vector<int>& argnums,
                         const std::vector<array>&) override {
    const array experts = primals[2];
    Stream s = stream();
    auto grads = mlx::core::vjp(
        [experts, s](const std::vector<array>& in) {
          return std::vector<array>{reference(in[0], in[1], experts, s)};
        },
        {primals[0], primals[1]}, cotangents).second;
    std::vector<array> out;
    for (int arg : argnums) {
      if (arg == 2) throw std::invalid_argument("[gathered_half_linear] no derivative "
                                                "with respect to the expert indices");
      out.push_back(grads[arg]);
    }
    return out;
  }

  // The product is linear in x and in the bank (MLX's GatherMM has no forward-mode rule
  // to borrow): the tangent of x through this kernel, plus the bank's tangent gathered.
  std::vector<array> jvp(const std::vector<array>& primals, const std::vector<array>& tangents,
                         const std::vector<int>& argnums) override {
    std::optional<array> out;
    for (size_t i = 0; i < argnums.size(); i++) {
      if (argnums[i] == 2) throw std::invalid_argument("[gathered_half_linear] no derivative "
                                                       "with respect to the expert indices");
      array term = argnums[i] == 0
          ? gathered_half_linear(tangents[i], primals[1], primals[2], stream())
          : reference(primals[0], tangents[i], primals[2], stream());
      out = out ? add(*out, term, stream()) : term;
    }
    return {*out};
  }

  const char* name() const override { return "MlxvlmGatheredHalfLinear"; }
  bool is_equivalent(const Primitive&) const override { return true; }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(1);
    return {shape};
  }
};

}  // namespace

array gathered_half_linear(const array& x, const array& bank, const array& experts,
                           StreamOrDevice s) {
  if (bank.ndim() != 3 || (bank.dtype() != bfloat16 && bank.dtype() != float16))
    throw std::invalid_argument(
        "[gathered_half_linear] bank must be a 3-D bfloat16/float16 array (experts, N, K)");
  if (x.ndim() < 1 || x.shape(-1) != bank.shape(2))
    throw std::invalid_argument("[gathered_half_linear] x's last axis must match the bank's");
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  if (experts.shape() != rows)
    throw std::invalid_argument(
        "[gathered_half_linear] experts must name one expert per row of x (x's shape "
        "without its last axis)");
  if (!issubdtype(experts.dtype(), integer))
    throw std::invalid_argument("[gathered_half_linear] experts must be integers");
  Stream stream = to_stream(s);
  Shape shape = x.shape();
  shape.back() = bank.shape(1);
  return array(shape, float32, std::make_shared<GatheredHalfLinear>(stream),
               {astype(x, float32, stream), contiguous_parameter(bank, stream),
                astype(experts, uint32, stream)});
}

}  // namespace mlxvlm
