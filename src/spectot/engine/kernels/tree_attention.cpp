// Batch-invariant attention over CSR column lists (tree / ragged attention) for AVX2 + FMA CPUs.
//
// out[h, r] = sum_j p_j v[c_j],  p_j = exp(s_j - max_i s_i) / sum_i exp(s_i - max_i s_i),
// s_j = scale * q[h, r] . k[c_j],  c_j = columns[row_ptr[r] + j],
// for query head h and its kv head h / G (GQA, G = H / H_kv); q, K, V in bf16 or fp32, math in fp32.
//
// Worked layout: rows x, y of one stream and z of a fork (slots as in runner.py) give
// columns = [0 1 2 3 4 7 | 0 1 2 3 4 7 8 | 0 1 2 3 4 5 6 9], row_ptr = [0, 6, 13, 21].
//
// Why: a fused kernel's result for a row depends on the other rows and on how the columns are
// blocked. Here every (row, head) is one fixed sequential computation over its own columns:
//   scores: 8 fp32 lanes over d mod 8 (FMA chain over d blocks), then a fixed horizontal sum;
//   softmax: max over the columns, exp lane-wise in fp32 (exp8), sum of exp in column order in double;
//   output: acc[d] = fma(p_j, v[c_j, d], acc[d]) in column order, vectorised over d only.
// Built with AVX512-BF16 (and D a multiple of 32), bf16 inputs take a wider score path: 16-lane vdpbf16ps
// chains over d (q and k stay bf16, products exact in fp32), 16 keys' chains then summed by one fixed
// transpose-and-add tree (reduce16); softmax as above, values in 16 lanes (the same chain per element).
// A key's score still depends only on q and that key.
// Tiling (several heads or columns per register tile) and threading (which thread owns a row) never
// change that order, so a row's output depends only on q[h, r], scale and the K/V rows at its
// columns, in order: not on the batch, the number of rows, the thread count or the slot numbers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <array>
#include <utility>

#include "vec.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) { return spectot::load_bf16x8(p); }

inline float to_float(float f) { return f; }

inline float to_float(uint16_t h) { return spectot::bf16_to_float(h); }

// The fixed horizontal sum of one accumulator a: s_i = a_i + a_{i+4}, then (s0 + s1) + (s2 + s3);
// paired as _mm_hadd_ps pairs, so that hsum4 reduces four accumulators in exactly this order.
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// hsum of four accumulators at once, [hsum(a), hsum(b), hsum(c), hsum(d)], in the same order.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ac = _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
  const __m256 bd = _mm256_add_ps(_mm256_permute2f128_ps(b, d, 0x20), _mm256_permute2f128_ps(b, d, 0x31));
  const __m256 pairs = _mm256_hadd_ps(ac, bd);  // [a01 a23 b01 b23 | c01 c23 d01 d23]
  return _mm_hadd_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

using spectot::exp8;
#ifdef __AVX512F__
using spectot::exp16;
using spectot::load_bf16x16;
#endif
#ifdef __AMX_BF16__
using spectot::amx_permitted;
using spectot::TileConfig;
#endif

// One inputs view; kv is slot-major (capacity, 2, H_kv, D): keys at [slot, 0], values at [slot, 1].
template <typename T>
struct Problem {
  const T* q;              // (H, N, D)
  const T* kv;             // (capacity, 2, H_kv, D)
  const int64_t* columns;  // (total,)
  const int64_t* row_ptr;  // (N + 1,)
  float* out;              // (H, N, D) fp32, or null when rows_out is set
  uint16_t* rows_out;      // (N, H * D) bf16 (each value rounded to nearest even), or null
  int64_t H, N, H_kv, D;
  float scale;
};

// s[g * ld + j] = scale * dot(q[g], k[j]) for GB query heads and JB key rows (GB*JB accumulators).
// Each dot: one FMA chain over the d blocks, then hsum; the same for every tile shape.
template <int GB, int JB, typename T>
inline __attribute__((always_inline)) void score_tile(const float* q, int64_t D, const T* const* k, float scale,
                                                      float* s, int64_t ld) {
  __m256 acc[GB][JB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < JB; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[GB];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
#pragma GCC unroll 4
    for (int j = 0; j < JB; ++j) {
      const __m256 kv = load8(k[j] + d);
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
    }
  }
  if constexpr (JB == 4) {
    for (int g = 0; g < GB; ++g)
      _mm_storeu_ps(s + g * ld, _mm_mul_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
  } else {
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < JB; ++j) s[g * ld + j] = hsum(acc[g][j]) * scale;
  }
}

// Scores of GB heads against all L key rows: 4 rows per tile, then one at a time.
template <int GB, typename T>
void score_heads(const float* q, int64_t D, const T* const* k, int64_t L, float scale, float* s, int64_t ld) {
  int64_t j = 0;
  for (; j + 4 <= L; j += 4) score_tile<GB, 4>(q, D, k + j, scale, s + j, ld);
  for (; j < L; ++j) score_tile<GB, 1>(q, D, k + j, scale, s + j, ld);
}

