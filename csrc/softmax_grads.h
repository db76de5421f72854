// The softmax loss's dS pass (shared by softmax_backward.cpp and matryoshka_backward.cpp): per row of a
// tile, dS = g_row (P_row - Y) (+ g_col (P_col - Y)) over the columns on either side of the row's positive
// (ds_span), the positive itself (ds_positive), with the scale gradient's sums; SharedRef, the symmetric
// loss's one-exp shortcut.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "softmax.h"

namespace infcl {
namespace softmax {

// The backward's SHARED_REF_SPAN (softmax_forward.cpp), on the log-sum-exps L = m + r of a tile's rows and
// columns: a flushed exp(x_row) hides exp(x_col) = exp(x_row) * exp(L_row - L_col) with
// |L_row - L_col| <= 2 * LSE_REF_SPAN, so what is lost stays below exp(EXP_LO + 2 * LSE_REF_SPAN) = e^-47
// (of a column's total probability 1).
constexpr double LSE_REF_SPAN = 20.0;

// dS as handed to the dq / dk products: float32 / float64 as is; bfloat16 rounded to nearest even
// (sign-symmetric: -v rounds to -bf16(v)). dS already holds -Y, so nothing cancels against it later.
template <typename Acc>
inline void store_ds(Acc* ds, int64_t c, Acc v) {
  ds[c] = v;
}
inline void store_ds(at::BFloat16* ds, int64_t c, float v) {
  const uint16_t bits = to_bf16_bits(v);
  std::memcpy(ds + c, &bits, sizeof bits);
}

// What the dS pass reads per row, with the symmetric loss's per-column stats (offset to the tile). u: label
// smoothing's uniform weight, subtracted from dS on each entry the line keeps (read by the `uniform` passes).
template <typename Acc>
struct RowGrad {
  Acc m, rel, g;
  Acc u = 0;
};
template <typename Acc>
struct ColGrads {
  const Acc* m = nullptr;
  const Acc* rel = nullptr;
  const Acc* g = nullptr;
  // kOneExp only: per column g * exp(ref - L_col), and per row exp(L_row - ref) (see SharedRef).
  const Acc* factor = nullptr;
  const Acc* u = nullptr;
};

// Which terms a tile's dS has: the row's only, both directions with two exps per entry, or both with
// the one-exp shortcut (kOneExp).
enum class Terms { Rows, Both, BothShared };

// The column direction's P (times its upstream gradient) at entry c of a row: its own exp with both
// directions' stats (Both), or the row's exp e rescaled by the row and column factors (the shared-stats path).
template <Terms terms, typename Acc>
inline Acc col_term(const Acc* s, int64_t c, Acc e, Acc row_factor, const ColGrads<Acc>& col) {
  if constexpr (terms == Terms::Both) {
    return col.g[c] * fast_exp((s[c] - col.m[c]) - col.rel[c]);
  } else {
    return (e * row_factor) * col.factor[c];
  }
}

// dS over columns [c0, c1) of one row (none of them its positive): g_row * P_row (+ g_col * P_col),
// P = exp((S - m) - r), each less its line's uniform weight where `uniform`, with the row's and column's
// parts of the scale gradient, sum dS_part * raw.
template <Terms terms, bool uniform, typename Acc, typename DS>
inline void ds_span(int64_t c0, int64_t c1, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                    Acc row_factor, const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
  const Acc m = row.m, rel = row.rel, g = row.g, u = row.u;
#pragma omp simd reduction(+ : acc_row, acc_col)
  for (int64_t c = c0; c < c1; ++c) {
    const Acc x = raw[c];
    const Acc e = fast_exp((s[c] - m) - rel);
    const Acc pr = uniform ? g * e - u : g * e;
    Acc v = pr;
    acc_row += pr * x;
    if constexpr (terms != Terms::Rows) {
      const Acc pc = uniform ? col_term<terms>(s, c, e, row_factor, col) - col.u[c]
                             : col_term<terms>(s, c, e, row_factor, col);
      acc_col += pc * x;
      v += pc;
    }
    store_ds(ds, c, v);
  }
}

// dS at the row's positive column c: g * (P - 1) = g * expm1((S - m) - r) for each direction, so a
// confident row's tiny 1 - P keeps its digits (exp(x) - 1 would round it away).
template <Terms terms, typename Acc, typename DS>
inline void ds_positive(int64_t c, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                        const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
  const Acc x = raw[c];
  const Acc pr = row.g * std::expm1((s[c] - row.m) - row.rel);
  Acc v = pr;
  acc_row += pr * x;
  if constexpr (terms != Terms::Rows) {
    const Acc pc = col.g[c] * std::expm1((s[c] - col.m[c]) - col.rel[c]);
    acc_col += pc * x;
    v += pc;
  }
  store_ds(ds, c, v);
}

// One row of a tile: the spans left and right of its positive, and the positive (if in the tile).
template <Terms terms, typename Acc, typename DS>
inline void ds_row(int64_t nj, int64_t pos, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                   Acc row_factor, const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
  ds_span<terms, false>(0, pos >= 0 ? pos : nj, raw, s, ds, row, row_factor, col, acc_row, acc_col);
  if (pos < 0) return;
  ds_positive<terms>(pos, raw, s, ds, row, col, acc_row, acc_col);
  ds_span<terms, false>(pos + 1, nj, raw, s, ds, row, row_factor, col, acc_row, acc_col);
}

// The one-exp shortcut's reference for one tile (kOneExp, symmetric): ref = the largest row
// log-sum-exp L = m + r of the tile. Usable when every row's L and every column's L lies within
// LSE_REF_SPAN of it; then exp(x_col) = exp(x_row) * exp(L_row - ref) * exp(ref - L_col), each factor
// computed in double from the stats (so only x_row's rounding is shared) and within e^+-SPAN.
template <typename Acc>
class SharedRef {
 public:
  explicit SharedRef(int64_t tk) : col_factor_(tk) {}

