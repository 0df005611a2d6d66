// Batch-invariant bf16 linear for CPUs without native bf16 (AVX2 + FMA).
//
// y[r, j] = sum_k x[r, k] * W[j, k] (+ b[j]), bf16 in, fp32 accumulate, bf16 out.
//
// Why: on AVX2-only CPUs the library bf16 GEMM converts weights again for every input row, so a
// forward over n tree tokens costs ~n times one token. Here each 8-wide block of a weight row is
// converted once and multiplied into up to ROWS input rows held in registers, so extra rows cost
// FMAs, not memory traffic. Every output element is accumulated in the same order whatever the
// number of rows (8 lanes over k = lane mod 8, then a fixed horizontal sum), so a row's result does
// not depend on the batch it is in: a tree forward reproduces the AR step bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int ROWS = 8;  // input rows per register block: 8 accumulators + weights + temps fit in 16 ymm

inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {  // fixed order: (lo + hi), then pairwise
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

template <int R>
void block(const float* x, int64_t K, const uint16_t* w, float* out) {
  // out[r] = dot(x[r, :], w[:]) for R rows; K is a multiple of 8
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv = load_bf16x8(w + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

void dot_rows(const float* x, int64_t rows, int64_t K, const uint16_t* w, float* out) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) block<ROWS>(x + r * K, K, w, out + r);
  switch (rows - r) {
    case 7: block<7>(x + r * K, K, w, out + r); break;
    case 6: block<6>(x + r * K, K, w, out + r); break;
    case 5: block<5>(x + r * K, K, w, out + r); break;
    case 4: block<4>(x + r * K, K, w, out + r); break;
    case 3: block<3>(x + r * K, K, w, out + r); break;
    case 2: block<2>(x + r * K, K, w, out + r); break;
    case 1: block<1>(x + r * K, K, w, out + r); break;
    default: break;
  }
}

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16, "bf16 tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight (N, K) contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 8 == 0, "in_features must be a multiple of 8");
  TORCH_CHECK(x.size(-1) == K, "x last dim must equal in_features");
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto x2 = x.reshape({-1, K}).to(torch::kFloat32).contiguous();  // (rows, K) fp32: exact upcast
  const int64_t rows = x2.size(0);
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x2.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    auto b = bias->to(torch::kFloat32).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  }
  // split output features across threads; each output element is computed by one thread, in one order
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> col(rows);
    for (int64_t j = begin; j < end; ++j) {
      dot_rows(xp, rows, K, wp + j * K, col.data());
      const float b = bias_f.empty() ? 0.f : bias_f[j];
      for (int64_t r = 0; r < rows; ++r) yp[r * N + j] = to_bf16(col[r] + b);
    }
  });
  return y.view(out_shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bf16_linear", &bf16_linear, "batch-invariant bf16 linear (AVX2)"); }
