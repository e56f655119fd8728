// Python bindings (nanobind, in MLX's nanobind domain so mlx.core.array passes through).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "blas.h"
#include "cpu_parallel.h"
#include "compact_matmul.h"
#include "kernels.h"
#include "vector_math.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_mlxvlm_cpu_kernels, m) {
  m.doc() = "mlxvlm's CPU kernels for MLX: attention and 16-bit-weight linear layers";
  m.def("set_sgemm",
        [](uintptr_t address) {
          mlxvlm::sgemm_pointer() = reinterpret_cast<mlxvlm::sgemm_fn>(address);
        },
        "address"_a, "Use the cblas_sgemm at this address for the float32 products.");
  m.def("set_threads", [](int threads) { mlxvlm::configured_threads() = threads; }, "threads"_a,
        "The size of the kernels' own pool (used without the BLAS shim), before first use.");
  m.def("set_isa_cap", [](std::string cap) { mlxvlm::isa_cap_setting() = std::move(cap); },
        "cap"_a, "Cap the instruction set (avx512, avx2, portable; empty: none), before first use.");
  m.def("set_half_gemm", [](std::string value) { mlxvlm::half_gemm_setting() = std::move(value); },
        "value"_a, "How prefill's products run (own, blas; empty: measured), before first use.");
  m.def("threads", [] { return mlxvlm::thread_pool().size(); });
  m.def("shares_blas_pool", [] { return mlxvlm::thread_pool().shared(); },
        "Whether the kernels run on the BLAS shim's threads (mlxvlm/cpu/blas_shim.c).");
  m.def("simd", [] { return mlxvlm::isa_name(); });
  m.def("prefill_products", [] { return mlxvlm::prefill_choice().why; },
        "How prefill's 16-bit and quantized products run here, and why (decided at first use).");
  nb::enum_<mlxvlm::Activation>(m, "Activation")
      .value("gelu_tanh", mlxvlm::Activation::gelu_tanh)
      .value("quick_gelu", mlxvlm::Activation::quick_gelu)
      .value("silu", mlxvlm::Activation::silu)
      .value("exp", mlxvlm::Activation::exp);
  m.def("activation", &mlxvlm::activation, "x"_a, "kind"_a, "up"_a = nb::none(),
        nb::kw_only(), "stream"_a = nb::none());
  m.def("half_linear", &mlxvlm::half_linear, "x"_a, "weight"_a, "bias"_a = nb::none(),
        "residual"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none());
  m.def("gathered_half_linear", &mlxvlm::gathered_half_linear, "x"_a, "bank"_a, "experts"_a,
        nb::kw_only(), "stream"_a = nb::none());
  m.def("quantized_linear", &mlxvlm::quantized_linear, "x"_a, "packed"_a, "scales"_a,
        "biases"_a, nb::kw_only(), "group_size"_a, "bits"_a, "bias"_a = nb::none(),
        "stream"_a = nb::none());
  m.def("norm", &mlxvlm::norm, "x"_a, "weight"_a, "bias"_a, nb::kw_only(), "eps"_a,
        "rms"_a, "weight_offset"_a = 0.0f, "stream"_a = nb::none());
  m.def("attention", &mlxvlm::attention, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a,
        "causal"_a = false, "mask"_a = nb::none(), "stream"_a = nb::none());
  m.def("rope", &mlxvlm::rope, "x"_a, "dims"_a, nb::kw_only(), "traditional"_a, "base"_a,
        "scale"_a, "offset"_a, "freqs"_a = nb::none(), "stream"_a = nb::none());
  m.def("rotary", &mlxvlm::rotary, "x"_a, "cos"_a, "sin"_a, nb::kw_only(),
        "stream"_a = nb::none());
}
