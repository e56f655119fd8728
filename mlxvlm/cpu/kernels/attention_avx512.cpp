// Attention on CPUs with AVX-512: register-tiled products fused with an online softmax.
//
// The sgemm path (attention.cpp) hands two thin products per block of queries to
// OpenBLAS (inner dimension 64, or 64 output columns), which runs them at about half the
// machine's peak, and passes over the scores between them. Here each worker takes a tile
// of 48 queries of one head and walks the keys in blocks of 1024, FlashAttention-style:
//   scores = scale * q_tile . k_block^T    6 x 64 register tiles, k packed 16 keys wide
//   + mask, running row max, exp, sums     the tile's scores (192 KB) stay in L2
//   out_tile = out_tile * alpha + p . v    6 x 64 register tiles over the value rows
// and divides by the row sums as the last value pass stores the rows. Both products walk
// their keys 64 at a time across all the tile's rows, so that those keys' packed panels
// or value rows (16 KB at 64 dims) are read from L1 by every row tile, not from L2 by
// each. Keys are packed per kv head (gathered 16 keys at a time); values read from a
// (batch, keys, heads, dims) view are copied to consecutive rows first. One SigLIP
// layer's attention (12 heads x 1024 patches x 64 dims) on a 2-core Xeon: 63 ms on the
// sgemm path, 23-32 ms here; call by call, 256-key blocks walked row tile by row tile
// took 1.15x as long and PyTorch's fused kernel takes 1.08x (80-dim heads: 1.12x, 0.93x).
//
// Semantics are the sgemm path's: causal rows see a prefix of the keys (later ones are
// neither computed nor weighted), a row that sees no key (or whose every score is -inf)
// gives NaN as MLX does, and exp flushes to 0 below -87.3 like MLX's.
#include "attention.h"
#include "cpu_parallel.h"
#include "scratch.h"
#include "vector_math.h"

#ifdef MLXVLM_X86

#include <algorithm>
#include <cmath>

namespace mlxvlm::attention_cpu {

namespace {

constexpr int kTileRows = 6;       // query rows per register tile
constexpr int kKeyPanels = 4;      // 16-key panels per score register tile (64 keys)
constexpr int kValueVectors = 4;   // 16-float vectors per output register tile (64 dims)
constexpr int64_t kQueryTile = 48; // queries per work unit
constexpr int64_t kKeyBlock = 1024; // keys per online-softmax step (a SigLIP tile's all)
constexpr int64_t kValueKeys = 64;  // value rows per pass over the tile's rows

MLXVLM_AVX512 inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// e^x for x <= 0 (scores minus their row maximum): Cephes' expf as vector_math.h's exp8,
// 2^n applied with scalef, 0 below -87.34 and NaN kept.
MLXVLM_AVX512 inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpMin);
  const __mmask16 in_range = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);  // NaN included
  __m512 t = _mm512_max_ps(lo, x);  // -inf -> lo (NaN stays: max returns its 2nd operand)
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), t);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(in_range, p, n);
}

// One (batch, kv head)'s keys as panels of 16: panel[d * 16 + j] = k[j0 + j][d], zero
// padded past the last key, so that a score tile loads 16 keys' d-th values at once.
MLXVLM_AVX512 void pack_keys(const float* k, int64_t k_row, int64_t keys, int64_t dims,
                             int64_t panel_begin, int64_t panel_end, float* packed) {
  const bool gather = k_row <= (int64_t(1) << 26);  // 15 rows' offsets fit in int32
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(int(gather ? k_row : 0)));
  for (int64_t panel = panel_begin; panel < panel_end; panel++) {
    float* out = packed + panel * dims * 16;
    const int64_t j0 = panel * 16, n = std::min<int64_t>(16, keys - j0);
    if (gather) {  // 16 keys' d-th values in one gather, zero past the last key
      const __mmask16 present = first_lanes(n);
      const float* rows = k + j0 * k_row;
      for (int64_t d = 0; d < dims; d++)
        _mm512_storeu_ps(out + d * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), present,
                                                                offsets, rows + d, 4));
      continue;
    }
    for (int64_t j = 0; j < 16; j++) {
      const float* row = k + (j0 + j) * k_row;
      for (int64_t d = 0; d < dims; d++) out[d * 16 + j] = j < n ? row[d] : 0.0f;
    }
  }
}

