// Batch-invariant bf16 linear for x86 CPUs: AVX2 + FMA, or AVX512-BF16 where the build enables it.
//
// y[r, j] = sum_k x[r, k] * W[j, k] (+ b[j]), bf16 in, fp32 accumulate, bf16 out.
//
// Why: on AVX2-only CPUs the library bf16 GEMM converts weights again for every input row, so a
// forward over n tree tokens costs ~n times one token. Here weights are packed once at load into panels
// whose vector lanes are output columns; each step widens a panel's weights for one input feature once and
// multiplies them into several input rows held in registers, so extra rows cost FMAs, not memory traffic
// or conversions. Every output element is a sum over k in order (one FMA chain per lane), whatever the
// number of rows or the tile, so a row's result does not depend on the batch it is in: a tree forward
// reproduces the AR step bit for bit.
//
// Built with -mavx512bf16 (CPUs with AVX512-BF16 but no AMX, e.g. AMD Zen 4/5), the kernel multiplies bf16
// pairs natively (vdpbf16ps) over panels of feature pairs (see `pack` below), so neither weights nor inputs
// are converted. The linears of one SmolLM2 forward on a 2-core Zen 5 then cost about the same for 1 to 8 rows.
//
// Both builds expose the same two calls: `pack(W)` once per weight (each build its own layout), then
// `linear(x, packed, bias, N)`.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <memory>
#include <vector>

#include "vec.h"

namespace {

// Weights stream from DRAM once per forward (SmolLM2's 270 MB do not fit in cache), and the hardware
// prefetcher alone keeps too few lines in flight once several input rows make each line cost more
// FMAs: without this, the linears of an 8-row forward took 11.0 ms against 5.3 ms for 1 row on a
// 2-core Zen 5; fetching every weight line 8 KB ahead of its use (past 4 KB page boundaries, which
// the hardware prefetcher does not cross) makes them 4.4 ms at 1 row and 4.6 ms at 8. A prefetch
// never faults, so running past the end of the weights is harmless. (GCC 12 drops an _mm_prefetch
// wrapped in a helper like this one; the builtin it expands to stays.)
constexpr int64_t PREFETCH_BYTES = 8192;
template <int64_t AHEAD = PREFETCH_BYTES>
inline void prefetch_ahead(const uint16_t* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + AHEAD, 0 /* read */, 3 /* all levels: T0 */);
}

using spectot::bf16_to_float;
using spectot::to_bf16;
#ifdef __AMX_BF16__
using spectot::amx_permitted;
using spectot::TileConfig;
#endif

#ifdef __AVX512BF16__
// The AVX512-BF16 kernel reads weights in a packed layout, made once when the model loads (``pack``):
// panels of 64 output columns, and inside a panel, for each pair of input features k = 2j, 2j + 1, the
// 64 columns' pairs side by side (4 vectors of 16 columns x 2 features, 256 contiguous bytes). Lane i of
// an accumulator is then one output column: each step broadcasts one input row's pair and multiplies it
// into 16 columns at once (vdpbf16ps: acc + x[2j] w[2j] + x[2j+1] w[2j+1], round to nearest even), so a
// column's sum runs over j in order and needs no horizontal reduction. That order depends on nothing but
// j, so a row's result does not depend on the rows beside it. A panel is one contiguous stream, read
// once for up to 6 rows (24 accumulators). Measured on a 2-core Zen 5 against the row-major tiles this
// replaced (per-column dot products, then a reduction per output), SmolLM2's LM head took 1.5-1.8 ms
// against 1.9-2.5 ms for 1 row, and ~1.6 ms against 3.2-3.5 ms for 6.
// Past 6 rows the panel goes in chunks of 64 pairs (16 KB): the first group of 6 rows reads a chunk from
// DRAM, the next groups read it from L1 while prefetching the next chunk, and each group's sums wait in
// memory between chunks (exact, so the bits stay those of one pass). Session 35, 2-core Zen 5, the linears
// of one SmolLM2 forward (median of 9 interleaved rounds) at 7 / 8 / 12 / 16 / 32 rows: 5.63 / 5.47 / 6.82 /
// 7.67 / 12.60 ms -> 4.80 / 4.85 / 5.79 / 6.59 / 11.92 ms (whole panels per group of 6, the panel re-read from
// L2, before; 1 row: 4.6 ms both).
constexpr int64_t PANEL = 64;  // output columns per panel: 4 vectors of 16
constexpr int64_t PANEL_ROWS = 6;  // input rows per pass over a panel
constexpr int64_t CHUNK_PAIRS = 64;  // feature pairs of a panel chunk: 16 KB of weights, held in L1 for every group
constexpr int64_t NEXT_CHUNK_BYTES = CHUNK_PAIRS * 2 * PANEL * 2;  // a later group's prefetch: the next chunk

