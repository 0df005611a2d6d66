// Batch-invariant bf16 linear for x86 CPUs: AVX2 + FMA, or AVX512-BF16 where the build enables it.
//
// y[r, j] = sum_k x[r, k] * W[j, k] (+ b[j]), bf16 in, fp32 accumulate, bf16 out.
//
// Why: on AVX2-only CPUs the library bf16 GEMM converts weights again for every input row, so a
// forward over n tree tokens costs ~n times one token. Here each 8-wide block of a weight row is
// converted once and multiplied into several input rows held in registers (tiles of output columns
// x input rows), so extra rows cost FMAs, not memory traffic. Every output element is accumulated in
// the same order whatever the number of rows (8 lanes over k = lane mod 8, then a fixed horizontal
// sum), so a row's result does not depend on the batch it is in: a tree forward reproduces the AR
// step bit for bit.
//
// Built with -mavx512bf16 (CPUs with AVX512-BF16 but no AMX, e.g. AMD Zen 4/5), the kernel multiplies bf16
// pairs natively (vdpbf16ps) over weights packed once at load into panels whose lanes are output columns
// (see `pack` below), so neither weights nor inputs are converted and no output needs a horizontal sum.
// The linears of one SmolLM2 forward on a 2-core Zen 5 then cost about the same for 1 to 8 rows.
//
// Both builds expose the same two calls: `pack(W)` once per weight (the AVX2 build keeps W as it is), then
// `linear(x, packed, bias, N)`.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

inline float hsum(__m256 v) {  // fixed order: (lo + hi), then pairwise
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

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
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "weight must be (N, K) bf16");
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
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                     int64_t amx_rows) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16, "bf16 tensors");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == PANEL && packed.is_contiguous(), "weights packed by pack()");
  const int64_t K = x.size(-1), pairs = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == pairs && N <= packed.size(0) * PANEL, "x's features or N do not match the packed weight");
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto x2 = x.reshape({-1, K}).contiguous();
  if (K % 2) x2 = torch::constant_pad_nd(x2, {0, 1});  // the last pair's second feature is 0, as in the weights
  const int64_t rows = x2.size(0);
  auto y = torch::empty({rows, N}, x.options());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x2.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#ifdef __AMX_BF16__
  if (rows >= amx_rows && amx_linear(reinterpret_cast<const uint16_t*>(xp), rows, pairs, wp, bp, N, yp))
    return y.view(out_shape);
#endif
  if (rows == 0) return y.view(out_shape);
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
  return y.view(out_shape);
}
#else
using Input = float;  // x upcast to fp32 (exact)
torch::Tensor as_input(const torch::Tensor& x) { return x.to(torch::kFloat32).contiguous(); }

using spectot::load_bf16x8;

// One micro-tile: out[r][c] = dot(x[r, :], w[c, :]) for JB weight rows (output columns) and RB
// input rows, JB*RB accumulators in registers. Each output element is accumulated in the same order
// (8 lanes over the multiple-of-8 part of k, fixed horizontal sum, then the tail in order) whatever
// the tile shape, so tiling never changes a result.
template <int JB, int RB>
inline __attribute__((always_inline)) void tile(const float* x, int64_t K, const uint16_t* w, float* out,
                                                int64_t out_stride) {
  const int64_t K8 = K - K % 8;
  __m256 acc[JB][RB];
#pragma GCC unroll 8
  for (int c = 0; c < JB; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[JB];
#pragma GCC unroll 8
    for (int c = 0; c < JB; ++c) wv[c] = load_bf16x8(w + c * K + k);
    if ((k & 31) == 0)  // one prefetch per 64-byte line
      for (int c = 0; c < JB; ++c) prefetch_ahead(w + c * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
#pragma GCC unroll 8
      for (int c = 0; c < JB; ++c) acc[c][r] = _mm256_fmadd_ps(xv, wv[c], acc[c][r]);
    }
  }
  for (int c = 0; c < JB; ++c)
    for (int r = 0; r < RB; ++r) {
      float sum = hsum(acc[c][r]);
      for (int64_t k = K8; k < K; ++k) sum += x[r * K + k] * bf16_to_float(w[c * K + k]);
      out[r * out_stride + c] = sum;
    }
}

// JB output columns for one block of rb <= 8 rows.
template <int JB>
inline void block(const float* x, int64_t rb, int64_t K, const uint16_t* w, float* out, int64_t ld) {
  switch (rb) {
    case 8: tile<JB, 8>(x, K, w, out, ld); break;
    case 7: tile<JB, 7>(x, K, w, out, ld); break;
    case 6: tile<JB, 6>(x, K, w, out, ld); break;
    case 5: tile<JB, 5>(x, K, w, out, ld); break;
    case 4: tile<JB, 4>(x, K, w, out, ld); break;
    case 3: tile<JB, 3>(x, K, w, out, ld); break;
    case 2: tile<JB, 2>(x, K, w, out, ld); break;
    case 1: tile<JB, 1>(x, K, w, out, ld); break;
    default: break;
  }
}

// Output columns [0, cols) for all rows. One row (an AR step): tiles of 8 columns, so 8 independent
// FMA chains hide the FMA latency. Several rows: blocks of 8 rows, and for each block one column at
// a time with the block's rows in registers -- the block's inputs stay in L1 while the chunk's
// weights stream from L2 (rows outer: measured 62 -> 49 ms of linears per 16-row forward of
// SmolLM2; columns outer re-read every row from L2 once more than 8 rows were in flight). Every
// element is accumulated in the same order whatever the blocking.
void gemm(const float* x, int64_t rows, int64_t K, const uint16_t* w, int64_t cols, float* out, int64_t ld) {
  if (rows == 1) {
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) tile<8, 1>(x, K, w + c * K, out + c, ld);
    for (; c < cols; ++c) tile<1, 1>(x, K, w + c * K, out + c, ld);
    return;
  }
  for (int64_t r = 0; r < rows; r += 8) {
    const int64_t rb = std::min<int64_t>(8, rows - r);
    for (int64_t c = 0; c < cols; ++c) block<1>(x + r * K, rb, K, w + c * K, out + r * ld + c, ld);
  }
}
// The AVX2 tiles read the checkpoint's row-major weights as they are.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "weight must be (N, K) bf16");
  return weight.contiguous();
}

torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, int64_t N_out,
                     int64_t /* amx_rows: no tile unit in this build */) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16, "bf16 tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight (N, K) contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N == N_out, "N must equal the weight's rows");
  TORCH_CHECK(x.size(-1) == K, "x last dim must equal in_features");
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto x2 = as_input(x.reshape({-1, K}));  // (rows, K)
  const Input* xp = static_cast<const Input*>(x2.data_ptr());
  const int64_t rows = x2.size(0);
  auto y = torch::empty({rows, N}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    auto b = bias->to(torch::kFloat32).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  }
  // split output features across threads in chunks; each output element has one owner and one order
  constexpr int64_t CHUNK = 64;
  const int64_t chunks = (N + CHUNK - 1) / CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(rows * CHUNK);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * CHUNK, width = std::min<int64_t>(CHUNK, N - j0);
      gemm(xp, rows, K, wp + j0 * K, width, acc.data(), CHUNK);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < width; ++c) {
          const float b = bias_f.empty() ? 0.f : bias_f[j0 + c];
          yp[r * N + j0 + c] = to_bf16(acc[r * CHUNK + c] + b);
        }
    }
  });
  return y.view(out_shape);
}

#endif

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
