// The operations this library adds to MLX (CPU only; see mlxvlm/cpu/kernels/__init__.py).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlxvlm {

enum class Activation { gelu_tanh, quick_gelu, silu, exp };

// act(x), or act(x) * up, element-wise in float32 (see activation.cpp).
mlx::core::array activation(const mlx::core::array& x, Activation kind,
                            const std::optional<mlx::core::array>& up,
                            mlx::core::StreamOrDevice s = {});

// x (..., K) float32 . weight (N, K) bfloat16/float16 transposed (+ bias (N))
// (+ residual (..., N), summed in the product's own output pass) -> (..., N) float32.
mlx::core::array half_linear(const mlx::core::array& x, const mlx::core::array& weight,
                             const std::optional<mlx::core::array>& bias = std::nullopt,
                             const std::optional<mlx::core::array>& residual = std::nullopt,
                             mlx::core::StreamOrDevice s = {});

// x (..., K) float32 . bank[experts]^T -> (..., N) float32: one expert (an integer in
// experts, shaped as x without its last axis) per row of x, the bank bfloat16/float16
// (experts, N, K); mlx-lm's SwitchLinear without a float32 copy (gathered_half_linear.cpp).
mlx::core::array gathered_half_linear(const mlx::core::array& x, const mlx::core::array& bank,
                                      const mlx::core::array& experts,
                                      mlx::core::StreamOrDevice s = {});

// x (..., K) . dequantize(packed, scales, biases)^T (+ bias) -> (..., N) float32, for
// MLX's affine 4/8-bit weights (see quantized_linear.cpp).
mlx::core::array quantized_linear(const mlx::core::array& x, const mlx::core::array& packed,
                                  const mlx::core::array& scales,
                                  const mlx::core::array& biases, int group_size, int bits,
                                  const std::optional<mlx::core::array>& bias = std::nullopt,
                                  mlx::core::StreamOrDevice s = {});

// LayerNorm (rms = false) or RMSNorm over the last axis, in float32, scaled by
// weight + weight_offset (see norm.cpp).
mlx::core::array norm(const mlx::core::array& x, const std::optional<mlx::core::array>& weight,
                      const std::optional<mlx::core::array>& bias, float eps, bool rms,
                      float weight_offset = 0.0f, mlx::core::StreamOrDevice s = {});

// softmax(scale * q k^T + mask) v: q (B, H, L, D), k and v (B, H_kv, S, D), mask additive
// or boolean (true: attend; false adds the lowest float) and broadcastable to
// (B, H, L, S); causal: query i sees keys up to i + S - L.
mlx::core::array attention(const mlx::core::array& q, const mlx::core::array& k,
                           const mlx::core::array& v, float scale, bool causal,
                           const std::optional<mlx::core::array>& mask,
                           mlx::core::StreamOrDevice s = {});

// Rotary position embedding of x (..., T, D) float32 at positions offset + t (offset: a
// scalar or one per entry of x's first axis), as mx.fast.rope computes it (see rope.cpp).
mlx::core::array rope(const mlx::core::array& x, int dims, bool traditional,
                      std::optional<float> base, float scale, const mlx::core::array& offset,
                      const std::optional<mlx::core::array>& freqs,
                      mlx::core::StreamOrDevice s = {});

// x * cos + rotate_half(x) * sin for float32 x (..., D) and cos/sin tables that broadcast
// to it (transformers' apply_rotary_pos_emb; see rope.cpp).
mlx::core::array rotary(const mlx::core::array& x, const mlx::core::array& cos,
                        const mlx::core::array& sin, mlx::core::StreamOrDevice s = {});

}  // namespace mlxvlm
