// The softmax (InfoNCE / CLIP) loss's native ops (contract: infcl/contract.py; design:
// docs/kernels.md, "Native CPU kernel"): each checks its inputs, lays them out as the kernel reads them
// (prepared()) and calls softmax_forward.cpp's or softmax_backward.cpp's entry point.
//
//   forward_block(q [Bq,D], k [Bk,D], scale, pos [Bq], symmetric) -> (rows [3,Bq], cols [2,Bk] or [2,0])
//   backward_block(q, k, scale, pos, row_stats [2,Bq], g_row [Bq], col_stats? [2,Bk], g_col? [Bk], dq!, dk!)
//       -> dscale [2] (row part, column part)
//   masked_forward_block(q, k, scale, pos, symmetric, multi_positive?, q_ids? [Bq], k_ids? [Bk],
//       guide_q? [Bq,D'], guide_k? [Bk,D'], row_threshold? [Bq], col_threshold? [Bk], kept_sums=False)
//       -> (rows [6,Bq], cols [6,Bk] or [6,0]; kept_sums: [8, .], the kept logits' sum and number)
//   masked_backward_block(q, k, scale, pos, row_stats, g_row, col_stats?, g_col?, multi_positive?, q_ids?,
//       k_ids?, guide_q?, guide_k?, row_threshold?, col_threshold?, row_pos_count? [Bq], row_pos_stats? [2,Bq],
//       col_pos_count? [Bk], col_pos_stats? [2,Bk], dq!, dk!, row_uniform? [Bq], col_uniform? [Bk])
//       -> dscale [2]; row_uniform / col_uniform: label smoothing's weights, subtracted from dS on the kept
//       entries of each row (column)
//   guide_label_scores(guide_q [Bq,D'], guide_k [Bk,D'], pos [Bq]) -> [Bq] G[i, pos[i]] off the masked
//       ops' own guide tiles (0 where pos[i] < 0): the guide thresholds' scores
//
// Stats are (running max m, r = log sum exp(S - m)); rows[2] is S at each row's positive column pos[i]
// (-1: elsewhere; then 0). The backward forms dS = g_row (P_row - Y) + g_col (P_col - Y) in the tile,
// P = exp((S - m) - r), and dscale as sums of per-entry dS * raw.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "matryoshka.h"
#include "softmax.h"

namespace infcl {
namespace softmax {
namespace {

void check_features(const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "infcl native: q and k must be CPU tensors");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2, "infcl native: q and k must be 2-d, got ", q.sizes(), " and ",
              k.sizes());
  TORCH_CHECK(q.size(1) == k.size(1), "infcl native: q ", q.sizes(), " and k ", k.sizes(), " differ in D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "infcl native: q and k dtypes differ");
  const auto t = q.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf,
              "infcl native: unsupported dtype ", t);
}

// pos: [Bq] int64, each a column of the block or -1.
at::Tensor positions(const at::Tensor& pos, int64_t bq, int64_t bk) {
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == bq && pos.scalar_type() == at::kLong,
              "infcl native: pos must be int64 of shape [", bq, "], got ", pos.scalar_type(), " ", pos.sizes());
  at::Tensor p = pos.contiguous();
  if (bq > 0) {
    TORCH_CHECK(p.min().item<int64_t>() >= -1 && p.max().item<int64_t>() < bk,
                "infcl native: pos must lie in [-1, ", bk, ")");
  }
  return p;
}

// t as the kernel reads it: contiguous; bfloat16 as is on a bf16 GEMM route (common.h's bf16_route), in
// rows of bf16_row_length; float16 (fp16 dS would underflow) and bfloat16 off a route as float32 copies,
// which are exact.
at::Tensor prepared(const at::Tensor& t, Bf16Gemm route) {
  if (route != Bf16Gemm::None) return with_row_length(t, bf16_row_length(route, t.size(1)));
  const auto type = t.scalar_type();
  return t.to(type == at::kHalf || type == at::kBFloat16 ? at::kFloat : type).contiguous();
}

at::Tensor stats_arg(const at::Tensor& t, std::vector<int64_t> shape, at::ScalarType acc, const char* name) {
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "infcl native: ", name, " must have shape ",
              at::IntArrayRef(shape), ", got ", t.sizes());
  return t.to(acc).contiguous();
}

// The masked ops' extra inputs, checked and made contiguous; `args` points into the tensors held here.
struct MaskInputs {
  at::Tensor q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold;
  MaskArgs args;
};