// out[g][d] = (sum_j p[g * ld + j] * v[j][d]) / den[g] for GB heads and DB d blocks of 8, the sum
// as one FMA chain per element in column order; covers dims [offset, offset + 8 * DB) of each row.
template <int GB, int DB, typename T>
inline __attribute__((always_inline)) void value_tile(const float* p, int64_t ld, const T* const* v, int64_t offset,
                                                      int64_t L, const float* den, float* out, int64_t out_stride) {
  __m256 acc[GB][DB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < DB; ++b) acc[g][b] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    __m256 pj[GB];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) pj[g] = _mm256_set1_ps(p[g * ld + j]);
#pragma GCC unroll 4
    for (int b = 0; b < DB; ++b) {
      const __m256 vv = load8(v[j] + offset + 8 * b);
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) acc[g][b] = _mm256_fmadd_ps(pj[g], vv, acc[g][b]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m256 dg = _mm256_set1_ps(den[g]);
    for (int b = 0; b < DB; ++b) _mm256_storeu_ps(out + g * out_stride + offset + 8 * b, _mm256_div_ps(acc[g][b], dg));
  }
}

// Weighted values of GB heads over all d: 4 blocks (32 dims) per tile, then one block at a time.
template <int GB, typename T>
void value_heads(const float* p, int64_t ld, const T* const* v, int64_t L, int64_t D, const float* den, float* out,
                 int64_t out_stride) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) value_tile<GB, 4>(p, ld, v, d, L, den, out, out_stride);
  for (; d < D; d += 8) value_tile<GB, 1>(p, ld, v, d, L, den, out, out_stride);
}

// For GB heads (scores s[g * ld + j], j < L, ld a multiple of 8): p_j = exp(s_j - max_i s_i) in
// place, and den[g] = sum_j p_j accumulated in column order in double (the heads' chains interleave).
// exp8 runs on whole blocks of 8, the padding included, so every column takes the same path.
template <int GB>
void softmax_numerators(float* s, int64_t ld, int64_t L, float* den) {
  const int64_t L8 = (L + 7) / 8 * 8;
  for (int g = 0; g < GB; ++g) {
    float* sg = s + g * ld;
    std::fill(sg + L, sg + L8, -INFINITY);
    __m256 m8 = _mm256_loadu_ps(sg);  // max is exact, so lanes may take it in any order
    for (int64_t j = 8; j < L8; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sg + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1))));
    for (int64_t j = 0; j < L8; j += 8) _mm256_storeu_ps(sg + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), m)));
  }
  double sum[GB] = {};
  for (int64_t j = 0; j < L; ++j)
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) sum[g] += s[g * ld + j];
  for (int g = 0; g < GB; ++g) den[g] = static_cast<float>(sum[g]);
}

// Up to 3 query heads of one kv head for one row: scores, softmax, weighted values. GB*4
// accumulators per tile, so each K/V block loaded is used for all GB heads from registers.
template <int GB, typename T>
void attend_heads(const float* q, int64_t D, const T* const* k, const T* const* v, int64_t L, float scale, float* s,
                  int64_t ld, float* out, int64_t out_stride) {
  float den[GB];
  score_heads<GB>(q, D, k, L, scale, s, ld);
  softmax_numerators<GB>(s, ld, L, den);
  value_heads<GB>(s, ld, v, L, D, den, out, out_stride);
}

#ifdef __AVX512BF16__
// 16 accumulators, one per key -> their 16 horizontal sums, key i in lane i, by one fixed tree: 256-bit
// halves, then 128-bit quarters, then pairs inside quarters twice (the same additions for every key).
inline __m512 reduce16(const __m512* a) {
  __m512 w[8], x[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // w[i]: key 2i in quarters 0-1, key 2i+1 in 2-3 (8 partial sums each)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // x[i]: quarter q holds key 4i+q (4 partial sums)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  const __m512 lo = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 hi = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512 r = _mm512_add_ps(_mm512_unpacklo_ps(lo, hi), _mm512_unpackhi_ps(lo, hi));
  // lane 4q + p of r holds key q + {0, 8, 4, 12}[p]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// s[j] = scale * dot(q, k[j]) for all L keys of one head, 16 keys at a time (the last block repeats its
// last key in the unused lanes and stores only the real ones).
inline void score_bf16(const uint16_t* q, int64_t D, const uint16_t* const* k, int64_t L, float scale, float* s) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(k[std::min<int64_t>(j0 + i, L - 1)] + d));
    }
    const int64_t n = std::min<int64_t>(16, L - j0);
    _mm512_mask_storeu_ps(s + j0, n == 16 ? 0xffff : (1u << n) - 1, _mm512_mul_ps(reduce16(acc), sc));
  }
}


