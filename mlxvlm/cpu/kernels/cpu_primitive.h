// What every kernel's MLX primitive shares: the output allocated and the arrays
// registered with the CPU stream's encoder before the kernel is dispatched, no GPU
// implementation, and the inputs taken as MLX gives them.
#pragma once

#include <string>
#include <vector>

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

namespace mlxvlm {

class CpuPrimitive : public mlx::core::UnaryPrimitive {
 public:
  using UnaryPrimitive::UnaryPrimitive;

  void eval_cpu(const std::vector<mlx::core::array>& inputs, mlx::core::array& out) final {
    int donor = in_place_input();
    if (donor >= 0 && donatable(inputs[donor], out)) {
      out.copy_shared_buffer(inputs[donor]);
    } else {
      out.set_data(mlx::core::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mlx::core::cpu::get_command_encoder(stream());
    for (const auto& input : inputs) encoder.set_input_array(input);
    encoder.set_output_array(out);
    dispatch(inputs, out, encoder);
  }

  void eval_gpu(const std::vector<mlx::core::array>&, mlx::core::array&) final {
    throw std::runtime_error(std::string("[") + name() + "] runs on the CPU only");
  }

 protected:
  // Queue the kernel on the encoder (the output is allocated).
  virtual void dispatch(const std::vector<mlx::core::array>& inputs, mlx::core::array& out,
                        mlx::core::cpu::CommandEncoder& encoder) = 0;

  // The input whose buffer the output may take over when nothing else holds it (as MLX's
  // own element-wise kernels do): a kernel that writes each element only after reading
  // that input's element at the same place returns its index. Saves a fresh allocation
  // (page faults, peak memory) per call, e.g. a tower MLP's 12-21 MB activation.
  virtual int in_place_input() const { return -1; }

 private:
  static bool donatable(const mlx::core::array& in, const mlx::core::array& out) {
    return in.is_donatable() && in.flags().row_contiguous && in.dtype() == out.dtype() &&
           in.nbytes() == out.nbytes();
  }
};

// A kernel whose derivatives are those of `reference`: MLX operations computing the same
// function of the same inputs (MLX's own version of it), so that training through the
// kernel is training through MLX's.
class ReferencedPrimitive : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  std::vector<mlx::core::array> vjp(const std::vector<mlx::core::array>& primals,
                                    const std::vector<mlx::core::array>& cotangents,
                                    const std::vector<int>& argnums,
                                    const std::vector<mlx::core::array>&) override {
    auto grads = mlx::core::vjp([this](const std::vector<mlx::core::array>& in) { return reference(in); }, primals,
                                cotangents).second;
    std::vector<mlx::core::array> out;
    for (int arg : argnums) out.push_back(grads[arg]);
    return out;
  }

  std::vector<mlx::core::array> jvp(const std::vector<mlx::core::array>& primals,
                                    const std::vector<mlx::core::array>& tangents,
                                    const std::vector<int>& argnums) override {
    std::vector<mlx::core::array> all;
    for (const auto& p : primals) all.push_back(mlx::core::zeros_like(p, stream()));
    for (size_t i = 0; i < argnums.size(); i++) all[argnums[i]] = tangents[i];
    return mlx::core::jvp([this](const std::vector<mlx::core::array>& in) { return reference(in); }, primals, all)
        .second;
  }

 protected:
  virtual std::vector<mlx::core::array> reference(
      const std::vector<mlx::core::array>& inputs) = 0;
};

// `a`'s elements in row-major order: its own buffer when it is laid out so (nearly
// always), else a copy in `storage`. Called inside a dispatched kernel, on the evaluated
// input: the kernels take inputs as they come rather than adding a contiguous() node to
// the graph for each (~5 us apiece, hundreds per decoded token).
template <typename T>
const T* row_major(const mlx::core::array& a, std::vector<T>& storage) {
  if (a.flags().row_contiguous) return a.data<T>();
  storage.resize(a.size());
  const T* source = a.data<T>();
  for (size_t i = 0; i < a.size(); i++) storage[i] = source[mlx::core::elem_to_loc(int(i), a)];
  return storage.data();
}

// For parameters (already evaluated, hence with known strides): `a` itself when it is
// row-major, else a contiguous copy in the graph.
inline mlx::core::array contiguous_parameter(const mlx::core::array& a, mlx::core::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mlx::core::contiguous(a, false, s);
}

}  // namespace mlxvlm