// One (batch, kv head)'s value rows [j0, j1) copied to `packed` (row stride dims): the
// value pass then streams consecutive rows. Read in place from a (batch, keys, heads,
// dims) view, each row sits heads x dims floats after the last, across a page boundary
// every row or two, where the prefetchers stop (Qwen2-VL's tower: 16 heads x 80 dims).
MLXVLM_AVX512 void pack_values(const float* v, int64_t v_row, int64_t dims, int64_t j0,
                               int64_t j1, float* packed) {
  for (int64_t j = j0; j < j1; j++)
    std::copy(v + j * v_row, v + j * v_row + dims, packed + j * dims);
}

// s[r][c * 16 + j] = scale * sum_d q[r][d] * panel_c[d][j], for R rows and C panels.
template <int R, int C>
MLXVLM_AVX512 inline void score_tile(const float* q, int64_t q_row, const float* panels,
                                     int64_t dims, float scale, float* s, int64_t s_row) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
  const int64_t panel = dims * 16;
  for (int64_t d = 0; d < dims; d++) {
    __m512 keys[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) keys[c] = _mm512_loadu_ps(panels + c * panel + d * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m512 query = _mm512_set1_ps(q[r * q_row + d]);
#pragma GCC unroll 8
      for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(query, keys[c], acc[r][c]);
    }
  }
  const __m512 k = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) _mm512_storeu_ps(s + r * s_row + c * 16, _mm512_mul_ps(acc[r][c], k));
}

// How a value pass treats the output rows: the first pass over a tile's keys starts from
// zero instead of reading them, and the last multiplies each row by its 1 / sum before
// storing it (row_scale[r] for row r; null: stored as they are).
struct Pass {
  bool first = false;
  const float* row_scale = nullptr;
  Pass rows_from(int64_t r) const { return {first, row_scale ? row_scale + r : nullptr}; }
};

// o[r][0 : 16 N] (+)= sum_j p[r][j] * v[j][0 : 16 N], the last vector masked to `last`.
template <int R, int N>
MLXVLM_AVX512 inline void value_tile(const float* p, int64_t p_row, const float* v,
                                     int64_t v_row, int64_t keys, float* o, int64_t o_row,
                                     __mmask16 last, const Pass& pass) {
  __m512 acc[R][N];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int n = 0; n < N; n++)
      acc[r][n] = pass.first ? _mm512_setzero_ps()
                             : _mm512_maskz_loadu_ps(n == N - 1 ? last : __mmask16(0xffff), o + r * o_row + n * 16);
  for (int64_t j = 0; j < keys; j++) {
    __m512 values[N];
#pragma GCC unroll 8
    for (int n = 0; n < N; n++)
      values[n] = _mm512_maskz_loadu_ps(n == N - 1 ? last : __mmask16(0xffff), v + j * v_row + n * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m512 weight = _mm512_set1_ps(p[r * p_row + j]);
#pragma GCC unroll 8
      for (int n = 0; n < N; n++) acc[r][n] = _mm512_fmadd_ps(weight, values[n], acc[r][n]);
    }
  }
  if (pass.row_scale) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m512 k = _mm512_set1_ps(pass.row_scale[r]);
#pragma GCC unroll 8
      for (int n = 0; n < N; n++) acc[r][n] = _mm512_mul_ps(acc[r][n], k);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int n = 0; n < N; n++)
      _mm512_mask_storeu_ps(o + r * o_row + n * 16, n == N - 1 ? last : __mmask16(0xffff), acc[r][n]);
}