// (N, K) -> (ceil(N / 64), ceil(K / 2), 64, 2), zero-padded
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.device().is_cpu(),
              "weight must be (N, K) bf16 on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t padded_n = (N + PANEL - 1) / PANEL * PANEL, padded_k = K + K % 2;
  auto padded = torch::zeros({padded_n, padded_k}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({padded_n / PANEL, PANEL, padded_k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// One panel for RB rows over feature pairs [j0, j1): x holds each row's feature pairs as 32-bit words, `pairs`
// per row. The sums start from zero (j0 == 0) or from `part` (RB x 64 fp32, a previous chunk's), and go back to
// `part` unless this is the last chunk, which adds the bias and writes the panel's first `cols` columns to y,
// rounded to bf16. Storing and reloading a fp32 sum is exact, so a column's sum runs over j in order however the
// pairs are chunked. AHEAD: how far ahead to prefetch the weights (the first pass over a chunk reads DRAM,
// later ones read L1 and fetch the next chunk meanwhile).
template <int RB, int64_t AHEAD = PREFETCH_BYTES>
inline __attribute__((always_inline)) void panel_tile(const uint32_t* x, int64_t pairs, const uint16_t* w,
                                                      int64_t j0, int64_t j1, float* part, const float* bias,
                                                      int64_t cols, uint16_t* y, int64_t ldy) {
  __m512 acc[4][RB];
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[c][r] = j0 ? _mm512_loadu_ps(part + r * PANEL + c * 16) : _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* step = w + j * 2 * PANEL;
    __m512bh wv[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      wv[c] = (__m512bh)_mm512_loadu_si512(step + c * 32);
      prefetch_ahead<AHEAD>(step + c * 32);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * pairs + j]));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], xv, wv[c]);
    }
  }
  if (j1 < pairs) {
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < RB; ++r) _mm512_storeu_ps(part + r * PANEL + c * 16, acc[c][r]);
    return;
  }
  for (int c = 0; c < 4 && c * 16 < cols; ++c) {
    const __mmask16 mask = cols - c * 16 >= 16 ? 0xffff : (1u << (cols - c * 16)) - 1;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c * 16) : _mm512_setzero_ps();
    for (int r = 0; r < RB; ++r)  // round to nearest even, as torch does
      _mm256_mask_storeu_epi16(y + r * ldy + c * 16, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[c][r], b)));
  }
}

// One group of up to PANEL_ROWS rows over pairs [j0, j1) of a panel (see panel_tile).
template <int64_t AHEAD>
void panel_rows(int64_t n, const uint32_t* x, int64_t pairs, const uint16_t* w, int64_t j0, int64_t j1, float* part,
                const float* bias, int64_t cols, uint16_t* y, int64_t ldy) {
  switch (n) {
    case 1: panel_tile<1, AHEAD>(x, pairs, w, j0, j1, part, bias, cols, y, ldy); break;
    case 2: panel_tile<2, AHEAD>(x, pairs, w, j0, j1, part, bias, cols, y, ldy); break;
    case 3: panel_tile<3, AHEAD>(x, pairs, w, j0, j1, part, bias, cols, y, ldy); break;
    case 4: panel_tile<4, AHEAD>(x, pairs, w, j0, j1, part, bias, cols, y, ldy); break;
    case 5: panel_tile<5, AHEAD>(x, pairs, w, j0, j1, part, bias, cols, y, ldy); break;
    default: panel_tile<6, AHEAD>(x, pairs, w, j0, j1, part, bias, cols, y, ldy); break;
  }
}

