// Every decoder layer of a forward in one call: the runner's layer loop (runner.py, ``_run``) in C++ over
// spectot's own kernels, for bf16 Llama-family layers on the CPU.
//
// Why: each layer of that loop is ~12 Python-level calls (norms, projections, rotary + KV write,
// attention, SwiGLU, residual adds), ~5 us each in dispatch before any arithmetic; over SmolLM2's 30
// layers that is milliseconds a forward, and nearly all of a one-layer draft's non-matmul time. Here the
// same kernels run in the same order on the same inputs (the residual adds round as torch's bf16 add does), so
// a forward's results equal the Python loop's bit for bit -- the tests hold the two paths to that.
// The kernels take raw rows here: every intermediate of a layer lives in one workspace allocated per forward,
// so a layer issues no torch op (each was ~1-2 us of dispatch, allocation and checks on the calling thread while
// the other threads waited: ~40 a layer). Session 42, 2-core Zen 3, SmolLM2 bf16 after 200 tokens, old and new
// loop alternating in one process, equal logits (scripts/stack_ab.py): 12.9 -> 11.4 ms a one-row forward, 16.8 -> 15.5 ms
// at 6 rows.
//
// The kernels' sources are compiled into this module, each in a namespace of its own (their helpers
// share names); SPECTOT_STACK leaves their Python modules out.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "vec.h"

#define SPECTOT_STACK
namespace linear_kernel {
#include "bf16_linear.cpp"
}
namespace attention_kernel {
#include "tree_attention.cpp"
}
namespace layer_ops {
#include "decoder_ops.cpp"
}

namespace {

using layer_ops::bits;  // a bf16 tensor's data as raw bits
using layer_ops::bits_mut;

struct Projection {  // a weight packed by bf16_linear's pack(), its bias in fp32 (or undefined), its widths
  torch::Tensor packed, bias;
  int64_t in_features, out_features;

  Projection(torch::Tensor w, const c10::optional<torch::Tensor>& b, int64_t in, int64_t out)
      : packed(std::move(w)), in_features(in), out_features(out) {
    linear_kernel::check_packed(packed, in, out);
    if (b.has_value() && b->defined()) bias = b->to(torch::kFloat32).contiguous();
    TORCH_CHECK(!bias.defined() || bias.numel() == out, "a bias needs one entry per output feature");
  }

  // y (rows x out) = x (rows x in) W^T + b
  void operator()(const uint16_t* x, int64_t rows, uint16_t* y, int64_t amx_rows) const {
    linear_kernel::linear_rows(x, rows, in_features, packed, bias.defined() ? bias.data_ptr<float>() : nullptr,
                               out_features, y, amx_rows);
  }

  torch::Tensor operator()(const torch::Tensor& x, int64_t amx_rows) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features && x.is_contiguous() && x.scalar_type() == torch::kBFloat16,
                "a projection's input must be (rows, in_features) contiguous bf16");
    auto y = torch::empty({x.size(0), out_features}, x.options());
    (*this)(bits(x), x.size(0), bits_mut(y), amx_rows);
    return y;
  }
};

struct Layer {
  torch::Tensor input_norm;
  double input_eps;
  Projection qkv, o;
  double scaling;
  torch::Tensor post_norm;
  double post_eps;
  Projection gate_up, down;
};

}  // namespace

// Forwards of at most this many rows (decoding steps: one row, a verified tree) prefetch each layer's KV lines; a
// prefill's attention is compute-bound and re-reads its keys from cache, and its rows' column lists grow with the
// prompt, so prefetching them would cost more than it hides.
constexpr int64_t PREFETCH_ROWS = 16;

class DecoderStack {
 public:
  DecoderStack(int64_t q_heads, int64_t kv_heads) : q_heads_(q_heads), kv_heads_(kv_heads) {
    TORCH_CHECK(kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0, q_heads,
                " query heads are not a positive multiple of ", kv_heads, " key-value heads");
  }