// value_tile in 16 lanes: DB blocks of 16 dims. Lanes never mix, so every element runs the same FMA chain
// over the columns in order (and the same division) as in value_tile: the results are equal bit for bit,
// with half the instructions (the values were ~3/4 of a row's work at 250 columns).
template <int GB, int DB>
inline __attribute__((always_inline)) void value_tile16(const float* p, int64_t ld, const uint16_t* const* v,
                                                        int64_t offset, int64_t L, const float* den, float* out,
                                                        int64_t out_stride) {
  __m512 acc[GB][DB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 4
    for (int b = 0; b < DB; ++b) acc[g][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    __m512 pj[GB];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) pj[g] = _mm512_set1_ps(p[g * ld + j]);
#pragma GCC unroll 4
    for (int b = 0; b < DB; ++b) {
      const __m512 vv = load_bf16x16(v[j] + offset + 16 * b);
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) acc[g][b] = _mm512_fmadd_ps(pj[g], vv, acc[g][b]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 dg = _mm512_set1_ps(den[g]);
    for (int b = 0; b < DB; ++b) _mm512_storeu_ps(out + g * out_stride + offset + 16 * b, _mm512_div_ps(acc[g][b], dg));
  }
}

// value_heads for D a multiple of 16: 64 dims per tile, then 16 at a time.
template <int GB>
void value_heads16(const float* p, int64_t ld, const uint16_t* const* v, int64_t L, int64_t D, const float* den,
                   float* out, int64_t out_stride) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) value_tile16<GB, 4>(p, ld, v, d, L, den, out, out_stride);
  for (; d < D; d += 16) value_tile16<GB, 1>(p, ld, v, d, L, den, out, out_stride);
}

// attend_heads for bf16 with D a multiple of 32; q[g] points at head g's bf16 query row.
template <int GB>
void attend_heads_bf16(const uint16_t* const* q, int64_t D, const uint16_t* const* k, const uint16_t* const* v,
                       int64_t L, float scale, float* s, int64_t ld, float* out, int64_t out_stride) {
  float den[GB];
  for (int g = 0; g < GB; ++g) score_bf16(q[g], D, k, L, scale, s + g * ld);
  softmax_numerators<GB>(s, ld, L, den);
  value_heads16<GB>(s, ld, v, L, D, den, out, out_stride);
}
#endif

#ifdef __AMX_BF16__
// ---- The tile path: bf16 on CPUs with AMX (Intel Xeon since Sapphire Rapids), D a multiple of 32 ----
// A verification's rows share most of their columns (their stream's cache slots) and differ in a short tail
// (their tree ancestors), so up to 16 / G consecutive such rows form a block over the union U of their
// columns, and each K/V row is read once for all of the block's M = rows x G queries of a kv head:
//   scores: S^T (keys x queries) = K Q^T on the tile unit, 16 keys per tile, one TDPBF16PS per 32 dims;
//     an element sums its own key's and query's products over d only, whatever else shares the tiles;
//   a column a row does not see gets s = -inf there, so p = exp(s - max) = 0 exactly;
//   softmax lane-wise over the queries (exp16: exp8 in 16 lanes), the denominator summed in double in
//   column order; values: acc[m] = fma(p[j][m], v_j, acc[m]) in U's order, where p = 0 adds exactly 0.
// U holds a row's columns in the row's own order (the shared prefix, then the tails' slots ascending), so
// every quantity of a row equals what it computes in a block of its own: its output does not depend on the
// block, the other rows or the thread. The scores' rounding differs from the vdpbf16ps path's; a machine
// takes one path for every call. A 6-row verification at 250 columns: see tests and README.
constexpr int64_t MAX_TAIL = 32;  // tail columns a row may bring to a block beyond the shared prefix

// tmm0: C (16 keys x 16 queries fp32); tmm1: A (16 keys x 32 dims); tmm2: B (16 dim pairs x 16 queries).
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 3; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Rows [first, first + rows) over the columns U; lanes[j]: the queries (bit i * G + g) that see U[j].
struct Block {
  int64_t first, rows;
  std::vector<int64_t> columns;
  std::vector<uint16_t> lanes;
};

bool ascending(const int64_t* c, int64_t n) {
  for (int64_t i = 1; i < n; ++i)
    if (c[i] <= c[i - 1]) return false;
  return true;
}

int64_t common_prefix(const int64_t* a, int64_t a_len, const int64_t* b, int64_t b_len) {
  int64_t n = 0;
  while (n < std::min(a_len, b_len) && a[n] == b[n]) ++n;
  return n;
}