#ifdef __AMX_BF16__
// Built with -mamx-bf16 (CPUs with AMX, e.g. Intel Xeon since Sapphire Rapids), the same packed panels feed
// the tile unit: a B tile is 16 feature pairs x the 16 columns of one of a panel's four vectors (rows 256
// bytes apart, read in place), an A tile 16 input rows x 32 features, and one TDPBF16PS adds A.B into a
// 16 x 16 fp32 tile. Every output element sums its pairs in order (16 per tile op, tile after tile), from
// its own input row only, so the result does not depend on the other rows. A and C tiles hold min(rows, 16)
// rows; inputs of more than 16 rows are zero-padded to a whole number of 16-row blocks.
// The vdpbf16ps tiles above made extra rows cost ~6% of a row each on a 2-core Xeon (one SmolLM2 forward
// t(8)/t(1) = 1.5); here 16 rows cost what one does, and the weights stream from DRAM as fast as for one.
constexpr int64_t AMX_ROWS = 16, AMX_PAIRS = 16;  // rows of A and C, feature pairs of A and B

// tmm0-3: C (16 rows x 16 fp32) for the panel's four column vectors; tmm4: A; tmm5-7: B.
void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 5 ? rows : 16;  // C and A: the block's rows; B: 16 pairs
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// One panel for one block of rows (the configured tile rows): x holds each row's `pairs` feature pairs, y
// (rows x 64 fp32, 64 apart) the sums.
inline void amx_panel(const uint16_t* x, int64_t pairs, const uint16_t* w, float* y) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t j = 0; j < pairs; j += AMX_PAIRS) {
    const uint16_t* step = w + j * 2 * PANEL;  // 16 pairs x 64 columns x 2, rows 256 bytes apart
    for (int64_t line = 0; line < AMX_PAIRS * 2 * PANEL; line += 32) prefetch_ahead(step + line);
    _tile_loadd(4, x + j * 2, pairs * 4);
    _tile_loadd(5, step, 4 * PANEL);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, step + 32, 4 * PANEL);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, step + 64, 4 * PANEL);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, step + 96, 4 * PANEL);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, y, 4 * PANEL);  // tile numbers are immediates
  _tile_stored(1, y + 16, 4 * PANEL);
  _tile_stored(2, y + 32, 4 * PANEL);
  _tile_stored(3, y + 48, 4 * PANEL);
}

// y = x W^T + b over 16-row blocks; false where the tiles cannot take these weights (pairs % 16) or the OS
// refuses the tile state.
bool amx_linear(const uint16_t* x, int64_t rows, int64_t pairs, const uint16_t* w, const float* bias, int64_t N,
                uint16_t* y) {
  if (pairs % AMX_PAIRS || !amx_permitted()) return false;
  const int64_t blocks = (rows + AMX_ROWS - 1) / AMX_ROWS, tile_rows = std::min<int64_t>(rows, AMX_ROWS);
  std::vector<uint16_t> padded;  // only a last block shorter than the tiles' 16 rows needs it
  if (rows > AMX_ROWS && rows % AMX_ROWS) {
    padded.assign(blocks * AMX_ROWS * pairs * 2, 0);
    std::memcpy(padded.data(), x, rows * pairs * 4);
    x = padded.data();
  }
  const int64_t panel_size = pairs * 2 * PANEL, panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles(tile_rows);
    alignas(64) float sums[AMX_ROWS * PANEL];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * PANEL, cols = std::min<int64_t>(PANEL, N - col);
      for (int64_t block = 0; block < blocks; ++block) {
        amx_panel(x + block * AMX_ROWS * pairs * 2, pairs, w + p * panel_size, sums);
        const int64_t first = block * AMX_ROWS, count = std::min<int64_t>(AMX_ROWS, rows - first);
        for (int c = 0; c < 4 && c * 16 < cols; ++c) {
          const __mmask16 mask = cols - c * 16 >= 16 ? 0xffff : (1u << (cols - c * 16)) - 1;
          const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col + c * 16) : _mm512_setzero_ps();
          for (int64_t r = 0; r < count; ++r)  // round to nearest even, as torch does
            _mm256_mask_storeu_epi16(y + (first + r) * N + col + c * 16, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums + r * PANEL + c * 16), b)));
        }
      }
    }
    _tile_release();
  });
  return true;
}
#endif

