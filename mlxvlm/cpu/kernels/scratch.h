// Float32 scratch memory from MLX's allocator.
//
// The kernels' temporary buffers (a block of attention scores, a chunk of converted
// weights) come from MLX's allocator rather than the C heap: they are reused from its
// buffer cache, counted in its memory (mx.get_active_memory / get_peak_memory, the memory
// limit) like the arrays around them, and released with its cache. From the C heap the
// same buffers stayed resident after being freed (glibc keeps them in its arena).
#pragma once

#include <algorithm>
#include <cstddef>

#include "mlx/allocator.h"

namespace mlxvlm {

class Scratch {
 public:
  explicit Scratch(size_t floats)
      : data_(mlx::core::allocator::malloc(std::max<size_t>(floats, 1) * sizeof(float))) {}

  float* data() { return static_cast<float*>(data_.buffer().raw_ptr()); }

 private:
  mlx::core::allocator::Data data_;
};

}  // namespace mlxvlm
