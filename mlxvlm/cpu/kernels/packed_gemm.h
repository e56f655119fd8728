// A blocked float32 GEMM for CPUs with AVX-512, like BLIS's, over weights stored in any
// compact form: y (rows x N) = x (rows x K) . W^T, W's rows converted to float32 as they
// are packed (compact_matmul.h runs it for the 16-bit and the 4/8-bit linear kernels).
//   for each 768 of the thread's output columns (their packed weights kept in L2):
//     for each slice of K (160 deep):  pack W's rows, kc x 32 panels
//       for each block of x's rows:    pack up to 144 rows, kc x 12 panels
//         for each 32-wide panel:      kept in L1 across the row panels
//           for each 12-row panel:     12 x 32 register tile (24 accumulators), then
//                                      added to y (after the first slice, or when y
//                                      holds a bias or a residual) or stored
// The threads split the output columns; each packs its own weights and x. On a Zen 5
// EPYC: 200-225 GFLOP/s per core, where OpenBLAS's AVX2 kernels ran 117-131 with the
// weights converted beforehand.
#pragma once

#include "cpu_parallel.h"
#include "scratch.h"
#include "vector_math.h"

#ifdef MLXVLM_X86

#include <algorithm>
#include <cstdint>

namespace mlxvlm {

namespace packed_gemm_detail {

constexpr int64_t kRowTile = 12;     // rows of x per register tile
constexpr int64_t kColumnTile = 32;  // output columns per register tile (two vectors)
// A weight panel (kDepth x 32 floats, 20 KB) and a row panel (7.5 KB) fit a 32 KB L1.
constexpr int64_t kDepth = 160;
constexpr int64_t kRowBlock = 144;  // rows of x packed at a time (92 KB, in L2)
// Output columns whose weights are packed at a time (480 KB, in L2 beside the rows): a
// wider block (a 5120- or 8960-wide layer's half, 1.6-2.9 MB) ran 25% slower from L3.
constexpr int64_t kColumnBlock = 768;

// Transposes a 16 x 16 block in registers: r[i][j] becomes r[j][i].
MLXVLM_AVX512 inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // r[4q + c] now holds, in each 128-bit lane l, element c of rows 4l' .. of block q.
  for (int q = 0; q < 2; q++)
    for (int c = 0; c < 4; c++) {
      t[8 * q + c] = _mm512_shuffle_f32x4(r[8 * q + c], r[8 * q + 4 + c], 0x88);
      t[8 * q + 4 + c] = _mm512_shuffle_f32x4(r[8 * q + c], r[8 * q + 4 + c], 0xdd);
    }
  for (int c = 0; c < 8; c++) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
  }
}

// Weight rows [n0, n1) x columns [k0, k0 + kc) as float32 panels of 32 rows:
// panel[k][j] = W[n0 + 32 p + j][k0 + k], rows past n1 zero. `weights.row(n, k0, kc, out)`
// writes W[n][k0 : k0 + kc) as float32 (k0 a multiple of 16). Sixteen rows at a time are
// converted into `rows` (in L1) and moved into the panel by 16 x 16 register transposes.
template <class Weights>
MLXVLM_AVX512 void pack_weights(const Weights& weights, int64_t n0, int64_t n1, int64_t k0,
                                int64_t kc, float* packed) {
  alignas(64) float rows[16][kDepth];
  for (int64_t p = n0; p < n1; p += kColumnTile) {
    float* panel = packed + (p - n0) * kc;
    for (int64_t half = 0; half < kColumnTile; half += 16) {
      const int64_t first = p + half, count = std::max<int64_t>(0, std::min<int64_t>(16, n1 - first));
      for (int64_t j = 0; j < count; j++) weights.row(first + j, k0, kc, rows[j]);
      for (int64_t j = count; j < 16; j++) std::fill(rows[j], rows[j] + kc, 0.0f);
      int64_t k = 0;
      for (; k + 16 <= kc; k += 16) {
        __m512 block[16];
        for (int j = 0; j < 16; j++) block[j] = _mm512_load_ps(rows[j] + k);
        transpose16(block);
        for (int t = 0; t < 16; t++)
          _mm512_store_ps(panel + (k + t) * kColumnTile + half, block[t]);
      }
      for (; k < kc; k++)
        for (int j = 0; j < 16; j++) panel[k * kColumnTile + half + j] = rows[j][k];
    }
  }
}

// Rows [m0, m0 + mc) of x x columns [k0, k0 + kc) as panels of 12 rows:
// panel[k][i] = x[m0 + 12 q + i][k0 + k], rows past mc zero; 16 columns at a time by a
// register transpose (the 12 rows and 4 of zeros), the rest one by one.
MLXVLM_AVX512 inline void pack_rows(const float* x, int64_t K, int64_t m0, int64_t mc,
                                    int64_t k0, int64_t kc, float* packed) {
  const __mmask16 row_lanes = (1u << kRowTile) - 1;
  for (int64_t q = 0; q < mc; q += kRowTile) {
    float* panel = packed + q * kc;
    const int64_t count = std::min(kRowTile, mc - q);
    const float* source = x + (m0 + q) * K + k0;
    int64_t k = 0;
    for (; k + 16 <= kc; k += 16) {
      __m512 block[16];
      for (int i = 0; i < 16; i++)
        block[i] = i < count ? _mm512_loadu_ps(source + i * K + k) : _mm512_setzero_ps();
      transpose16(block);
      for (int t = 0; t < 16; t++)
        _mm512_mask_storeu_ps(panel + (k + t) * kRowTile, row_lanes, block[t]);
    }
    for (; k < kc; k++)
      for (int64_t i = 0; i < kRowTile; i++)
        panel[k * kRowTile + i] = i < count ? source[i * K + k] : 0.0f;
  }
}