// amx_rows: forwards of at least this many rows go to the tile unit where the build and the OS allow it
// (1: all, so every row is computed alike; the vdpbf16ps path agrees with it on all but ~1e-4 of outputs).
void check_packed(const torch::Tensor& packed, int64_t K, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16, "bf16 tensors");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == PANEL && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.device().is_cpu(),
              "weights packed by pack()");
  TORCH_CHECK(K > 0, "x has no features");  // past 6 rows no pass over the panel would write y
  TORCH_CHECK((K + 1) / 2 == packed.size(1) && N <= packed.size(0) * PANEL,
              "x's features or N do not match the packed weight");
}

// y (rows x N bf16) = x (rows x K bf16) W^T + bias (fp32, or null) over weights that passed check_packed: ``linear``
// over raw rows, for the native layer loop.
void linear_rows(const uint16_t* x, int64_t rows, int64_t K, const torch::Tensor& packed, const float* bp, int64_t N,
                 uint16_t* yp, int64_t amx_rows) {
  if (rows == 0) return;
  const int64_t pairs = packed.size(1);
  std::vector<uint16_t> padded;  // odd K: the last pair's second feature is 0, as in the weights
  if (K % 2) {
    padded.assign(rows * pairs * 2, 0);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(padded.data() + r * pairs * 2, x + r * K, K * 2);
    x = padded.data();
  }
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
#ifdef __AMX_BF16__
  if (rows >= amx_rows && amx_linear(x, rows, pairs, wp, bp, N, yp)) return;
#else
  (void)amx_rows;
#endif
  const int64_t panel_size = pairs * 2 * PANEL, panels = (N + PANEL - 1) / PANEL;
  // threads own whole panels (each output element: one owner, one order)
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> part(rows > PANEL_ROWS ? rows * PANEL : 0);  // this thread's sums between chunks
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * PANEL, cols = std::min<int64_t>(PANEL, N - col);
      const float* pb = bp ? bp + col : nullptr;
      const uint16_t* panel = wp + p * panel_size;
      if (rows <= PANEL_ROWS) {  // one pass over the panel, straight from DRAM
        panel_rows<PREFETCH_BYTES>(rows, xp, pairs, panel, 0, pairs, nullptr, pb, cols, yp + col, N);
        continue;
      }
      // more rows than registers: the panel in chunks of CHUNK_PAIRS pairs, each read from DRAM by the first
      // group of rows and from L1 by the others, their sums kept in `part` between chunks
      for (int64_t j0 = 0; j0 < pairs; j0 += CHUNK_PAIRS) {
        const int64_t j1 = std::min<int64_t>(pairs, j0 + CHUNK_PAIRS);
        for (int64_t r = 0; r < rows; r += PANEL_ROWS) {
          const auto group = r == 0 ? panel_rows<PREFETCH_BYTES> : panel_rows<NEXT_CHUNK_BYTES>;
          group(std::min<int64_t>(PANEL_ROWS, rows - r), xp + r * pairs, pairs, panel, j0, j1, part.data() + r * PANEL,
                pb, cols, yp + r * N + col, N);
        }
      }
    }
  });
}
#else
// The AVX2 kernel reads weights packed once at load into panels of 16 output columns (``pack``): for each input
// feature k the panel holds its 16 columns' bf16 weights in 32 contiguous bytes, as 8 32-bit words whose low
// half is column i and high half column 8 + i. One load then widens to fp32 exactly with one shift (columns
// 0-7) and one AND (columns 8-15), and lane i of an accumulator is one output column: each step broadcasts one
// input row's x[k] and multiplies it into 16 columns, so a column's sum runs over k in order, one FMA after the
// other, with no horizontal reduction. That order depends on nothing but k, so a row's result does not depend
// on the rows beside it or on the tile shape. A weight is widened once per step for every row of a tile (up to
// 6), so extra rows cost FMAs, not conversions or memory traffic.
// Session 40, 2-core Zen 3: measured against the row-major tiles this replaced (one column x 8 rows, a dot
// product and a horizontal sum per output), see README.
constexpr int64_t PANEL = 16;  // output columns per panel: two vectors of 8
// Input rows of a tile over one panel. From L2 on a Zen 3 core (one thread, `panel_tile` alone): 2 rows x 2
// panels 44 GMAC/s, 3 x 1 36, 4 x 1 46, 5 x 1 45 (2 FMAs a cycle is ~48); 6 x 1 written with intrinsics spills
// accumulators (GCC) and makes 34, hence `step6`.
constexpr int64_t MAX_ROWS = 6;
constexpr int64_t CHUNK = 128;  // features of a panel chunk when rows need several groups: 4 KB of weights