Positives positives_of(const std::optional<c10::string_view>& multi_positive) {
  if (!multi_positive.has_value()) return Positives::Label;
  if (*multi_positive == "mean") return Positives::Mean;
  if (*multi_positive == "sum") return Positives::Sum;
  TORCH_CHECK(false, "infcl native: multi_positive must be None, 'mean' or 'sum', got '", std::string(*multi_positive),
              "'");
}

at::Tensor ids_arg(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kLong, "infcl native: ",
              name, " must be a CPU int64 tensor of shape [", n, "], got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

// symmetric: the column direction is wanted, so a guide needs the columns' thresholds too.
std::unique_ptr<MaskInputs> mask_inputs(int64_t bq, int64_t bk, bool symmetric,
                                        const std::optional<c10::string_view>& multi_positive,
                                        const std::optional<at::Tensor>& q_ids, const std::optional<at::Tensor>& k_ids,
                                        const std::optional<at::Tensor>& guide_q,
                                        const std::optional<at::Tensor>& guide_k,
                                        const std::optional<at::Tensor>& row_threshold,
                                        const std::optional<at::Tensor>& col_threshold) {
  auto m = std::make_unique<MaskInputs>();
  m->args.positives = positives_of(multi_positive);
  TORCH_CHECK(q_ids.has_value() == k_ids.has_value(), "infcl native: q_ids and k_ids go together");
  TORCH_CHECK(m->args.positives == Positives::Label || q_ids.has_value(),
              "infcl native: multi_positive needs q_ids and k_ids");
  if (q_ids.has_value()) {
    m->q_ids = ids_arg(*q_ids, bq, "q_ids");
    m->k_ids = ids_arg(*k_ids, bk, "k_ids");
    m->args.q_ids = m->q_ids.data_ptr<int64_t>();
    m->args.k_ids = m->k_ids.data_ptr<int64_t>();
  }
  TORCH_CHECK(guide_q.has_value() == guide_k.has_value(), "infcl native: guide_q and guide_k go together");
  if (!guide_q.has_value()) return m;
  const auto gt = guide_q->scalar_type();
  TORCH_CHECK((gt == at::kFloat || gt == at::kDouble) && guide_k->scalar_type() == gt,
              "infcl native: guide_q and guide_k must be both float32 or both float64, got ", gt, " and ",
              guide_k->scalar_type());
  TORCH_CHECK(guide_q->device().is_cpu() && guide_k->device().is_cpu() && guide_q->dim() == 2 &&
                  guide_k->dim() == 2 && guide_q->size(0) == bq && guide_k->size(0) == bk &&
                  guide_q->size(1) == guide_k->size(1),
              "infcl native: guide_q ", guide_q->sizes(), " and guide_k ", guide_k->sizes(), " must be CPU [", bq,
              ", D'] and [", bk, ", D']");
  TORCH_CHECK(row_threshold.has_value(), "infcl native: a guide needs row_threshold");
  TORCH_CHECK(!symmetric || col_threshold.has_value(), "infcl native: a symmetric guide needs col_threshold");
  m->guide_q = guide_q->contiguous();
  m->guide_k = guide_k->contiguous();
  // The thresholds are compared in the guide's dtype, as the scores are formed.
  m->row_threshold = stats_arg(*row_threshold, {bq}, gt, "row_threshold");
  if (symmetric) m->col_threshold = stats_arg(*col_threshold, {bk}, gt, "col_threshold");
  m->args.guide_q = m->guide_q.data_ptr();
  m->args.guide_k = m->guide_k.data_ptr();
  m->args.row_threshold = m->row_threshold.data_ptr();
  m->args.col_threshold = symmetric ? m->col_threshold.data_ptr() : nullptr;
  m->args.guide_dim = m->guide_q.size(1);
  m->args.guide_f64 = gt == at::kDouble;
  return m;
}

// Both forward ops: the plain loss (masks null) or the masked one.
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& q_in, const at::Tensor& k_in, double scale,
                                               const at::Tensor& pos_in, bool symmetric, const MaskArgs* masks,
                                               bool kept_sums = false) {
  check_features(q_in, k_in);
  const auto acc = accumulation_type(q_in.scalar_type());
  const Bf16Gemm route = bf16_route(q_in);
  at::Tensor q = prepared(q_in, route), k = prepared(k_in, route);
  at::Tensor pos = positions(pos_in, q.size(0), k.size(0));
  const bool brgemm = route == Bf16Gemm::Brgemm;
  const int64_t masked_rows = kept_sums ? KEPT_ROWS : MASKED_ROWS;
  at::Tensor rows = at::empty({masks ? masked_rows : 3, q.size(0)}, q_in.options().dtype(acc));
  at::Tensor cols = at::empty({masks ? masked_rows : 2, symmetric ? k.size(0) : 0}, q_in.options().dtype(acc));
  forward(q, k, scale, pos, symmetric, masks, kept_sums, brgemm, rows, cols);
  return {rows, cols};
}