// Scores of R query rows against `panels` 16-key panels.
template <int R>
MLXVLM_AVX512 void score_rows(const float* q, int64_t q_row, const float* packed,
                              int64_t dims, int64_t panels, float scale, float* s,
                              int64_t s_row) {
  int64_t c = 0;
  for (; c + kKeyPanels <= panels; c += kKeyPanels)
    score_tile<R, kKeyPanels>(q, q_row, packed + c * dims * 16, dims, scale, s + c * 16, s_row);
  const float* rest = packed + c * dims * 16;
  switch (panels - c) {
    case 3: score_tile<R, 3>(q, q_row, rest, dims, scale, s + c * 16, s_row); break;
    case 2: score_tile<R, 2>(q, q_row, rest, dims, scale, s + c * 16, s_row); break;
    case 1: score_tile<R, 1>(q, q_row, rest, dims, scale, s + c * 16, s_row); break;
    default: break;
  }
}

// Output rows += weights . values, for R rows, all `dims` columns 64 at a time.
template <int R>
MLXVLM_AVX512 void value_rows(const float* p, int64_t p_row, const float* v, int64_t v_row,
                              int64_t keys, float* o, int64_t o_row, int64_t dims,
                              const Pass& pass) {
  for (int64_t d0 = 0; d0 < dims; d0 += 16 * kValueVectors) {
    const int64_t width = std::min<int64_t>(16 * kValueVectors, dims - d0);
    const int vectors = int((width + 15) / 16);
    const __mmask16 last = first_lanes(width - (vectors - 1) * 16);
    switch (vectors) {
      case 4: value_tile<R, 4>(p, p_row, v + d0, v_row, keys, o + d0, o_row, last, pass); break;
      case 3: value_tile<R, 3>(p, p_row, v + d0, v_row, keys, o + d0, o_row, last, pass); break;
      case 2: value_tile<R, 2>(p, p_row, v + d0, v_row, keys, o + d0, o_row, last, pass); break;
      default: value_tile<R, 1>(p, p_row, v + d0, v_row, keys, o + d0, o_row, last, pass); break;
    }
  }
}

// op.template rows<R>(r) over a tile's rows, kTileRows at a time, then the rest.
template <class Op>
MLXVLM_AVX512 inline void for_row_tiles(int64_t rows, const Op& op) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) op.template rows<kTileRows>(r);
  switch (rows - r) {
    case 5: op.template rows<5>(r); break;
    case 4: op.template rows<4>(r); break;
    case 3: op.template rows<3>(r); break;
    case 2: op.template rows<2>(r); break;
    case 1: op.template rows<1>(r); break;
    default: break;
  }
}

// Scores of a tile's query rows against `panels` packed 16-key panels, into `s`.
struct TileScores {
  const float* q;
  int64_t q_row;
  const float* packed;
  int64_t dims, panels;
  float scale;
  float* s;
  template <int R>
  MLXVLM_AVX512 void rows(int64_t r) const {
    score_rows<R>(q + r * q_row, q_row, packed, dims, panels, scale, s + r * kKeyBlock, kKeyBlock);
  }
};

// Output rows += the tile's weights (in `s`) . `keys` value rows.
struct TileValues {
  const float* s;
  const float* v;
  int64_t v_row, keys;
  float* o;
  int64_t o_row, dims;
  Pass pass;
  template <int R>
  MLXVLM_AVX512 void rows(int64_t r) const {
    value_rows<R>(s + r * kKeyBlock, kKeyBlock, v, v_row, keys, o + r * o_row, o_row, dims,
                  pass.rows_from(r));
  }
};

// Running softmax state of one query row.
struct RowState {
  float max = -INFINITY, sum = 0.0f;
};