  void add_layer(torch::Tensor input_norm, double input_eps, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias,
                 int64_t qkv_out, torch::Tensor o, c10::optional<torch::Tensor> o_bias, int64_t o_out, double scaling,
                 torch::Tensor post_norm, double post_eps, torch::Tensor gate_up,
                 c10::optional<torch::Tensor> gate_up_bias, int64_t gate_up_out, torch::Tensor down,
                 c10::optional<torch::Tensor> down_bias, int64_t down_out) {
    TORCH_CHECK(input_norm.scalar_type() == torch::kBFloat16 && input_norm.is_contiguous() &&
                    post_norm.scalar_type() == torch::kBFloat16 && post_norm.is_contiguous() &&
                    post_norm.numel() == input_norm.numel(),
                "the norms must be contiguous bf16 vectors of the hidden size");
    const int64_t H = input_norm.numel(), D = qkv_out / (q_heads_ + 2 * kv_heads_);
    TORCH_CHECK(qkv_out == (q_heads_ + 2 * kv_heads_) * D && o_out == H && down_out == H && gate_up_out % 2 == 0,
                "layer widths do not fit ", q_heads_, " query and ", kv_heads_, " key-value heads over ", H, " features");
    TORCH_CHECK(D > 0 && D % 8 == 0, "the head dim must be a positive multiple of 8 (the attention's), got ", D);
    // forward sizes one workspace by the first layer: every layer must have its widths
    TORCH_CHECK(layers_.empty() || (H == layers_[0].input_norm.numel() && qkv_out == layers_[0].qkv.out_features &&
                                    gate_up_out == layers_[0].gate_up.out_features),
                "every layer must have the first layer's widths (hidden size, heads' width, intermediate size)");
    layers_.push_back(Layer{input_norm, input_eps, Projection(qkv, qkv_bias, H, qkv_out),
                            Projection(o, o_bias, q_heads_ * D, o_out), scaling, post_norm, post_eps,
                            Projection(gate_up, gate_up_bias, H, gate_up_out),
                            Projection(down, down_bias, gate_up_out / 2, down_out)});
  }