// Rows [first, first + rows) over the union of their columns: their common prefix with the first row, then the
// distinct slots of their tails beyond it, ascending (make_blocks checked each tail is ascending).
Block block_of(const int64_t* cols, const int64_t* rp, int64_t first, int64_t rows, int64_t G) {
  const int64_t* base = cols + rp[first];
  const int64_t base_len = rp[first + 1] - rp[first];
  int64_t prefix = base_len;
  for (int64_t i = first + 1; i < first + rows; ++i)
    prefix = std::min(prefix, common_prefix(base, base_len, cols + rp[i], rp[i + 1] - rp[i]));
  Block block{first, rows, {}, {}};
  const uint16_t all = static_cast<uint16_t>((1u << (rows * G)) - 1);
  if (rows == 1) {
    block.columns.assign(base, base + base_len);
    block.lanes.assign(base_len, all);
    return block;
  }
  std::vector<int64_t> tail;
  for (int64_t i = first; i < first + rows; ++i) tail.insert(tail.end(), cols + rp[i] + prefix, cols + rp[i + 1]);
  std::sort(tail.begin(), tail.end());
  tail.erase(std::unique(tail.begin(), tail.end()), tail.end());
  block.columns.assign(base, base + prefix);
  block.columns.insert(block.columns.end(), tail.begin(), tail.end());
  block.lanes.assign(block.columns.size(), 0);
  std::fill(block.lanes.begin(), block.lanes.begin() + prefix, all);
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t bits = static_cast<uint16_t>(((1u << G) - 1) << (i * G));
    for (int64_t k = rp[first + i] + prefix; k < rp[first + i + 1]; ++k) {
      const int64_t at = std::lower_bound(tail.begin(), tail.end(), cols[k]) - tail.begin();
      block.lanes[prefix + at] |= bits;
    }
  }
  return block;
}

// Runs of consecutive rows that share all but at most MAX_TAIL of their columns with the run's first row, as a
// prefix, and bring ascending tails (a stream's tree rows: its slots, then ancestors' new slots), each run split
// into blocks of at most 16 / G rows of near-equal size (6 rows at G = 3: 3 + 3, so the threads get equal work).
// Any part of a run keeps both properties (a longer shared prefix, shorter tails), and any blocking gives the same
// results: this only decides how much work is shared.
std::vector<Block> make_blocks(const int64_t* cols, const int64_t* rp, int64_t N, int64_t G) {
  constexpr int64_t MAX_RUN = 64;
  const int64_t per_block = 16 / G;
  std::vector<Block> blocks;
  for (int64_t r = 0; r < N;) {
    const int64_t* base = cols + rp[r];
    const int64_t base_len = rp[r + 1] - rp[r];
    int64_t rows = 1, prefix = base_len;
    while (rows < MAX_RUN && r + rows < N) {
      const int64_t c = r + rows;
      const int64_t shared = std::min(prefix, common_prefix(base, base_len, cols + rp[c], rp[c + 1] - rp[c]));
      bool fits = true;  // every row's tail beyond the run's prefix (the earlier rows' again where it shrank)
      for (int64_t i = shared == prefix ? c : r; i <= c && fits; ++i) {
        const int64_t tail = rp[i + 1] - rp[i] - shared;
        fits = tail <= MAX_TAIL && ascending(cols + rp[i] + shared, tail);
      }
      if (!fits) break;
      prefix = shared;
      ++rows;
    }
    const int64_t parts = (rows + per_block - 1) / per_block;
    for (int64_t p = 0, first = r; p < parts; ++p) {
      const int64_t size = rows / parts + (p < rows % parts ? 1 : 0);
      blocks.push_back(block_of(cols, rp, first, size, G));
      first += size;
    }
    r += rows;
  }
  return blocks;
}

// out[m][d] = sum_j p[16 j + m] v[j][d] / den[m] for the block's M queries, 16 dims at a time, the sum in
// U's order as one FMA chain per element (value_tile16's chain; a p of 0 leaves it unchanged).
template <int M>
void weigh_values(const float* p, const uint16_t* const* v, int64_t L, int64_t D, const float* den, float* out) {
  for (int64_t d = 0; d < D; d += 16) {
    __m512 acc[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      const __m512 vv = load_bf16x16(v[j] + d);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(p[16 * j + m]), vv, acc[m]);
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * D + d, _mm512_div_ps(acc[m], _mm512_set1_ps(den[m])));
  }
}

using WeighValues = void (*)(const float*, const uint16_t* const*, int64_t, int64_t, const float*, float*);

template <int... M>
constexpr std::array<WeighValues, sizeof...(M)> weigh_table(std::integer_sequence<int, M...>) {
  return {&weigh_values<M + 1>...};
}

struct TileScratch {
  std::vector<float> s;         // (L, 16) scores, then softmax numerators, key-major
  std::vector<float> o;         // (16, D) the queries' outputs
  std::vector<uint16_t> keys;   // (16, D) gathered key rows
  std::vector<uint16_t> qt;     // (D / 2, 16, 2) Q^T: dim pairs x queries
  std::vector<const uint16_t*> v;
};