  // Sets the column factors g_col * exp(ref - L_col) and returns true when the tile qualifies.
  bool prepare(const Acc* row_m, const Acc* row_rel, int64_t ni, const ColGrads<Acc>& col, int64_t nj) {
    double ref = -std::numeric_limits<double>::infinity(), low = std::numeric_limits<double>::infinity();
    for (int64_t r = 0; r < ni; ++r) {
      const double l = static_cast<double>(row_m[r]) + row_rel[r];
      ref = std::max(ref, l);
      low = std::min(low, l);
    }
    for (int64_t c = 0; c < nj; ++c) {
      const double l = static_cast<double>(col.m[c]) + col.rel[c];
      low = std::min(low, l);
      if (!(l <= ref + LSE_REF_SPAN)) return false;
    }
    if (!std::isfinite(ref) || !(low >= ref - LSE_REF_SPAN)) return false;
    ref_ = ref;
    for (int64_t c = 0; c < nj; ++c) {
      col_factor_[c] = static_cast<Acc>(col.g[c] * std::exp(ref - (static_cast<double>(col.m[c]) + col.rel[c])));
    }
    return true;
  }
  Acc row_factor(Acc m, Acc rel) const { return static_cast<Acc>(std::exp((static_cast<double>(m) + rel) - ref_)); }
  const Acc* col_factors() const { return col_factor_.data(); }

 private:
  double ref_ = 0.0;
  std::vector<Acc> col_factor_;
};

// dscale [2] (double) from the lanes' (row part, column part) sums, added in lane order.
inline void write_dscale(const std::vector<std::pair<double, double>>& parts, at::Tensor& dscale) {
  double total_row = 0.0, total_col = 0.0;
  for (const auto& part : parts) {
    total_row += part.first;
    total_col += part.second;
  }
  dscale[0] = total_row;
  dscale[1] = total_col;
}

}  // namespace softmax
}  // namespace infcl
