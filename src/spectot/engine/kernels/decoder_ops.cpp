// The small per-layer ops of a Llama-family decoder layer in bf16, one call each instead of 5-15 torch
// ops: RMSNorm, rotary embedding of q and k with the KV-cache write, and the SwiGLU gate.
//
// Why: at one row a SmolLM2 forward spent ~3.2 of its ~9 ms dispatching these ops (about 50 tiny
// torch calls per layer over 30 layers), more than its attention. Each op here works row by row in a
// fixed order, so a row's result does not depend on the other rows (the runner's tree forward still
// reproduces the AR step bit for bit). Elementwise bf16 arithmetic rounds exactly as torch's does
// (every product or sum of bf16 values is computed in fp32 and rounded to bf16, as in
// `(q * cos) + (rotate_half(q) * sin)`); the RMSNorm mean of squares and SiLU's exp are spectot's own
// fixed-order fp32, so they may differ from torch's by an fp32 ulp before rounding. Loops run 8 lanes
// at a time over whole blocks of 8 and finish the tail with the same arithmetic in scalar code (exp
// excepted: the tail uses std::exp), so an element's result depends only on its row and position.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <immintrin.h>

#include "vec.h"

namespace {

using spectot::bf16_to_float;
using spectot::exp8;
using spectot::load_bf16x8;
using spectot::store_bf16x8;
using spectot::through_bf16x8;
using spectot::to_bf16;

inline float r(float f) { return bf16_to_float(to_bf16(f)); }  // round through bf16

const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bits_mut(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// Rows per parallel task: each row is computed alone (its math never depends on the split), so
// threads only decide who computes it; small batches (a decoding step) stay on one thread.
inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous bf16 CPU tensor");
}

}  // namespace

// y = w * bf16(x * rsqrt(mean(x^2) + eps)) over each of the rows (x, y: rows x H bf16, w: H; HF's LlamaRMSNorm);
// ``rms_norm`` below takes tensors, the native layer loop raw rows.
// The mean: 8 fp32 partial sums over h mod 8 (FMA chains), added in a fixed order, then the tail.
void rms_norm_rows(const uint16_t* xp, int64_t rows, int64_t H, const uint16_t* wp, double eps, uint16_t* yp) {
  const int64_t H8 = H - H % 8;
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint16_t* row = xp + n * H;
      uint16_t* out = yp + n * H;
      __m256 part = _mm256_setzero_ps();  // lane i sums x[h]^2 over h = i mod 8
      for (int64_t h = 0; h < H8; h += 8) {
        const __m256 v = load_bf16x8(row + h);
        part = _mm256_fmadd_ps(v, v, part);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, part);
      float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      for (int64_t h = H8; h < H; ++h) sum = std::fma(bf16_to_float(row[h]), bf16_to_float(row[h]), sum);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (int64_t h = 0; h < H8; h += 8)
        store_bf16x8(out + h,
                     _mm256_mul_ps(load_bf16x8(wp + h), through_bf16x8(_mm256_mul_ps(load_bf16x8(row + h), inv8))));
      for (int64_t h = H8; h < H; ++h) out[h] = to_bf16(bf16_to_float(wp[h]) * r(bf16_to_float(row[h]) * inv));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  const int64_t H = weight.numel();
  TORCH_CHECK(H > 0 && x.size(-1) == H, "x's last dimension must equal the weight's size, at least 1");
  auto y = torch::empty_like(x);
  rms_norm_rows(bits(x), x.numel() / H, H, bits(weight), eps, bits_mut(y));
  return y;
}

// Rotary embedding of one head vector (HF's rotate_half form): for d < D/2
// out[d] = (x[d] cos[d]) + (-x[d + D/2] sin[d]), for d >= D/2 out[d] = (x[d] cos[d]) + (x[d - D/2] sin[d]),
// each product and the sum rounded to bf16 as torch's bf16 ops round them.
inline void rope_head(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  int64_t d = 0;
  if (half % 8 == 0)
    for (; d < half; d += 8) {
      const __m256 lo = load_bf16x8(x + d), hi = load_bf16x8(x + d + half);
      const __m256 minus_hi = _mm256_xor_ps(hi, _mm256_set1_ps(-0.0f));  // torch's neg: -(+0) = -0
      store_bf16x8(out + d, _mm256_add_ps(through_bf16x8(_mm256_mul_ps(lo, load_bf16x8(cos + d))),
                                          through_bf16x8(_mm256_mul_ps(minus_hi, load_bf16x8(sin + d)))));
      store_bf16x8(out + d + half, _mm256_add_ps(through_bf16x8(_mm256_mul_ps(hi, load_bf16x8(cos + d + half))),
                                                 through_bf16x8(_mm256_mul_ps(lo, load_bf16x8(sin + d + half)))));
    }
  for (; d < half; ++d) {
    const float lo = bf16_to_float(x[d]), hi = bf16_to_float(x[d + half]);
    out[d] = to_bf16(r(lo * bf16_to_float(cos[d])) + r(-hi * bf16_to_float(sin[d])));
    out[d + half] = to_bf16(r(hi * bf16_to_float(cos[d + half])) + r(lo * bf16_to_float(sin[d + half])));
  }
}