// One (block, kv head) task.
void attend_block(const Problem<uint16_t>& pb, const Block& block, int64_t hk, TileScratch& sc) {
  const int64_t G = pb.H / pb.H_kv, D = pb.D, N = pb.N, M = block.rows * G;
  const int64_t L = static_cast<int64_t>(block.columns.size()), slot_stride = 2 * pb.H_kv * D;
  const int64_t* cols = block.columns.data();
  // Q^T as dim pairs x queries, per 32 dims: pair kk of chunk c at qt[c * 256 + kk * 16 + n] (queries n =
  // i * G + g; past M zero)
  uint32_t* qt = reinterpret_cast<uint32_t*>(sc.qt.data());
  std::fill(qt, qt + D / 2 * 16, 0u);
  for (int64_t n = 0; n < M; ++n) {
    const uint32_t* qn = reinterpret_cast<const uint32_t*>(pb.q + ((hk * G + n % G) * N + block.first + n / G) * D);
    for (int64_t pair = 0; pair < D / 2; ++pair) qt[pair * 16 + n] = qn[pair];
  }
  float* s = sc.s.data();
  const uint16_t* k0 = pb.kv + hk * D;
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - j0);
    bool contiguous = n == 16;
    for (int64_t i = 1; i < n && contiguous; ++i) contiguous = cols[j0 + i] == cols[j0] + i;
    const uint16_t* keys = k0 + cols[j0] * slot_stride;  // read in place: 16 consecutive slots
    int64_t stride = slot_stride * 2;
    if (!contiguous) {
      for (int64_t i = 0; i < 16; ++i) {
        uint16_t* row = sc.keys.data() + i * D;
        if (i < n) std::memcpy(row, k0 + cols[j0 + i] * slot_stride, D * 2);
        else std::memset(row, 0, D * 2);
      }
      keys = sc.keys.data();
      stride = D * 2;
    }
    _tile_zero(0);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(1, keys + 32 * c, stride);
      _tile_loadd(2, sc.qt.data() + 512 * c, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, s + 16 * j0, 64);
  }
  const __m512 scale = _mm512_set1_ps(pb.scale), none = _mm512_set1_ps(-INFINITY);
  __m512 top = none;
  for (int64_t j = 0; j < L; ++j) {  // scaled scores, -inf where a query does not see the column; their max
    const __m512 sj = _mm512_mask_mul_ps(none, block.lanes[j], _mm512_loadu_ps(s + 16 * j), scale);
    _mm512_storeu_ps(s + 16 * j, sj);
    top = _mm512_max_ps(top, sj);
  }
  __m512d sum_lo = _mm512_setzero_pd(), sum_hi = _mm512_setzero_pd();
  for (int64_t j = 0; j < L; ++j) {  // numerators, and their sum per query in column order, in double
    const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * j), top));
    _mm512_storeu_ps(s + 16 * j, p);
    sum_lo = _mm512_add_pd(sum_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
    sum_hi = _mm512_add_pd(sum_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))));
  }
  alignas(64) float den[16];
  _mm256_storeu_ps(den, _mm512_cvtpd_ps(sum_lo));
  _mm256_storeu_ps(den + 8, _mm512_cvtpd_ps(sum_hi));
  for (int64_t j = 0; j < L; ++j) sc.v[j] = pb.kv + cols[j] * slot_stride + (pb.H_kv + hk) * D;
  static constexpr auto weigh = weigh_table(std::make_integer_sequence<int, 16>{});
  weigh[M - 1](s, sc.v.data(), L, D, den, sc.o.data());
  for (int64_t n = 0; n < M; ++n) {
    const int64_t h = hk * G + n % G, r = block.first + n / G;
    const float* o = sc.o.data() + n * D;
    if (pb.rows_out) {
      uint16_t* dst = pb.rows_out + r * pb.H * D + h * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = spectot::to_bf16(o[d]);
    } else {
      std::memcpy(pb.out + (h * N + r) * D, o, D * 4);
    }
  }
}