alignas(32) const uint32_t HIGH_HALVES[8] = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                             0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};

// One feature k of a 6-row tile over one panel (wk: its 16 weights), the intrinsics' step in asm so that the 12
// accumulators, the two widened weight vectors and one broadcast (15 of the 16 registers) stay in registers: lo
// (columns 0-7) = v << 16, v (columns 8-15) &= the high halves, then rows 3 at a time (two asm statements: one
// would take more than GCC's 30 operands). The same FMAs in the same order as the intrinsics; every memory
// operand is named, so the compiler sees what the asm reads.
inline __attribute__((always_inline)) void step6(const float* x, int64_t K, const uint16_t* wk, __m256 (&acc)[2][6]) {
  __m256 v, lo, t;
  asm("vmovdqu %[w], %[v]\n\t"
      "vpslld $16, %[v], %[lo]\n\t"
      "vpand %[mask], %[v], %[v]"
      : [v] "=&x"(v), [lo] "=&x"(lo)
      : [w] "m"(*reinterpret_cast<const __m256i*>(wk)), [mask] "m"(*reinterpret_cast<const __m256i*>(HIGH_HALVES)));
#define SPECTOT_ROWS3(R)                                                                                        \
  asm("vbroadcastss %[x0], %[t]\n\t"                                                                             \
      "vfmadd231ps %[t], %[lo], %[a0]\n\t"                                                                       \
      "vfmadd231ps %[t], %[v], %[b0]\n\t"                                                                        \
      "vbroadcastss %[x1], %[t]\n\t"                                                                             \
      "vfmadd231ps %[t], %[lo], %[a1]\n\t"                                                                       \
      "vfmadd231ps %[t], %[v], %[b1]\n\t"                                                                        \
      "vbroadcastss %[x2], %[t]\n\t"                                                                             \
      "vfmadd231ps %[t], %[lo], %[a2]\n\t"                                                                       \
      "vfmadd231ps %[t], %[v], %[b2]"                                                                            \
      : [a0] "+x"(acc[0][R]), [a1] "+x"(acc[0][R + 1]), [a2] "+x"(acc[0][R + 2]), [b0] "+x"(acc[1][R]),         \
        [b1] "+x"(acc[1][R + 1]), [b2] "+x"(acc[1][R + 2]), [t] "=&x"(t)                                         \
      : [v] "x"(v), [lo] "x"(lo), [x0] "m"(x[R * K]), [x1] "m"(x[(R + 1) * K]), [x2] "m"(x[(R + 2) * K]))
  SPECTOT_ROWS3(0);
  SPECTOT_ROWS3(3);
#undef SPECTOT_ROWS3
}