std::tuple<at::Tensor, at::Tensor> forward_block(const at::Tensor& q, const at::Tensor& k, double scale,
                                                 const at::Tensor& pos, bool symmetric) {
  return run_forward(q, k, scale, pos, symmetric, nullptr);
}

std::tuple<at::Tensor, at::Tensor> masked_forward_block(
    const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
    const std::optional<c10::string_view> multi_positive, const std::optional<at::Tensor>& q_ids,
    const std::optional<at::Tensor>& k_ids, const std::optional<at::Tensor>& guide_q,
    const std::optional<at::Tensor>& guide_k, const std::optional<at::Tensor>& row_threshold,
    const std::optional<at::Tensor>& col_threshold, bool kept_sums) {
  const auto masks = mask_inputs(q.size(0), k.size(0), symmetric, multi_positive, q_ids, k_ids, guide_q, guide_k,
                                 row_threshold, col_threshold);
  return run_forward(q, k, scale, pos, symmetric, &masks->args, kept_sums);
}

PositiveInputs positive_inputs(Positives kind, const std::optional<at::Tensor>& count,
                               const std::optional<at::Tensor>& stats, int64_t n, at::ScalarType acc,
                               const char* count_name, const char* stats_name) {
  PositiveInputs out;
  if (kind == Positives::Mean) {
    TORCH_CHECK(count.has_value(), "infcl native: multi_positive='mean' needs ", count_name);
    out.count = stats_arg(*count, {n}, acc, count_name);
  } else if (kind == Positives::Sum) {
    TORCH_CHECK(stats.has_value(), "infcl native: multi_positive='sum' needs ", stats_name);
    out.stats = stats_arg(*stats, {2, n}, acc, stats_name);
  }
  return out;
}

// Both backward ops: the plain loss (masks null) or the masked one (with each side's positives).
at::Tensor run_backward(const at::Tensor& q_in, const at::Tensor& k_in, double scale, const at::Tensor& pos_in,
                        const at::Tensor& row_stats, const at::Tensor& g_row,
                        const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
                        at::Tensor& dq, at::Tensor& dk, const MaskArgs* masks, const PositiveInputs& row_pos,
                        const PositiveInputs& col_pos, const std::optional<at::Tensor>& row_uniform = std::nullopt,
                        const std::optional<at::Tensor>& col_uniform = std::nullopt) {
  check_features(q_in, k_in);
  const auto acc = accumulation_type(q_in.scalar_type());
  const int64_t bq = q_in.size(0), bk = k_in.size(0);
  TORCH_CHECK(col_stats.has_value() == g_col.has_value(), "infcl native: col_stats and g_col go together");
  ContiguousGrads grads(dq, dk, q_in, k_in, acc, "infcl native");
  const Bf16Gemm route = bf16_route(q_in);
  const bool brgemm = route == Bf16Gemm::Brgemm;
  at::Tensor q = prepared(q_in, route), k = prepared(k_in, route);
  at::Tensor pos = positions(pos_in, bq, bk);
  at::Tensor rs = stats_arg(row_stats, {2, bq}, acc, "row_stats"), gr = stats_arg(g_row, {bq}, acc, "g_row");
  at::Tensor cs, gc;
  if (col_stats.has_value()) {
    cs = stats_arg(*col_stats, {2, bk}, acc, "col_stats");
    gc = stats_arg(*g_col, {bk}, acc, "g_col");
  }
  // Label smoothing's uniform weights: for both directions the loss has, or none.
  TORCH_CHECK(!col_uniform.has_value() || row_uniform.has_value(), "infcl native: col_uniform needs row_uniform");
  TORCH_CHECK(!row_uniform.has_value() || col_uniform.has_value() == col_stats.has_value(),
              "infcl native: a symmetric backward with row_uniform needs col_uniform, one direction none");
  at::Tensor ru, cu;
  if (row_uniform.has_value()) ru = stats_arg(*row_uniform, {bq}, acc, "row_uniform");
  if (col_uniform.has_value()) cu = stats_arg(*col_uniform, {bk}, acc, "col_uniform");
  at::Tensor dscale = at::zeros({2}, at::TensorOptions().dtype(at::kDouble));
  backward(q, k, scale, pos, rs, gr, cs, gc, grads.dq, grads.dk, dscale, brgemm, masks, row_pos, col_pos, ru, cu);
  grads.write_back();
  return dscale.to(acc);
}