void run_tiles(const Problem<uint16_t>& pb) {
  const int64_t G = pb.H / pb.H_kv;
  const auto blocks = make_blocks(pb.columns, pb.row_ptr, pb.N, G);
  // tasks (block, kv head), dealt to the threads largest first onto the least loaded (a thread's share only)
  std::vector<std::pair<int64_t, int64_t>> tasks;
  size_t longest = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b) {
    longest = std::max(longest, blocks[b].columns.size());
    for (int64_t hk = 0; hk < pb.H_kv; ++hk) tasks.emplace_back(b, hk);
  }
  auto cost = [&](const std::pair<int64_t, int64_t>& t) {
    return static_cast<int64_t>(blocks[t.first].columns.size()) * (blocks[t.first].rows * G + 4);
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) { return cost(a) > cost(b); });
  const int64_t parts = std::min<int64_t>(static_cast<int64_t>(tasks.size()), at::get_num_threads());
  std::vector<std::vector<std::pair<int64_t, int64_t>>> share(parts);
  std::vector<int64_t> load(parts, 0);
  for (const auto& t : tasks) {
    const int64_t p = std::min_element(load.begin(), load.end()) - load.begin();
    share[p].push_back(t);
    load[p] += cost(t);
  }
  const int64_t padded = (static_cast<int64_t>(longest) + 15) / 16 * 16;
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    TileScratch sc{std::vector<float>(padded * 16), std::vector<float>(16 * pb.D), std::vector<uint16_t>(16 * pb.D),
                   std::vector<uint16_t>(pb.D / 32 * 512), std::vector<const uint16_t*>(longest)};
    for (int64_t p = begin; p < end; ++p)
      for (const auto& [b, hk] : share[p]) attend_block(pb, blocks[b], hk, sc);
    _tile_release();
  });
}
#endif

// Scratch one thread reuses across its tasks.
struct Scratch {
  std::vector<float> o;        // (G, D) the group's outputs before rounding, for a bf16 row-major result
  std::vector<float> q;        // (G, D) the group's query rows in fp32
  std::vector<float> s;        // (3, ld) scores, then softmax numerators, of up to 3 heads
  std::vector<const void*> k;  // (L,) key row pointers
  std::vector<const void*> v;  // (L,) value row pointers
};

// With a bf16 row-major result: the G heads' fp32 outputs of row r (G x D in `out`), rounded to bf16 as
// torch's `.to(torch.bfloat16)` rounds, into row r's columns (hk*G .. hk*G+G-1) * D of rows_out.
template <typename T>
void store_rows(const Problem<T>& pb, int64_t r, int64_t hk, const float* out) {
  if (!pb.rows_out) return;
  const int64_t G = pb.H / pb.H_kv, width = G * pb.D;
  uint16_t* dst = pb.rows_out + r * pb.H * pb.D + hk * width;
  for (int64_t i = 0; i < width; ++i) dst[i] = spectot::to_bf16(out[i]);
}

// One (row r, kv head hk) task: the G query heads hk*G .. hk*G+G-1 of row r, 3 at a time.
template <typename T>
void attend_group(const Problem<T>& pb, int64_t r, int64_t hk, Scratch& scratch) {
  const int64_t G = pb.H / pb.H_kv, D = pb.D, N = pb.N;
  const int64_t first = pb.row_ptr[r], L = pb.row_ptr[r + 1] - first, ld = (L + 7) / 8 * 8;
  const int64_t slot_stride = 2 * pb.H_kv * D;
  const T** k = reinterpret_cast<const T**>(scratch.k.data());
  const T** v = reinterpret_cast<const T**>(scratch.v.data());
  for (int64_t j = 0; j < L; ++j) {
    const T* slot = pb.kv + pb.columns[first + j] * slot_stride;
    k[j] = slot + hk * D;
    v[j] = slot + (pb.H_kv + hk) * D;
  }
  float* s = scratch.s.data();
  // query head hk*G + g at out + g * head_stride: the (H, N, D) result, or the scratch rounded into rows_out
  float* out = pb.rows_out ? scratch.o.data() : pb.out + (hk * G * N + r) * D;
  const int64_t head_stride = pb.rows_out ? D : N * D;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (D % 32 == 0) {
      for (int64_t g = 0; g < G; g += 3) {
        const uint16_t* q[3];
        for (int64_t i = 0; i < 3 && g + i < G; ++i) q[i] = pb.q + ((hk * G + g + i) * N + r) * D;
        float* og = out + g * head_stride;
        switch (std::min<int64_t>(3, G - g)) {
          case 3: attend_heads_bf16<3>(q, D, k, v, L, pb.scale, s, ld, og, head_stride); break;
          case 2: attend_heads_bf16<2>(q, D, k, v, L, pb.scale, s, ld, og, head_stride); break;
          default: attend_heads_bf16<1>(q, D, k, v, L, pb.scale, s, ld, og, head_stride); break;
        }
      }
      store_rows(pb, r, hk, out);
      return;
    }
  }
#endif
  float* q = scratch.q.data();
  for (int64_t g = 0; g < G; ++g) {
    const T* src = pb.q + ((hk * G + g) * N + r) * D;
    for (int64_t d = 0; d < D; ++d) q[g * D + d] = to_float(src[d]);
  }
  for (int64_t g = 0; g < G; g += 3) {
    const float* qg = q + g * D;
    float* og = out + g * head_stride;
    switch (std::min<int64_t>(3, G - g)) {
      case 3: attend_heads<3>(qg, D, k, v, L, pb.scale, s, ld, og, head_stride); break;
      case 2: attend_heads<2>(qg, D, k, v, L, pb.scale, s, ld, og, head_stride); break;
      default: attend_heads<1>(qg, D, k, v, L, pb.scale, s, ld, og, head_stride); break;
    }
  }
  store_rows(pb, r, hk, out);
}