// (N, K) -> (ceil(N / 16), K, 8, 2): element [p, k, i, h] is W[16 p + 8 h + i, k], zero-padded
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.device().is_cpu(),
              "weight must be (N, K) bf16 on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t padded_n = (N + PANEL - 1) / PANEL * PANEL;
  auto padded = torch::zeros({padded_n, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({padded_n / PANEL, 2, PANEL / 2, K}).permute({0, 3, 2, 1}).contiguous();
}

// P consecutive panels (16 P columns) for RB rows of x (fp32, K apart) over features [k0, k1): the fp32 sums
// out[r * 16 P + c] start from zero (k0 == 0) or from what out holds (an earlier chunk's; storing and reloading
// a fp32 sum is exact, so the order stays k's however the features are chunked). Each panel is one stream of
// 32 bytes a feature; a step takes two features, one 64-byte line of every panel, and prefetches the line
// PREFETCH_BYTES further on.
template <int P, int RB>
inline __attribute__((always_inline)) void panel_tile(const float* x, int64_t K, const uint16_t* w, int64_t k0,
                                                      int64_t k1, int64_t panel_size, float* out) {
  const __m256i high = _mm256_load_si256(reinterpret_cast<const __m256i*>(HIGH_HALVES));
  __m256 acc[2 * P][RB];
#pragma GCC unroll 8
  for (int c = 0; c < 2 * P; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[c][r] = k0 ? _mm256_loadu_ps(out + r * P * PANEL + c * 8) : _mm256_setzero_ps();
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    if constexpr (P == 1 && RB == 6) {
      step6(x + k, K, w + k * PANEL, acc);
      return;
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * panel_size + k * PANEL));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
        acc[2 * p][r] = _mm256_fmadd_ps(xv, lo, acc[2 * p][r]);
        acc[2 * p + 1][r] = _mm256_fmadd_ps(xv, hi, acc[2 * p + 1][r]);
      }
    }
  };
  int64_t k = k0;
  for (; k + 2 <= k1; k += 2) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) prefetch_ahead(w + p * panel_size + k * PANEL);
    step(k);
    step(k + 1);
  }
  if (k < k1) step(k);
#pragma GCC unroll 8
  for (int c = 0; c < 2 * P; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * P * PANEL + c * 8, acc[c][r]);
}

// One group of rb <= 6 rows over P panels (P = 2: rb <= 2).
template <int P>
void panel_rows(int64_t rb, const float* x, int64_t K, const uint16_t* w, int64_t k0, int64_t k1, int64_t panel_size,
                float* out) {
  switch (rb) {
    case 1: panel_tile<P, 1>(x, K, w, k0, k1, panel_size, out); break;
    case 2: panel_tile<P, 2>(x, K, w, k0, k1, panel_size, out); break;
    case 3: if constexpr (P == 1) panel_tile<1, 3>(x, K, w, k0, k1, panel_size, out); break;
    case 4: if constexpr (P == 1) panel_tile<1, 4>(x, K, w, k0, k1, panel_size, out); break;
    case 5: if constexpr (P == 1) panel_tile<1, 5>(x, K, w, k0, k1, panel_size, out); break;
    default: if constexpr (P == 1) panel_tile<1, 6>(x, K, w, k0, k1, panel_size, out); break;
  }
}

void check_packed(const torch::Tensor& packed, int64_t K, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16, "bf16 tensors");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == PANEL / 2 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.device().is_cpu(),
              "weights packed by pack()");
  TORCH_CHECK(K > 0, "x has no features");
  TORCH_CHECK(packed.size(1) == K && N <= packed.size(0) * PANEL, "x's features or N do not match the packed weight");
}