// Turns a row's scores for one key block (the first `visible` of `n` seen) into weights
// e^(score - running max), zero past `visible`, and updates the running max and sum.
// Returns the factor the row's output so far must be multiplied by.
MLXVLM_AVX512 float softmax_step(float* row, int64_t n, int64_t visible, RowState& state) {
  visible = std::clamp<int64_t>(visible, 0, n);
  std::fill(row + visible, row + n, 0.0f);
  __m512 block_max = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) block_max = _mm512_max_ps(block_max, _mm512_loadu_ps(row + j));
  if (j < visible) {
    const __mmask16 tail = first_lanes(visible - j);
    block_max = _mm512_mask_max_ps(block_max, tail, block_max, _mm512_maskz_loadu_ps(tail, row + j));
  }
  const float new_max = std::fmax(state.max, _mm512_reduce_max_ps(block_max));
  if (new_max == -INFINITY) {  // nothing seen yet: no weights, nothing to rescale
    std::fill(row, row + visible, 0.0f);
    return 1.0f;
  }
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= visible; j += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
    _mm512_storeu_ps(row + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < visible) {
    const __mmask16 tail = first_lanes(visible - j);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + j), shift));
    _mm512_mask_storeu_ps(row + j, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  const float alpha = state.max == -INFINITY ? 0.0f : std::exp(state.max - new_max);
  state.sum = state.sum * alpha + _mm512_reduce_add_ps(sum);
  state.max = new_max;
  return alpha;
}

MLXVLM_AVX512 void scale_row(float* row, int64_t n, float factor) {
  const __m512 k = _mm512_set1_ps(factor);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), k));
  if (j < n) {
    const __mmask16 tail = first_lanes(n - j);
    _mm512_mask_storeu_ps(row + j, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + j), k));
  }
}

// Queries [i0, i0 + rows) of head h against its kv head's packed keys and values.
MLXVLM_AVX512 void query_tile(const Problem& p, int64_t b, int64_t h, int64_t i0, int64_t rows,
                              const float* packed, const float* v, int64_t v_row,
                              float* scores) {
  const int64_t out_row = p.heads * p.dims;
  const float* q = p.q.at(b, h, i0);
  float* out = p.out + (b * p.queries + i0) * out_row + h * p.dims;
  RowState state[kQueryTile];
  float inverse_sums[kQueryTile];
  const int64_t keys = visible_keys(p, i0 + rows - 1);  // the tile's last row sees most
  if (keys == 0) {  // no key at all: 0 * (1 / 0), NaN, as MLX's softmax gives
    for (int64_t r = 0; r < rows; r++) std::fill(out + r * out_row, out + r * out_row + p.dims, NAN);
    return;
  }
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, keys - k0);
    const int64_t panels = (n + 15) / 16;
    // Each group of kKeyPanels panels (64 keys, 16 KB at 64 dims) stays in L1 while
    // every row tile reads it.
    for (int64_t c = 0; c < panels; c += kKeyPanels)
      for_row_tiles(rows, TileScores{q, p.q.row, packed + (k0 + c * 16) * p.dims, p.dims,
                                     std::min<int64_t>(kKeyPanels, panels - c), p.scale,
                                     scores + c * 16});
    const bool last_block = k0 + n >= keys;
    for (int64_t r = 0; r < rows; r++) {
      float* row = scores + r * kKeyBlock;
      if (p.mask.data) p.mask.add_to(row, b, h, i0 + r, k0, n);
      const float alpha = softmax_step(row, n, visible_keys(p, i0 + r) - k0, state[r]);
      if (k0 > 0 && alpha != 1.0f) scale_row(out + r * out_row, p.dims, alpha);
      // A row that saw no key has sum 0: 0 * (1 / 0) gives NaN, as MLX's softmax does.
      if (last_block) inverse_sums[r] = 1.0f / state[r].sum;
    }
    // The same for the values: kValueKeys rows (16 KB at 64 dims) at a time.
    for (int64_t j0 = 0; j0 < n; j0 += kValueKeys) {
      const Pass pass{k0 == 0 && j0 == 0, last_block && j0 + kValueKeys >= n ? inverse_sums : nullptr};
      for_row_tiles(rows, TileValues{scores + j0, v + (k0 + j0) * v_row, v_row,
                                     std::min(kValueKeys, n - j0), out, out_row, p.dims, pass});
    }
  }
}

}  // namespace