// Task t = r * H_kv + hk costs about its row's column count. Split [0, N*H_kv) into `parts`
// contiguous ranges of about equal cost (causal prefill rows grow linearly, so equal task counts
// would leave one thread with most of the work). Affects only which thread runs a task.
std::vector<int64_t> balanced_bounds(const int64_t* row_ptr, int64_t N, int64_t H_kv, int64_t parts) {
  const int64_t tasks = N * H_kv;
  const double total = static_cast<double>(row_ptr[N]) * H_kv;
  std::vector<int64_t> bounds(parts + 1, tasks);
  bounds[0] = 0;
  int64_t t = 0;
  double done = 0.0;  // cost of tasks [0, t)
  for (int64_t p = 1; p < parts; ++p) {
    const double target = total * p / parts;
    while (t < tasks && done < target) {
      done += static_cast<double>(row_ptr[t / H_kv + 1] - row_ptr[t / H_kv]);
      ++t;
    }
    bounds[p] = t;
  }
  return bounds;
}

template <typename T>
void run(const Problem<T>& pb, int64_t max_len) {
  const int64_t G = pb.H / pb.H_kv;
  const int64_t tasks = pb.N * pb.H_kv;
  const int64_t parts = std::min<int64_t>(tasks, 4 * at::get_num_threads());
  const auto bounds = balanced_bounds(pb.row_ptr, pb.N, pb.H_kv, parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch{std::vector<float>(pb.rows_out ? G * pb.D : 0), std::vector<float>(G * pb.D),
                    std::vector<float>(3 * ((max_len + 7) / 8 * 8)),
                    std::vector<const void*>(max_len), std::vector<const void*>(max_len)};
    for (int64_t part = begin; part < end; ++part)
      for (int64_t t = bounds[part]; t < bounds[part + 1]; ++t) attend_group(pb, t / pb.H_kv, t % pb.H_kv, scratch);
  });
}

}  // namespace

// The longest row of a CSR column list (row_ptr rp: N + 1 entries), after checking that it runs from 0 to n_cols,
// that every row reads a column and that every column is a slot of a cache of `capacity`.
int64_t checked_max_len(const int64_t* rp, int64_t N, const int64_t* cols, int64_t n_cols, int64_t capacity) {
  TORCH_CHECK(rp[0] == 0 && rp[N] == n_cols, "tree_attention: row_ptr must run from 0 to len(columns) = ", n_cols,
              ", got ", rp[0], " .. ", rp[N]);
  int64_t max_len = 0;
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK(rp[r + 1] > rp[r], "tree_attention: row ", r, " attends to no columns");
    max_len = std::max(max_len, rp[r + 1] - rp[r]);
  }
  for (int64_t i = 0; i < n_cols; ++i)
    TORCH_CHECK(cols[i] >= 0 && cols[i] < capacity, "tree_attention: column ", cols[i], " is outside the cache (",
                capacity, " slots)");
  return max_len;
}

// A bf16 problem on the tile unit where the build, the shapes and the OS allow it (``tiles``), else on the lanes.
void run_bf16(const Problem<uint16_t>& pb, int64_t max_len, bool tiles) {
#ifdef __AMX_BF16__
  if (tiles && pb.D % 32 == 0 && pb.H / pb.H_kv <= 16 && amx_permitted()) {
    run_tiles(pb);
    return;
  }
#endif
  (void)tiles;
  run(pb, max_len);
}

// bf16 attention into rows (N, H * D), rounded: ``tree_attention(..., rows_bf16=True)`` over raw pointers (q: H x N x
// D; kv: the cache, capacity x 2 x H_kv x D; columns checked by checked_max_len), for the native layer loop.
void attend_bf16_rows(const uint16_t* q, int64_t H, int64_t N, int64_t D, const uint16_t* kv, int64_t H_kv,
                      const int64_t* cols, const int64_t* rp, int64_t max_len, double scale, bool tiles,
                      uint16_t* rows) {
  run_bf16({q, kv, cols, rp, nullptr, rows, H, N, H_kv, D, static_cast<float>(scale)}, max_len, tiles);
}

