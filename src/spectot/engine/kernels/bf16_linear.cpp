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
// Built with -mavx512bf16 (CPUs with AVX512-BF16 but no AMX, e.g. AMD Zen 4/5), the tiles multiply bf16
// pairs natively (vdpbf16ps: 16 lanes over k = 2 * lane + {0, 1} of each 32-wide block), so neither
// weights nor inputs are converted at all. One SmolLM2 forward on a 2-core Zen 5 (128-token context):
// 1 / 2 / 4 / 8 / 16 rows 10.8 / 12.0 / 14.8 / 19.7 / 32.9 ms with the AVX2 tiles, 9.1 / 10.6 / 12.9 /
// 19.0 / 24.0 ms with these (torch's oneDNN kernel: 15.8 / 15.5 / 16.3 / 17.8 / 21.6 ms). The order is
// again fixed per output element, whatever the tile shape.
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
inline void prefetch_ahead(const uint16_t* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, 0 /* read */, 3 /* all levels: T0 */);
}

using spectot::bf16_to_float;
using spectot::to_bf16;

#ifdef __AVX512BF16__
using Input = uint16_t;  // x as bf16 bits, multiplied as it is
torch::Tensor as_input(const torch::Tensor& x) { return x.contiguous(); }

// The AVX512-BF16 micro-tile: x and w stay bf16; lane i of an accumulator sums x[k] w[k] over
// k = 32 m + 2 i + {0, 1} (vdpbf16ps, round to nearest even), then a fixed reduction, then the tail.
template <int JB, int RB>
inline __attribute__((always_inline)) void tile_bf16(const uint16_t* x, int64_t K, const uint16_t* w, float* out,
                                                     int64_t out_stride) {
  const int64_t K32 = K - K % 32;
  __m512 acc[JB][RB];
#pragma GCC unroll 8
  for (int c = 0; c < JB; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K32; k += 32) {
    __m512bh wv[JB];
#pragma GCC unroll 8
    for (int c = 0; c < JB; ++c) {
      wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k);
      prefetch_ahead(w + c * K + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
#pragma GCC unroll 8
      for (int c = 0; c < JB; ++c) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], xv, wv[c]);
    }
  }
  for (int c = 0; c < JB; ++c)
    for (int r = 0; r < RB; ++r) {
      // fixed order: 512 -> 256 -> 128 bits, then pairwise (the AVX2 kernel's hsum)
      const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(acc[c][r]),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c][r]), 1)));
      float sum = hsum(half);
      for (int64_t k = K32; k < K; ++k) sum += bf16_to_float(x[r * K + k]) * bf16_to_float(w[c * K + k]);
      out[r * out_stride + c] = sum;
    }
}

// Output columns [0, cols) for one block of RB rows, JB columns at a time, then the leftover columns.
template <int JB, int RB>
inline void columns_bf16(const uint16_t* x, int64_t K, const uint16_t* w, int64_t cols, float* out, int64_t ld) {
  int64_t c = 0;
  for (; c + JB <= cols; c += JB) tile_bf16<JB, RB>(x, K, w + c * K, out + c, ld);
  for (; c < cols; ++c) tile_bf16<1, RB>(x, K, w + c * K, out + c, ld);
}

// Output columns [0, cols) for all rows: blocks of up to 8 rows, each with enough columns per tile that
// 12-16 independent accumulators hide the vdpbf16ps latency (JB x RB: 8x1, 8x2, 4x3, 4x4, 3x5, 3x6, 2x7,
// 2x8; at most 25 of the 32 vector registers). Each element's order does not depend on the tile shape.
void gemm(const uint16_t* x, int64_t rows, int64_t K, const uint16_t* w, int64_t cols, float* out, int64_t ld) {
  for (int64_t r = 0; r < rows; r += 8) {
    const uint16_t* xb = x + r * K;
    float* ob = out + r * ld;
    switch (std::min<int64_t>(8, rows - r)) {
      case 1: columns_bf16<8, 1>(xb, K, w, cols, ob, ld); break;
      case 2: columns_bf16<8, 2>(xb, K, w, cols, ob, ld); break;
      case 3: columns_bf16<4, 3>(xb, K, w, cols, ob, ld); break;
      case 4: columns_bf16<4, 4>(xb, K, w, cols, ob, ld); break;
      case 5: columns_bf16<3, 5>(xb, K, w, cols, ob, ld); break;
      case 6: columns_bf16<3, 6>(xb, K, w, cols, ob, ld); break;
      case 7: columns_bf16<2, 7>(xb, K, w, cols, ob, ld); break;
      default: columns_bf16<2, 8>(xb, K, w, cols, ob, ld); break;
    }
  }
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
#endif

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16, "bf16 tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight (N, K) contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bf16_linear", &bf16_linear, "batch-invariant bf16 linear (AVX2 or AVX512-BF16)"); }