void rope_store_rows(const uint16_t* in, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, const uint16_t* cp,
                     const uint16_t* sp, uint16_t* qp, uint16_t* kvp);

// qkv (N, (Hq + 2 Hkv) D): the fused projection's output, q heads then k heads then v heads.
// cos, sin (N, D): the rotary tables at each row's position. new_kv (N, 2, Hkv, D): the cache slots of
// the new rows, written in place: [n, 0] = rotated k, [n, 1] = v. Returns the rotated q as (Hq, N, D),
// the layout the attention kernel reads.
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor new_kv, int64_t Hq,
                         int64_t Hkv) {
  check_bf16(qkv, "qkv");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  check_bf16(new_kv, "new_kv");
  const int64_t N = qkv.size(0), D = cos.size(-1);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (Hq + 2 * Hkv) * D, "qkv must be (N, (Hq + 2 Hkv) * head_dim)");
  TORCH_CHECK(cos.numel() == N * D && sin.numel() == N * D, "cos and sin must be (N, head_dim)");
  TORCH_CHECK(new_kv.numel() == N * 2 * Hkv * D, "new_kv must be (N, 2, Hkv, head_dim)");
  auto q = torch::empty({Hq, N, D}, qkv.options());
  rope_store_rows(bits(qkv), N, Hq, Hkv, D, bits(cos), bits(sin), bits_mut(q), bits_mut(new_kv));
  return q;
}

// rope_store_rows: the same over raw rows (qkv: N x (Hq + 2 Hkv) D; cos, sin: N x D; q: Hq x N x D; kvp: the N
// new slots, N x 2 x Hkv x D), for the native layer loop.
void rope_store_rows(const uint16_t* in, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, const uint16_t* cp,
                     const uint16_t* sp, uint16_t* qp, uint16_t* kvp) {
  const int64_t width = (Hq + 2 * Hkv) * D;
  at::parallel_for(0, N, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint16_t* row = in + n * width;
      const uint16_t* c = cp + n * D;
      const uint16_t* s = sp + n * D;
      for (int64_t h = 0; h < Hq; ++h) rope_head(row + h * D, c, s, D, qp + (h * N + n) * D);
      uint16_t* slot = kvp + n * 2 * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) rope_head(row + (Hq + h) * D, c, s, D, slot + h * D);
      std::copy(row + (Hq + Hkv) * D, row + width, slot + Hkv * D);  // v as it is
    }
  });
}

#ifdef __AVX512F__
inline __m512 negate16(__m512 v) {  // -v by the sign bit, as _mm256_xor_ps with -0 (xor_ps itself needs AVX512DQ)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}
#endif

void silu_mul_rows(const uint16_t* in, int64_t rows, int64_t I, uint16_t* op);

// gate_up (..., 2I): gate then up (the fused projection). Returns bf16(silu(gate)) * up, rounded to bf16:
// HF's `act_fn(gate_proj(x)) * up_proj(x)` with silu(g) = g / (1 + exp(-g)) in fp32 (exp: exp8). Built with
// AVX-512 (decoder_stack.cpp), 16 lanes at a time with the same operations per element (exp16), then 8, then
// the scalar tail as before: every element's result is the same in both builds. Spans of 512 columns are
// split across threads once a call has enough of them (a verification's rows took 19 us on one thread).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "gate_up");
  const int64_t I2 = gate_up.size(-1);
  TORCH_CHECK(I2 > 0 && I2 % 2 == 0, "gate_up's last dimension must be even and positive (gate then up)");
  const int64_t I = I2 / 2, rows = gate_up.numel() / I2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  silu_mul_rows(bits(gate_up), rows, I, bits_mut(out));
  return out;
}

// silu_mul_rows: the same over raw rows (in: rows x 2I, op: rows x I), for the native layer loop.
void silu_mul_rows(const uint16_t* in, int64_t rows, int64_t I, uint16_t* op) {
  const int64_t I2 = 2 * I;
  constexpr int64_t SPAN = 512;  // columns per task (a multiple of 16)
  const int64_t spans = (I + SPAN - 1) / SPAN;
  const __m256 one = _mm256_set1_ps(1.0f);
  at::parallel_for(0, rows * spans, std::max<int64_t>(1, 4096 / SPAN), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / spans, first = task % spans * SPAN, last = std::min(I, first + SPAN);
      const uint16_t* gate = in + n * I2;
      const uint16_t* up = gate + I;
      uint16_t* o = op + n * I;
      int64_t i = first;
#ifdef __AVX512F__
      for (; i + 16 <= last; i += 16) {
        const __m512 g = spectot::load_bf16x16(gate + i);
        const __m512 silu = _mm512_div_ps(
            g, _mm512_add_ps(_mm512_set1_ps(1.0f), spectot::exp16(negate16(g))));
        spectot::store_bf16x16(o + i, _mm512_mul_ps(spectot::through_bf16x16(silu), spectot::load_bf16x16(up + i)));
      }
#endif
      for (; i + 8 <= last; i += 8) {
        const __m256 g = load_bf16x8(gate + i);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)))));
        store_bf16x8(o + i, _mm256_mul_ps(through_bf16x8(silu), load_bf16x8(up + i)));
      }
      for (; i < last; ++i) {
        const float g = bf16_to_float(gate[i]);
        o[i] = to_bf16(r(g / (1.0f + std::exp(-g))) * bf16_to_float(up[i]));
      }
    }
  });
}