// Ask for the cache lines of one attention's keys and values ahead of it (``run``'s tasks and split: each thread
// the lines its own tasks will read, into its own L2), for the native layer loop to call before a layer's
// projections: a one-row step reads them from DRAM (the weights streamed since evict them), one short strided
// run a key, and the misses stalled the attention's FMA chains. A prefetch changes no arithmetic. Session 42, 2-core
// Zen 3, SmolLM2 bf16 after 200 tokens (scripts/stack_ab.py, 30 alternating forwards): 1 / 6 / 8 rows 10.37 / 14.86 /
// 20.50 -> 9.99 / 14.66 / 19.66 ms (the attention's share of a one-row forward 5.6 -> 4.7 %).
void prefetch_kv(const uint16_t* kv, int64_t N, int64_t H_kv, int64_t D, const int64_t* cols, const int64_t* rp) {
  const int64_t tasks = N * H_kv, parts = std::min<int64_t>(tasks, 4 * at::get_num_threads());
  const auto bounds = balanced_bounds(rp, N, H_kv, parts);
  const int64_t slot_stride = 2 * H_kv * D, row_bytes = D * 2;
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part)
      for (int64_t t = bounds[part]; t < bounds[part + 1]; ++t) {
        const int64_t r = t / H_kv, hk = t % H_kv;
        for (int64_t i = rp[r]; i < rp[r + 1]; ++i) {
          const char* k = reinterpret_cast<const char*>(kv + cols[i] * slot_stride + hk * D);
          const char* v = reinterpret_cast<const char*>(kv + cols[i] * slot_stride + (H_kv + hk) * D);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 2);
            __builtin_prefetch(v + b, 0, 2);
          }
        }
      }
  });
}

torch::Tensor tree_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor columns, torch::Tensor row_ptr,
                             double scale, bool rows_bf16, bool tiles) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && columns.device().is_cpu() && row_ptr.device().is_cpu(),
              "tree_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3, "tree_attention: q must be (H, N, D), got ", q.sizes());
  TORCH_CHECK(kv.dim() == 4 && kv.size(1) == 2, "tree_attention: kv must be (capacity, 2, H_kv, D), got ", kv.sizes());
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "tree_attention: q and kv must share a dtype, got ",
              q.scalar_type(), " and ", kv.scalar_type());
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat32,
              "tree_attention: dtype must be bfloat16 or float32, got ", q.scalar_type());
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous(), "tree_attention: q and kv must be contiguous");
  const int64_t H = q.size(0), N = q.size(1), D = q.size(2), H_kv = kv.size(2), capacity = kv.size(0);
  TORCH_CHECK(kv.size(3) == D, "tree_attention: q has head dim ", D, " but kv has ", kv.size(3));
  TORCH_CHECK(D > 0 && D % 8 == 0, "tree_attention: head dim must be a positive multiple of 8, got ", D);
  TORCH_CHECK(H_kv > 0 && H > 0 && H % H_kv == 0, "tree_attention: ", H, " query heads are not a positive multiple of ",
              H_kv, " kv heads");
  TORCH_CHECK(columns.scalar_type() == torch::kInt64 && row_ptr.scalar_type() == torch::kInt64,
              "tree_attention: columns and row_ptr must be int64");
  TORCH_CHECK(columns.dim() == 1 && columns.is_contiguous() && row_ptr.dim() == 1 && row_ptr.is_contiguous(),
              "tree_attention: columns and row_ptr must be contiguous 1-D tensors");
  TORCH_CHECK(row_ptr.numel() == N + 1, "tree_attention: row_ptr must have N + 1 = ", N + 1, " entries, got ",
              row_ptr.numel());
  const int64_t* rp = row_ptr.data_ptr<int64_t>();
  const int64_t* cols = columns.data_ptr<int64_t>();
  const int64_t max_len = checked_max_len(rp, N, cols, columns.numel(), capacity);
  TORCH_CHECK(!rows_bf16 || q.scalar_type() == torch::kBFloat16, "tree_attention: rows_bf16 needs bf16 inputs");
  auto out = rows_bf16 ? torch::empty({N, H * D}, q.options()) : torch::empty({H, N, D}, q.options().dtype(torch::kFloat32));
  if (N == 0) return out;
  auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  if (rows_bf16) {
    attend_bf16_rows(bits(q), H, N, D, bits(kv), H_kv, cols, rp, max_len, scale, tiles,
                     reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
    return out;
  }
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat32) {
    run(Problem<float>{q.data_ptr<float>(), kv.data_ptr<float>(), cols, rp, op, nullptr, H, N, H_kv, D, s}, max_len);
  } else {
    run_bf16({bits(q), bits(kv), cols, rp, op, nullptr, H, N, H_kv, D, s}, max_len, tiles);
  }
  return out;
}

#ifndef SPECTOT_STACK  // decoder_stack.cpp includes this file for its kernels, not its module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_attention", &tree_attention, "batch-invariant attention over CSR columns (AVX2)", py::arg("q"),
        py::arg("kv"), py::arg("columns"), py::arg("row_ptr"), py::arg("scale"), py::arg("rows_bf16") = false,
        py::arg("tiles") = true);
#ifdef __AMX_BF16__
  m.def("tiles", &amx_permitted, "whether this build's tile path can run here");
#else
  m.def("tiles", [] { return false; }, "whether this build's tile path can run here");
#endif
}
#endif