void attention_avx512(const Problem& p) {
  const int64_t repeats = p.heads / p.kv_heads;
  const int64_t panels = (p.keys + 15) / 16;
  const int64_t tiles = (p.queries + kQueryTile - 1) / kQueryTile;
  const int workers = thread_pool().size();
  // Values already in consecutive rows (a (batch, heads, keys, dims) layout) are read in
  // place; a single query row reads each value once, so copying would not pay either.
  const bool copy_values = p.v.row != p.dims && p.queries > 1;
  Scratch scores(static_cast<size_t>(workers * kQueryTile * kKeyBlock));
  if (tiles == 1 && p.batch * p.kv_heads > 1) {
    // Decoding (a query or a few per sequence): each (sequence, kv head) is one task --
    // its keys packed by the worker that takes it, then its heads' query tiles -- so a
    // batched step's attention is one job for the threads, not one per sequence and kv
    // head (each far shorter than waking the threads for it).
    const int64_t key_floats = panels * 16 * p.dims, value_floats = p.keys * p.dims;
    Scratch packed(static_cast<size_t>(workers * key_floats));
    Scratch packed_values(copy_values ? static_cast<size_t>(workers * value_floats) : 0);
    parallel_tasks(p.batch * p.kv_heads, [&](int64_t task, int worker) {
      const int64_t b = task / p.kv_heads, kv = task % p.kv_heads;
      float* keys = packed.data() + worker * key_floats;
      float* values = copy_values ? packed_values.data() + worker * value_floats : nullptr;
      pack_keys(p.k.at(b, kv, 0), p.k.row, p.keys, p.dims, 0, panels, keys);
      if (copy_values) pack_values(p.v.at(b, kv, 0), p.v.row, p.dims, 0, p.keys, values);
      for (int64_t h = kv * repeats; h < (kv + 1) * repeats; h++)
        query_tile(p, b, h, 0, p.queries, keys, copy_values ? values : p.v.at(b, kv, 0),
                   copy_values ? p.dims : p.v.row, scores.data() + worker * kQueryTile * kKeyBlock);
    });
    return;
  }
  Scratch packed(static_cast<size_t>(panels * 16 * p.dims));
  Scratch packed_values(copy_values ? static_cast<size_t>(p.keys * p.dims) : 0);
  for (int64_t b = 0; b < p.batch; b++) {
    for (int64_t kv = 0; kv < p.kv_heads; kv++) {
      const float* k = p.k.at(b, kv, 0);
      const float* v = p.v.at(b, kv, 0);
      parallel_for(panels, 16, [&](int64_t begin, int64_t end) {
        pack_keys(k, p.k.row, p.keys, p.dims, begin, end, packed.data());
        if (copy_values)
          pack_values(v, p.v.row, p.dims, begin * 16, std::min(p.keys, end * 16),
                      packed_values.data());
      });
      const float* values = copy_values ? packed_values.data() : v;
      const int64_t value_row = copy_values ? p.dims : p.v.row;
      // The heads sharing this kv head, a tile of queries each.
      parallel_tasks(repeats * tiles, [&](int64_t task, int worker) {
        const int64_t h = kv * repeats + task / tiles, i0 = (task % tiles) * kQueryTile;
        query_tile(p, b, h, i0, std::min(kQueryTile, p.queries - i0), packed.data(), values,
                   value_row, scores.data() + worker * kQueryTile * kKeyBlock);
      });
    }
  }
}

}  // namespace mlxvlm::attention_cpu

#else  // not x86-64: attention.cpp never chooses this path (has_avx512() is false)

namespace mlxvlm::attention_cpu {
void attention_avx512(const Problem& p) { attention_sgemm(p); }
}  // namespace mlxvlm::attention_cpu

#endif