// x = bf16(x + y) element by element (torch's bf16 add: the fp32 sum, rounded to nearest even), in place: the
// native layer loop's residual adds.
void add_rows(uint16_t* x, const uint16_t* y, int64_t n) {
  at::parallel_for(0, (n + 4095) / 4096, 8, [&](int64_t begin, int64_t end) {
    const int64_t last = std::min(n, end * 4096);
    int64_t i = begin * 4096;
    for (; i + 8 <= last; i += 8) store_bf16x8(x + i, _mm256_add_ps(load_bf16x8(x + i), load_bf16x8(y + i)));
    for (; i < last; ++i) x[i] = to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
  });
}

// What a verification step reads of its fp32 logits (R, V): every row's argmax (the greedy tokens) and, for the
// rows on the accepted path only, log sum_j exp(x_j) (the emitted tokens' log-probabilities); in place of a
// numpy argmax and a torch log_softmax that re-read rows which had left the cache (~0.6 ms of a verified
// tree's host work on a 2-core Xeon). Each row alone, in a fixed order: its results never depend on the others.

// A row's maximum, over four lanes of 8 (rows of NaN are not expected).
float row_max(const float* row, int64_t V) {
  __m256 m[4];
  for (auto& lane : m) lane = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 32 <= V; j += 32)
    for (int l = 0; l < 4; ++l) m[l] = _mm256_max_ps(m[l], _mm256_loadu_ps(row + j + 8 * l));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  float top = -INFINITY;
  for (float v : lanes) top = std::max(top, v);
  for (; j < V; ++j) top = std::max(top, row[j]);
  return top;
}

// The lowest index among a row's maxima (torch.argmax's rule; a row of NaN gives 0): the first entry equal to
// its maximum.
int64_t row_argmax(const float* row, int64_t V) {
  const float top = row_max(row, V);
  const __m256 target = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), target, _CMP_EQ_OQ));
    if (hits) return j + __builtin_ctz(hits);
  }
  for (; j < V; ++j)
    if (row[j] == top) return j;
  return 0;
}

// log sum_j exp(x_j) = m + log sum_j exp(x_j - m), m the row's maximum; the sum in double, 8 lanes then their total.
float row_logsumexp(const float* row, int64_t V, float top) {
  if (std::isinf(top) && top < 0) return top;  // every entry -inf: no probability anywhere
  const __m256 shift = _mm256_set1_ps(top);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double l4[4], h4[4];
  _mm256_store_pd(l4, lo);
  _mm256_store_pd(h4, hi);
  double sum = ((l4[0] + l4[1]) + (l4[2] + l4[3])) + ((h4[0] + h4[1]) + (h4[2] + h4[3]));
  for (; j < V; ++j) sum += std::exp(static_cast<double>(row[j] - top));
  return static_cast<float>(top + std::log(sum));
}

void check_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "logits must be (R, V) fp32, contiguous, V > 0");
}

torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x);
  const int64_t R = x.size(0), V = x.size(1);
  auto best = torch::empty({R}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* bp = best.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) bp[n] = row_argmax(xp + n * V, V);
  });
  return best;
}

// log-normalisers of the listed rows (int64 indices, repeats allowed), in their order.
torch::Tensor logsumexp_rows(torch::Tensor x, torch::Tensor rows) {
  check_rows(x);
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1, "rows must be a 1-d int64 tensor");
  const int64_t R = x.size(0), V = x.size(1), n_rows = rows.size(0);
  auto index = rows.contiguous();
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_rows; ++i) TORCH_CHECK(0 <= ip[i] && ip[i] < R, "row ", ip[i], " out of range");
  auto lse = torch::empty({n_rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, n_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = xp + ip[i] * V;
      lp[i] = row_logsumexp(row, V, row_max(row, V));
    }
  });
  return lse;
}

#ifndef SPECTOT_STACK  // decoder_stack.cpp includes this file for its kernels, not its module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, bf16, row-wise fixed order");
  m.def("rope_store", &rope_store, "rotary q and k, k and v into the cache slots, q as (Hq, N, D)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up projection, bf16");
  m.def("argmax_rows", &argmax_rows, "per row of (R, V) fp32 logits: the argmax, lowest index among ties");
  m.def("logsumexp_rows", &logsumexp_rows, "log sum exp of the listed rows of (R, V) fp32 logits");
}
#endif