at::Tensor backward_block(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                          const at::Tensor& row_stats, const at::Tensor& g_row,
                          const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
                          at::Tensor& dq, at::Tensor& dk) {
  return run_backward(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk, nullptr, {}, {});
}

at::Tensor masked_backward_block(
    const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, const at::Tensor& row_stats,
    const at::Tensor& g_row, const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
    const std::optional<c10::string_view> multi_positive, const std::optional<at::Tensor>& q_ids,
    const std::optional<at::Tensor>& k_ids, const std::optional<at::Tensor>& guide_q,
    const std::optional<at::Tensor>& guide_k, const std::optional<at::Tensor>& row_threshold,
    const std::optional<at::Tensor>& col_threshold, const std::optional<at::Tensor>& row_pos_count,
    const std::optional<at::Tensor>& row_pos_stats, const std::optional<at::Tensor>& col_pos_count,
    const std::optional<at::Tensor>& col_pos_stats, at::Tensor& dq, at::Tensor& dk,
    const std::optional<at::Tensor>& row_uniform, const std::optional<at::Tensor>& col_uniform) {
  const bool symmetric = col_stats.has_value();
  const int64_t bq = q.size(0), bk = k.size(0);
  const auto masks = mask_inputs(bq, bk, symmetric, multi_positive, q_ids, k_ids, guide_q, guide_k, row_threshold,
                                 col_threshold);
  const auto acc = accumulation_type(q.scalar_type());
  const auto kind = masks->args.positives;
  const PositiveInputs row_pos =
      positive_inputs(kind, row_pos_count, row_pos_stats, bq, acc, "row_pos_count", "row_pos_stats");
  const PositiveInputs col_pos = symmetric ? positive_inputs(kind, col_pos_count, col_pos_stats, bk, acc,
                                                             "col_pos_count", "col_pos_stats")
                                           : PositiveInputs{};
  return run_backward(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk, &masks->args, row_pos, col_pos,
                      row_uniform, col_uniform);
}

// The Matryoshka ops' prefixes: dims increasing in [1, d], one renormalize flag each.
Prefixes prefixes_arg(at::IntArrayRef dims, const c10::List<bool>& renormalize, int64_t d) {
  TORCH_CHECK(!dims.empty() && dims.size() == renormalize.size(), "infcl native: matryoshka needs one renormalize ",
              "flag per dim and at least one dim, got dims ", dims, " and ", renormalize.size(), " flags");
  Prefixes p;
  for (size_t k = 0; k < dims.size(); ++k) {
    TORCH_CHECK(dims[k] > (k ? dims[k - 1] : 0) && dims[k] <= d, "infcl native: matryoshka dims must increase ",
                "within [1, ", d, "], got ", dims);
    p.dims.push_back(dims[k]);
    p.renormalize.push_back(renormalize.get(k));
  }
  return p;
}

// x's per-prefix factors ([2, K, n], matryoshka.h): each row's norms from running sums of squares over the
// segments, in double, rounded once into x's dtype.
template <typename T>
at::Tensor prefix_factors(const at::Tensor& x, const Prefixes& p) {
  const int64_t n = x.size(0), d = x.size(1), count = p.count();
  at::Tensor out = at::empty({FACTOR_ROWS, count, n}, x.options());
  const T* data = x.data_ptr<T>();
  T* a = out.data_ptr<T>();
  T* weight = a + count * n;
  at::parallel_for(0, n, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      double squares = 0.0;
      for (int64_t k = 0; k < count; ++k) {
        const T* seg = data + i * d + p.begin(k);
        double part = 0.0;
#pragma omp simd reduction(+ : part)
        for (int64_t e = 0; e < p.width(k); ++e) part += static_cast<double>(seg[e]) * seg[e];
        squares += part;
        const double norm = std::sqrt(squares);
        const bool clamped = !(norm >= NORM_EPS);  // a NaN norm is not clamped: NaN in, NaN out
        const T factor = static_cast<T>(1.0 / (clamped ? NORM_EPS : norm));
        a[k * n + i] = p.renormalize[k] ? factor : T(1);
        weight[k * n + i] = p.renormalize[k] && !clamped ? factor * factor : T(0);
      }
    }
  });
  return out;
}