  // x (N, H) bf16: the rows' input vectors; cos, sin (N, D) at their positions; buffer (layers, capacity, 2,
  // H_kv, D): the KV cache, whose slots start .. start + N - 1 receive the rows' keys and values; columns and
  // row_ptr: each row's cache slots in attention order (tree_attention's layout). Returns [x after the last
  // layer, x after layer `hidden_after` (1-based; undefined for 0)]. amx_rows, tiles: the matmul's and the
  // attention's paths (as the runner passes them to each kernel).
  std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& buffer, int64_t start, const torch::Tensor& columns,
                                     const torch::Tensor& row_ptr, int64_t amx_rows, bool tiles,
                                     int64_t hidden_after) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be (N, H) bf16");
    TORCH_CHECK(x.device().is_cpu() && buffer.device().is_cpu(), "x and the cache must be on the CPU");
    TORCH_CHECK(buffer.dim() == 5 && buffer.size(0) == static_cast<int64_t>(layers_.size()) && buffer.size(2) == 2 &&
                    buffer.scalar_type() == torch::kBFloat16 && buffer.is_contiguous(),
                "buffer must be a contiguous bf16 (layers, capacity, 2, H_kv, D) with one entry per layer");
    const int64_t n = x.size(0), capacity = buffer.size(1);
    TORCH_CHECK(start >= 0 && start + n <= capacity, "the new slots lie outside the cache");
    if (layers_.empty() || n == 0) return {x, hidden_after ? x : torch::Tensor()};
    const int64_t H = layers_[0].input_norm.numel(), D = buffer.size(4);
    const int64_t qkv_out = layers_[0].qkv.out_features, I = layers_[0].gate_up.out_features / 2;
    TORCH_CHECK(x.size(1) == H && buffer.size(3) == kv_heads_ && qkv_out == (q_heads_ + 2 * kv_heads_) * D,
                "x, the cache and the layers disagree on the hidden size or the heads");
    const auto check_table = [&](const torch::Tensor& t) {
      TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.numel() == n * D,
                  "cos and sin must be contiguous bf16 (N, head_dim)");
    };
    check_table(cos);
    check_table(sin);
    TORCH_CHECK(columns.scalar_type() == torch::kInt64 && row_ptr.scalar_type() == torch::kInt64 &&
                    columns.dim() == 1 && columns.is_contiguous() && row_ptr.dim() == 1 && row_ptr.is_contiguous() &&
                    row_ptr.numel() == n + 1,
                "columns and row_ptr must be contiguous int64 CSR lists with N + 1 row pointers");
    const int64_t* cols = columns.data_ptr<int64_t>();
    const int64_t* rp = row_ptr.data_ptr<int64_t>();
    const int64_t max_len = attention_kernel::checked_max_len(rp, n, cols, columns.numel(), capacity);
    // the residual stream (returned; the input stays as it was) and every intermediate of a layer, allocated once
    // for all layers: each op writes raw rows, so a one-row layer runs no torch op at all
    torch::Tensor out = x.contiguous().clone(), hidden;
    const int64_t width = std::max<int64_t>(qkv_out, 2 * I);
    const auto work = torch::empty({n * (2 * H + width + 2 * q_heads_ * D + I)}, x.options());
    uint16_t* xp = bits_mut(out);
    uint16_t* h = bits_mut(work);  // n x H: a norm's output
    uint16_t* wide = h + n * H;  // n x width: qkv, then gate | up
    uint16_t* q = wide + n * width;  // Hq x n x D: rotated queries
    uint16_t* heads = q + q_heads_ * n * D;  // n x Hq D: attention's output rows
    uint16_t* act = heads + q_heads_ * n * D;  // n x I: silu(gate) * up
    uint16_t* proj = act + n * I;  // n x H: o's or down's output, added to the residual
    uint16_t* kv = bits_mut(buffer);
    const int64_t slot = 2 * kv_heads_ * D, layer_stride = capacity * slot;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      uint16_t* layer_kv = kv + static_cast<int64_t>(i) * layer_stride;
      if (n <= PREFETCH_ROWS) attention_kernel::prefetch_kv(layer_kv, n, kv_heads_, D, cols, rp);  // lands during qkv
      layer_ops::rms_norm_rows(xp, n, H, bits(layer.input_norm), layer.input_eps, h);
      layer.qkv(h, n, wide, amx_rows);
      layer_ops::rope_store_rows(wide, n, q_heads_, kv_heads_, D, bits(cos), bits(sin), q, layer_kv + start * slot);
      attention_kernel::attend_bf16_rows(q, q_heads_, n, D, layer_kv, kv_heads_, cols, rp, max_len, layer.scaling,
                                         tiles, heads);
      layer.o(heads, n, proj, amx_rows);
      layer_ops::add_rows(xp, proj, n * H);
      layer_ops::rms_norm_rows(xp, n, H, bits(layer.post_norm), layer.post_eps, h);
      layer.gate_up(h, n, wide, amx_rows);
      layer_ops::silu_mul_rows(wide, n, I, act);
      layer.down(act, n, proj, amx_rows);
      layer_ops::add_rows(xp, proj, n * H);
      if (static_cast<int64_t>(i) + 1 == hidden_after) hidden = out.clone();
    }
    return {out, hidden};
  }

  // The model's ends, for `chain` and `rows`: the token embedding table, the final norm and the head (packed).
  void set_ends(torch::Tensor embed, torch::Tensor norm, double eps, torch::Tensor head,
                c10::optional<torch::Tensor> head_bias, int64_t head_out) {
    ends_ = Ends{embed, norm, eps, Projection(head, head_bias, norm.numel(), head_out)};
  }

  // A chain draft (runner.py ``draft_chain``): the chain forward of x's rows (input vectors at positions first..,
  // slots start..; first = path's length), then depths - 1 one-row forwards, each of the token ranked first at
  // the depth before (``head_top``; noise: one row per depth); every row's key and value stay in its slot. The
  // same ops as the runner's Python steps (``forward`` then ``forward_kept``, softmax, topk) on the same inputs,
  // so the same bits. vocab (head rows,) int64: the token id of each head row (a draft decoder's head covers a
  // subset). Returns each depth's top k: [probabilities (depths, k) fp32, head rows (depths, k) int64, own
  // probabilities (depths, k) fp32].
  std::vector<torch::Tensor> chain(torch::Tensor x, int64_t depths, int64_t k, const torch::Tensor& cos_table,
                                   const torch::Tensor& sin_table, const torch::Tensor& buffer, int64_t start,
                                   const torch::Tensor& path, const torch::Tensor& vocab, int64_t amx_rows,
                                   bool batch_invariant, double temperature,
                                   const c10::optional<torch::Tensor>& noise) const {
    TORCH_CHECK(!noise.has_value() || !noise->defined() || noise->size(0) == depths, "one noise row per depth");
    TORCH_CHECK(depths >= 1 && x.dim() == 2 && x.size(0) >= 1, "a chain needs input rows and one depth or more");
    TORCH_CHECK(k >= 1, "k must be >= 1");
    const int64_t n = x.size(0), first = path.size(0), rows = n + depths - 1;
    TORCH_CHECK(first + rows <= cos_table.size(0), "the rotary table does not reach the chain's last position");
    // the slots every row may read, in path order: the stream's, then the chain's own
    const torch::Tensor slots =
        torch::cat({path.to(torch::kInt64), torch::arange(start, start + rows, path.options().dtype(torch::kInt64))});
    // the first forward's rows: row i reads the path and the chain's first i + 1 slots (tree_attention's CSR)
    std::vector<int64_t> offsets(n + 1, 0);
    for (int64_t i = 0; i < n; ++i) offsets[i + 1] = offsets[i] + first + i + 1;
    torch::Tensor columns = torch::empty({offsets[n]}, slots.options());
    for (int64_t i = 0; i < n; ++i) columns.narrow(0, offsets[i], first + i + 1).copy_(slots.narrow(0, 0, first + i + 1));
    torch::Tensor row_ptr = torch::from_blob(offsets.data(), {n + 1}, torch::kInt64).clone();
    auto probs = torch::empty({depths, k}, torch::kFloat32);
    auto indices = torch::empty({depths, k}, torch::kInt64);
    auto owns = torch::empty({depths, k}, torch::kFloat32);
    int64_t position = first, slot = start;
    for (int64_t d = 0; d < depths; ++d) {
      const int64_t m = x.size(0);
      const torch::Tensor last = forward(x, cos_table.narrow(0, position, m), sin_table.narrow(0, position, m), buffer,
                                         slot, columns, row_ptr, amx_rows, batch_invariant || m > 1, 0)[0];
      const c10::optional<torch::Tensor> e =
          noise.has_value() && noise->defined() ? c10::optional<torch::Tensor>(noise->select(0, d)) : c10::nullopt;
      const auto top = head_top(last.narrow(0, m - 1, 1), k, amx_rows, temperature, e);
      probs[d] = std::get<0>(top)[0];
      indices[d] = std::get<1>(top)[0];
      owns[d] = std::get<2>(top)[0];
      position += m;
      slot += m;
      if (d + 1 == depths) break;
      x = ends_->embed.index_select(0, vocab.index_select(0, std::get<1>(top)[0].narrow(0, 0, 1)));
      columns = slots.narrow(0, 0, position + 1);
      row_ptr = torch::tensor({int64_t{0}, position + 1}, torch::kInt64);
    }
    return {probs, indices, owns};
  }

  // Rows of draft-tree nodes (runner.py ``draft_rows``): row r, input vector x[r] at position positions[r], writes
  // slot start + r and reads the path's slots, then tails[tail_ptr[r] : tail_ptr[r + 1]] (its ancestors' slots,
  // root first, then its own). Returns each row's top k (``head_top``): [probabilities, head rows, own
  // probabilities], each (R, k).
  std::vector<torch::Tensor> rows(const torch::Tensor& x, const torch::Tensor& positions, int64_t k,
                                  const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                                  const torch::Tensor& buffer, int64_t start, const torch::Tensor& path,
                                  const torch::Tensor& tails, const torch::Tensor& tail_ptr, int64_t amx_rows,
                                  bool batch_invariant, double temperature,
                                  const c10::optional<torch::Tensor>& noise) const {
    const int64_t n = x.size(0), first = path.size(0);
    TORCH_CHECK(n >= 1 && positions.size(0) == n && tail_ptr.size(0) == n + 1, "one position and tail per row");
    TORCH_CHECK(k >= 1, "k must be >= 1");
    TORCH_CHECK(path.scalar_type() == torch::kInt64 && tails.scalar_type() == torch::kInt64 &&
                    tail_ptr.scalar_type() == torch::kInt64 && path.is_contiguous() && tails.is_contiguous() &&
                    tail_ptr.is_contiguous(),
                "path, tails and tail_ptr must be contiguous int64");
    const int64_t* tp = tail_ptr.data_ptr<int64_t>();
    TORCH_CHECK(tp[0] == 0 && tp[n] == tails.numel(), "tail_ptr must run from 0 to the number of tails");
    for (int64_t r = 0; r < n; ++r) TORCH_CHECK(tp[r] <= tp[r + 1], "tail_ptr must not decrease");
    const int64_t* tail = tails.data_ptr<int64_t>();
    const int64_t* old = path.data_ptr<int64_t>();
    std::vector<int64_t> offsets(n + 1, 0), columns;
    columns.reserve(n * first + tails.size(0));
    for (int64_t r = 0; r < n; ++r) {
      columns.insert(columns.end(), old, old + first);
      columns.insert(columns.end(), tail + tp[r], tail + tp[r + 1]);
      offsets[r + 1] = static_cast<int64_t>(columns.size());
    }
    const auto cols = torch::from_blob(columns.data(), {offsets[n]}, torch::kInt64);
    const auto row_ptr = torch::from_blob(offsets.data(), {n + 1}, torch::kInt64);
    const torch::Tensor last = forward(x, cos_table.index_select(0, positions), sin_table.index_select(0, positions),
                                       buffer, start, cols, row_ptr, amx_rows, batch_invariant || n > 1, 0)[0];
    const auto top = head_top(last, k, amx_rows, temperature, noise);
    return {std::get<0>(top), std::get<1>(top), std::get<2>(top)};
  }

 private:
  // The top k of q = softmax(logits / temperature) of the head at rows h (the final norm first): (probabilities,
  // head rows, own probabilities), each (rows, k), largest first. With noise (head rows,) double, E at the
  // children's position, each row's guess argmax_i q_i / E_i goes first and its other top rows follow in order (the
  // probabilities stay the sorted values; the own ones are each picked row's q): proposers/draft_decoder.py's
  // ``_coupled_first``, in the same ops.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> head_top(const torch::Tensor& h, int64_t k, int64_t amx_rows,
                                                    double temperature,
                                                    const c10::optional<torch::Tensor>& noise) const {
    TORCH_CHECK(ends_.has_value(), "set_ends() before drafting");
    const Ends& ends = *ends_;
    const torch::Tensor normed = layer_ops::rms_norm(h.contiguous(), ends.norm, ends.eps);
    const torch::Tensor q = ends.head(normed, amx_rows).to(torch::kFloat32).div(temperature).softmax(-1);
    auto top = q.topk(k, -1);
    if (!noise.has_value() || !noise->defined()) return {std::get<0>(top), std::get<1>(top), std::get<0>(top)};
    const auto guess = q.to(torch::kDouble).div(*noise).argmax(-1);  // (rows,)
    auto picks = std::get<1>(top).clone();
    const int64_t* g = guess.data_ptr<int64_t>();
    const int64_t* old = std::get<1>(top).data_ptr<int64_t>();
    int64_t* out = picks.data_ptr<int64_t>();
    for (int64_t r = 0; r < picks.size(0); ++r) {
      out[r * k] = g[r];
      for (int64_t i = 0, j = 1; i < k && j < k; ++i)
        if (old[r * k + i] != g[r]) out[r * k + j++] = old[r * k + i];
    }
    return {std::get<0>(top), picks, q.gather(-1, picks)};
  }

  struct Ends {
    torch::Tensor embed, norm;
    double eps;
    Projection head;
  };
  int64_t q_heads_, kv_heads_;
  std::vector<Layer> layers_;
  c10::optional<Ends> ends_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t>(), py::arg("q_heads"), py::arg("kv_heads"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("buffer"),
           py::arg("start"), py::arg("columns"), py::arg("row_ptr"), py::arg("amx_rows"), py::arg("tiles"),
           py::arg("hidden_after"))
      .def("set_ends", &DecoderStack::set_ends)
      .def("chain", &DecoderStack::chain, py::arg("x"), py::arg("depths"), py::arg("k"), py::arg("cos_table"),
           py::arg("sin_table"), py::arg("buffer"), py::arg("start"), py::arg("path"), py::arg("vocab"),
           py::arg("amx_rows"), py::arg("batch_invariant"), py::arg("temperature"), py::arg("noise"))
      .def("rows", &DecoderStack::rows, py::arg("x"), py::arg("positions"), py::arg("k"), py::arg("cos_table"),
           py::arg("sin_table"), py::arg("buffer"), py::arg("start"), py::arg("path"), py::arg("tails"),
           py::arg("tail_ptr"), py::arg("amx_rows"), py::arg("batch_invariant"), py::arg("temperature"),
           py::arg("noise"));
}