// y's rows x columns (at most 12 x 32) = (or +=) rows . columns over kc.
MLXVLM_AVX512 inline void tile(int64_t kc, const float* rows_panel, const float* columns_panel,
                        float* y, int64_t y_row, int64_t rows, int64_t columns, bool add) {
  __m512 acc[kRowTile][2];
  for (int i = 0; i < kRowTile; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; k++) {
    const __m512 w0 = _mm512_load_ps(columns_panel + k * kColumnTile);
    const __m512 w1 = _mm512_load_ps(columns_panel + k * kColumnTile + 16);
    for (int i = 0; i < kRowTile; i++) {
      const __m512 a = _mm512_set1_ps(rows_panel[k * kRowTile + i]);
      acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
    }
  }
  const __mmask16 first = columns >= 16 ? 0xFFFF : __mmask16((1u << columns) - 1);
  const __mmask16 second = columns >= 32 ? 0xFFFF
      : columns <= 16 ? 0 : __mmask16((1u << (columns - 16)) - 1);
  for (int64_t i = 0; i < rows; i++) {
    float* out = y + i * y_row;
    if (add) {
      acc[i][0] = _mm512_add_ps(acc[i][0], _mm512_maskz_loadu_ps(first, out));
      acc[i][1] = _mm512_add_ps(acc[i][1], _mm512_maskz_loadu_ps(second, out + 16));
    }
    _mm512_mask_storeu_ps(out, first, acc[i][0]);
    _mm512_mask_storeu_ps(out + 16, second, acc[i][1]);
  }
}

inline float* aligned(Scratch& scratch) {
  auto address = reinterpret_cast<uintptr_t>(scratch.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t(63));
}

}  // namespace packed_gemm_detail

// y (rows x N) = x (rows x K) . W^T, or y += with `accumulate` (a bias or a residual put
// in y first), for W (N x K) known through `weights.row` (see pack_weights).
template <class Weights>
void packed_gemm(const float* x, int64_t rows, int64_t K, const Weights& weights, int64_t N,
                 float* y, bool accumulate) {
  using namespace packed_gemm_detail;
  const int64_t panels = (N + kColumnTile - 1) / kColumnTile;
  Pool pool = thread_pool();
  const int64_t workers = std::min<int64_t>(pool.size(), panels);
  const int64_t panels_per_worker = (panels + workers - 1) / workers;
  // Per worker (multiples of 16 floats: each slice stays 64-byte aligned).
  const int64_t weights_floats =
      kDepth * std::min(kColumnBlock, panels_per_worker * kColumnTile);
  const int64_t rows_floats =
      kDepth * std::min(kRowBlock, (rows + kRowTile - 1) / kRowTile * kRowTile);
  Scratch weights_scratch(static_cast<size_t>(workers * weights_floats + 16));
  Scratch rows_scratch(static_cast<size_t>(workers * rows_floats + 16));
  float* const weights_base = aligned(weights_scratch);
  float* const rows_base = aligned(rows_scratch);
  auto work = [&](int64_t worker) {
    float* packed_weights = weights_base + worker * weights_floats;
    float* packed_rows = rows_base + worker * rows_floats;
    const int64_t first = worker * panels_per_worker * kColumnTile;
    const int64_t last = std::min(N, first + panels_per_worker * kColumnTile);
    // This worker's columns a block at a time, so that their packed weights stay in L2.
    for (int64_t n0 = first; n0 < last; n0 += kColumnBlock) {
      const int64_t n1 = std::min(last, n0 + kColumnBlock);
      for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
        const int64_t kc = std::min(kDepth, K - k0);
        const bool add = accumulate || k0 > 0;
        pack_weights(weights, n0, n1, k0, kc, packed_weights);
        for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
          const int64_t mc = std::min(kRowBlock, rows - m0);
          pack_rows(x, K, m0, mc, k0, kc, packed_rows);
          for (int64_t n = n0; n < n1; n += kColumnTile)
            for (int64_t m = m0; m < m0 + mc; m += kRowTile)
              tile(kc, packed_rows + (m - m0) * kc, packed_weights + (n - n0) * kc,
                   y + m * N + n, N, std::min(kRowTile, m0 + mc - m),
                   std::min(kColumnTile, n1 - n), add);
        }
      }
    }
  };
  if (workers <= 1) return work(0);
  pool.run([&](int worker, int) {
    if (worker < workers) work(worker);
  });
}

}  // namespace mlxvlm

#endif  // MLXVLM_X86