at::Tensor factors_of(const at::Tensor& x, const Prefixes& p) {
  return x.scalar_type() == at::kDouble ? prefix_factors<double>(x, p) : prefix_factors<float>(x, p);
}

// matryoshka_forward_block(q, k, scale, pos, symmetric, dims, renormalize) -> (rows [3, K, Bq], cols [2, K, Bk]
// or [2, K, 0]): every prefix's stats and positive logit, as forward_block's per prefix. float16 and
// bfloat16 run on exact float32 copies. masks (masked_matryoshka_forward_block): rows [6, K, Bq] and cols
// [6, K, Bk], masked_forward_block's rows per prefix.
std::tuple<at::Tensor, at::Tensor> run_matryoshka_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                          double scale, const at::Tensor& pos_in, bool symmetric,
                                                          at::IntArrayRef dims, const c10::List<bool>& renormalize,
                                                          const MaskArgs* masks) {
  check_features(q_in, k_in);
  const Prefixes p = prefixes_arg(dims, renormalize, q_in.size(1));
  at::Tensor q = prepared(q_in, Bf16Gemm::None), k = prepared(k_in, Bf16Gemm::None);
  at::Tensor pos = positions(pos_in, q.size(0), k.size(0));
  const int64_t count = p.count();
  at::Tensor rows = at::empty({count, masks ? MASKED_ROWS : 3, q.size(0)}, q.options());
  at::Tensor cols = at::empty({count, masks ? MASKED_ROWS : 2, symmetric ? k.size(0) : 0}, q.options());
  matryoshka_forward(q, k, scale, pos, symmetric, p, factors_of(q, p), factors_of(k, p), masks, rows, cols);
  return {rows.transpose(0, 1).contiguous(), cols.transpose(0, 1).contiguous()};
}

std::tuple<at::Tensor, at::Tensor> matryoshka_forward_block(const at::Tensor& q, const at::Tensor& k, double scale,
                                                            const at::Tensor& pos, bool symmetric,
                                                            at::IntArrayRef dims, c10::List<bool> renormalize) {
  return run_matryoshka_forward(q, k, scale, pos, symmetric, dims, renormalize, nullptr);
}

std::tuple<at::Tensor, at::Tensor> masked_matryoshka_forward_block(
    const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
    at::IntArrayRef dims, c10::List<bool> renormalize, const std::optional<c10::string_view> multi_positive,
    const std::optional<at::Tensor>& q_ids, const std::optional<at::Tensor>& k_ids,
    const std::optional<at::Tensor>& guide_q, const std::optional<at::Tensor>& guide_k,
    const std::optional<at::Tensor>& row_threshold, const std::optional<at::Tensor>& col_threshold) {
  const auto masks = mask_inputs(q.size(0), k.size(0), symmetric, multi_positive, q_ids, k_ids, guide_q, guide_k,
                                 row_threshold, col_threshold);
  return run_matryoshka_forward(q, k, scale, pos, symmetric, dims, renormalize, &masks->args);
}

// A masked Matryoshka backward's positives of one side: every prefix's count [K, n] ("mean") or stats [2, K, n].
PositiveInputs prefix_positive_inputs(Positives kind, const std::optional<at::Tensor>& count,
                                      const std::optional<at::Tensor>& stats, int64_t prefixes, int64_t n,
                                      at::ScalarType acc, const char* count_name, const char* stats_name) {
  PositiveInputs out;
  if (kind == Positives::Mean) {
    TORCH_CHECK(count.has_value(), "infcl native: multi_positive='mean' needs ", count_name);
    out.count = stats_arg(*count, {prefixes, n}, acc, count_name);
  } else if (kind == Positives::Sum) {
    TORCH_CHECK(stats.has_value(), "infcl native: multi_positive='sum' needs ", stats_name);
    out.stats = stats_arg(*stats, {2, prefixes, n}, acc, stats_name);
  }
  return out;
}