// y (rows x N bf16) = x (rows x K bf16) W^T + bias (fp32, or null) over weights that passed check_packed: ``linear``
// over raw rows, for the native layer loop.
void linear_rows(const uint16_t* x, int64_t rows, int64_t K, const torch::Tensor& packed, const float* bp, int64_t N,
                 uint16_t* yp, int64_t /* amx_rows: no tile unit in this build */) {
  if (rows == 0) return;
  const std::unique_ptr<float[]> widened(new float[rows * K]);  // exact; every entry written (no zeroing pass)
  at::parallel_for(0, rows * K, 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) _mm256_storeu_ps(widened.get() + i, spectot::load_bf16x8(x + i));
    for (; i < end; ++i) widened[i] = bf16_to_float(x[i]);
  });
  const float* xp = widened.get();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  // Rows in groups of at most 6, as even as they split (7 -> 4 + 3, 8 -> 4 + 4), so every group of a forward
  // of several groups has 3 or more. One or two rows take two panels at a time, for more accumulator chains
  // (one row is bound by DRAM, not by the FMA latency, even so); more rows one.
  const int64_t groups = (rows + MAX_ROWS - 1) / MAX_ROWS, panel_size = K * PANEL, panels = packed.size(0);
  const int64_t width = rows <= 2 ? 2 : 1;
  // More than one group: a panel goes in chunks of CHUNK features, each read from DRAM by the first group and
  // from L1 by the others, their sums kept in memory between chunks; every group prefetches 8 KB (two chunks)
  // ahead, so DRAM keeps streaming while the later groups compute.
  const int64_t chunk = groups > 1 ? CHUNK : K;
  constexpr int64_t BLOCK = 2;  // panels a thread owns at a time (each output element: one owner, one order)
  at::parallel_for(0, (panels + BLOCK - 1) / BLOCK, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows * 2 * PANEL);  // every group's sums for the panels in hand
    for (int64_t block = begin; block < end; ++block) {
      const int64_t last = std::min<int64_t>(panels, (block + 1) * BLOCK);
      for (int64_t p = block * BLOCK; p < last;) {
        const int64_t n = last - p >= width ? width : 1;  // a short last block: one panel at a time
        const uint16_t* w = wp + p * panel_size;
        for (int64_t k0 = 0; k0 < K; k0 += chunk)
          for (int64_t g = 0, r0 = 0; g < groups; ++g) {
            const int64_t rb = rows / groups + (g < rows % groups);
            const int64_t k1 = std::min(K, k0 + chunk);
            float* part = sums.data() + r0 * n * PANEL;
            if (n == 2) panel_rows<2>(rb, xp + r0 * K, K, w, k0, k1, panel_size, part);
            else panel_rows<1>(rb, xp + r0 * K, K, w, k0, k1, panel_size, part);
            r0 += rb;
          }
        const int64_t col0 = p * PANEL, cols = std::min<int64_t>(n * PANEL, N - col0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)  // round to nearest even, as torch does
            yp[r * N + col0 + c] = to_bf16(sums[r * n * PANEL + c] + (bp ? bp[col0 + c] : 0.f));
        p += n;
      }
    }
  });
}

#endif

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                     int64_t amx_rows) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(), "bf16 tensors on the CPU");
  const int64_t K = x.size(-1);
  check_packed(packed, K, N);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const auto x2 = x.reshape({-1, K}).contiguous();
  auto y = torch::empty({x2.size(0), N}, x.options());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  TORCH_CHECK(!b.defined() || b.numel() == N, "a bias needs one entry per output feature");
  linear_rows(reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()), x2.size(0), K, packed,
              b.defined() ? b.data_ptr<float>() : nullptr, N, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
              amx_rows);
  return y.view(out_shape);
}

}  // namespace

#ifndef SPECTOT_STACK  // decoder_stack.cpp includes this file for its kernels, not its module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weights (N, K) in the kernel's layout");
  m.def("linear", &linear, "batch-invariant bf16 x W^T (+ b) over pack()ed weights; N = W's rows; AMX from amx_rows rows");
#ifdef __AMX_BF16__
  m.def("amx", &amx_permitted, "whether this build's tile path can run here");
#else
  m.def("amx", [] { return false; }, "whether this build's tile path can run here");
#endif
}
#endif