// matryoshka_backward_block(q, k, scale, pos, dims, renormalize, row_stats [2, K, Bq], g_row [K, Bq],
// col_stats? [2, K, Bk], g_col? [K, Bk], dq!, dk!) -> dscale [2]: backward_block's, summed over the prefixes.
// masked_matryoshka_backward_block: masked_backward_block's likewise, the positives per prefix ([K, n] counts,
// [2, K, n] stats).
at::Tensor run_matryoshka_backward(const at::Tensor& q_in, const at::Tensor& k_in, double scale,
                                   const at::Tensor& pos_in, at::IntArrayRef dims, const c10::List<bool>& renormalize,
                                   const at::Tensor& row_stats, const at::Tensor& g_row,
                                   const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
                                   at::Tensor& dq, at::Tensor& dk, const MaskArgs* masks,
                                   const PositiveInputs& row_pos, const PositiveInputs& col_pos) {
  check_features(q_in, k_in);
  const Prefixes p = prefixes_arg(dims, renormalize, q_in.size(1));
  const auto acc = accumulation_type(q_in.scalar_type());
  const int64_t bq = q_in.size(0), bk = k_in.size(0), count = p.count();
  TORCH_CHECK(col_stats.has_value() == g_col.has_value(), "infcl native: col_stats and g_col go together");
  ContiguousGrads grads(dq, dk, q_in, k_in, acc, "infcl native");
  at::Tensor q = prepared(q_in, Bf16Gemm::None), k = prepared(k_in, Bf16Gemm::None);
  at::Tensor pos = positions(pos_in, bq, bk);
  at::Tensor rs = stats_arg(row_stats, {2, count, bq}, acc, "row_stats");
  at::Tensor gr = stats_arg(g_row, {count, bq}, acc, "g_row");
  at::Tensor cs, gc;
  if (col_stats.has_value()) {
    cs = stats_arg(*col_stats, {2, count, bk}, acc, "col_stats");
    gc = stats_arg(*g_col, {count, bk}, acc, "g_col");
  }
  at::Tensor dscale = at::zeros({2}, at::TensorOptions().dtype(at::kDouble));
  matryoshka_backward(q, k, scale, pos, p, factors_of(q, p), factors_of(k, p), rs, gr, cs, gc, masks, row_pos, col_pos,
                      grads.dq, grads.dk, dscale);
  grads.write_back();
  return dscale.to(acc);
}

at::Tensor matryoshka_backward_block(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                                     at::IntArrayRef dims, c10::List<bool> renormalize, const at::Tensor& row_stats,
                                     const at::Tensor& g_row, const std::optional<at::Tensor>& col_stats,
                                     const std::optional<at::Tensor>& g_col, at::Tensor& dq, at::Tensor& dk) {
  return run_matryoshka_backward(q, k, scale, pos, dims, renormalize, row_stats, g_row, col_stats, g_col, dq, dk,
                                 nullptr, {}, {});
}

at::Tensor masked_matryoshka_backward_block(
    const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, at::IntArrayRef dims,
    c10::List<bool> renormalize, const at::Tensor& row_stats, const at::Tensor& g_row,
    const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
    const std::optional<c10::string_view> multi_positive, const std::optional<at::Tensor>& q_ids,
    const std::optional<at::Tensor>& k_ids, const std::optional<at::Tensor>& guide_q,
    const std::optional<at::Tensor>& guide_k, const std::optional<at::Tensor>& row_threshold,
    const std::optional<at::Tensor>& col_threshold, const std::optional<at::Tensor>& row_pos_count,
    const std::optional<at::Tensor>& row_pos_stats, const std::optional<at::Tensor>& col_pos_count,
    const std::optional<at::Tensor>& col_pos_stats, at::Tensor& dq, at::Tensor& dk) {
  const bool symmetric = col_stats.has_value();
  const int64_t bq = q.size(0), bk = k.size(0), count = static_cast<int64_t>(dims.size());
  const auto masks = mask_inputs(bq, bk, symmetric, multi_positive, q_ids, k_ids, guide_q, guide_k, row_threshold,
                                 col_threshold);
  const auto acc = accumulation_type(q.scalar_type());
  const auto kind = masks->args.positives;
  const PositiveInputs row_pos = prefix_positive_inputs(kind, row_pos_count, row_pos_stats, count, bq, acc,
                                                        "row_pos_count", "row_pos_stats");
  const PositiveInputs col_pos = symmetric ? prefix_positive_inputs(kind, col_pos_count, col_pos_stats, count, bk,
                                                                    acc, "col_pos_count", "col_pos_stats")
                                           : PositiveInputs{};
  return run_matryoshka_backward(q, k, scale, pos, dims, renormalize, row_stats, g_row, col_stats, g_col, dq, dk,
                                 &masks->args, row_pos, col_pos);
}

// G[i, pos[i]] (0 where pos[i] < 0), each read off the very guide tile TileMasks forms for row i's tile
// and pos[i]'s key tile (the same RowTiles grid, TILE_K key tiles and RawTiles route), so that a guide
// threshold and the scores compared with it come from the same arithmetic: a column duplicating the
// labelled one ties it exactly. Only the tiles holding a positive are multiplied.
template <typename G>
void guide_label_scores_impl(const G* gq, const G* gk, const int64_t* pos, int64_t bq, int64_t bk, int64_t dg, G* out) {
  const RowTiles tiles(bq);
  const int64_t tk = std::min(TILE_K, bk);
  std::fill(out, out + bq, G(0));
  at::parallel_for(0, tiles.count, 1, [&](int64_t t_begin, int64_t t_end) {
    const SingleThreadedBlas one_thread;
    RawTiles<G> raw(tiles.size, tk, dg);
    std::vector<G> scores(tiles.size * tk);
    for (int64_t j0 = 0; j0 < bk; j0 += tk) {
      const int64_t nj = std::min(tk, bk - j0);
      bool packed = false;
      for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t i0 = tiles.begin(t), ni = tiles.height(t);
        bool any = false;
        for (int64_t i = i0; i < i0 + ni; ++i) any = any || (pos[i] >= j0 && pos[i] < j0 + nj);
        if (!any) continue;
        if (!packed) raw.set_keys(gk + j0 * dg, nj), packed = true;
        raw.product(gq + i0 * dg, ni, scores.data(), nj);
        for (int64_t i = i0; i < i0 + ni; ++i) {
          if (pos[i] >= j0 && pos[i] < j0 + nj) out[i] = scores[(i - i0) * nj + (pos[i] - j0)];
        }
      }
    }
  });
}

at::Tensor guide_label_scores(const at::Tensor& guide_q, const at::Tensor& guide_k, const at::Tensor& pos_in) {
  const auto gt = guide_q.scalar_type();
  TORCH_CHECK((gt == at::kFloat || gt == at::kDouble) && guide_k.scalar_type() == gt && guide_q.dim() == 2 &&
                  guide_k.dim() == 2 && guide_q.size(1) == guide_k.size(1) && guide_q.device().is_cpu() &&
                  guide_k.device().is_cpu(),
              "infcl native: guide_q ", guide_q.sizes(), " and guide_k ", guide_k.sizes(),
              " must be CPU [Bq, D'] and [Bk, D'], both float32 or both float64");
  const int64_t bq = guide_q.size(0), bk = guide_k.size(0), dg = guide_q.size(1);
  const at::Tensor pos = ids_arg(pos_in, bq, "pos");
  const at::Tensor gq = guide_q.contiguous(), gk = guide_k.contiguous();
  at::Tensor out = at::empty({bq}, guide_q.options());
  if (gt == at::kDouble) {
    guide_label_scores_impl<double>(gq.data_ptr<double>(), gk.data_ptr<double>(), pos.data_ptr<int64_t>(), bq, bk, dg,
                                    out.data_ptr<double>());
  } else {
    guide_label_scores_impl<float>(gq.data_ptr<float>(), gk.data_ptr<float>(), pos.data_ptr<int64_t>(), bq, bk, dg,
                                   out.data_ptr<float>());
  }
  return out;
}

}  // namespace

// The op schemas: csrc/library.cpp.
TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("forward_block", &forward_block)
      .impl("backward_block", &backward_block)
      .impl("masked_forward_block", &masked_forward_block)
      .impl("masked_backward_block", &masked_backward_block)
      .impl("guide_label_scores", &guide_label_scores)
      .impl("matryoshka_forward_block", &matryoshka_forward_block)
      .impl("matryoshka_backward_block", &matryoshka_backward_block)
      .impl("masked_matryoshka_forward_block", &masked_matryoshka_forward_block)
      .impl("masked_matryoshka_backward_block", &masked_matryoshka_backward_block);
}

}  // namespace softmax

}  // namespace infcl
