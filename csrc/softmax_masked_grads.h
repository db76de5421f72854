// The masked softmax loss's dS pass (shared by softmax_backward.cpp and matryoshka_backward.cpp; the masks:
// softmax_masks.h): per row of a tile, dS over the spans between its positives with each direction's excluded
// entries at 0 (ds_span_masked), and P - Y at each positive (positive_term: one positive, "mean" or "sum").

#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "softmax.h"
#include "softmax_grads.h"

namespace infcl {
namespace softmax {

// Masked backward: dS over columns [c0, c1) of one row with exclusions (none of them a positive), as
// ds_span with each direction's term 0 where that direction excludes the entry (er / ec: one byte per
// column of the tile). The shared path's row exp is taken before the row's mask, as the columns need it.
// uniform: each direction's term less its line's uniform weight where it keeps the entry.
template <Terms terms, bool uniform, typename Acc, typename DS>
inline void ds_span_masked(int64_t c0, int64_t c1, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                           Acc row_factor, const ColGrads<Acc>& col, const uint8_t* er, const uint8_t* ec,
                           Acc& acc_row, Acc& acc_col) {
  const Acc m = row.m, rel = row.rel, g = row.g, u = row.u;
#pragma omp simd reduction(+ : acc_row, acc_col) simdlen(kLanes<Acc>)
  for (int64_t c = c0; c < c1; ++c) {
    const Acc x = raw[c];
    const Acc e = fast_exp((s[c] - m) - rel);
    const Acc pr = er[c] ? Acc(0) : (uniform ? g * e - u : g * e);
    Acc v = pr;
    acc_row += pr * x;
    if constexpr (terms != Terms::Rows) {
      const Acc pc = ec[c] ? Acc(0)
                           : (uniform ? col_term<terms>(s, c, e, row_factor, col) - col.u[c]
                                      : col_term<terms>(s, c, e, row_factor, col));
      acc_col += pc * x;
      v += pc;
    }
    store_ds(ds, c, v);
  }
}

// What a row's (or column's) positives look like to the masked backward: their global count ("mean")
// or stats ("sum": max, log-sum relative to it), offset to the tile's lines; unused for Label.
template <typename Acc>
struct PositiveGrads {
  const Acc* count = nullptr;
  const Acc* max = nullptr;
  const Acc* rel = nullptr;
  PositiveGrads offset(int64_t t) const {
    return {count ? count + t : nullptr, max ? max + t : nullptr, rel ? rel + t : nullptr};
  }
};

// P - Y at a positive of a line with stats (m, rel), never a difference of two rounded probabilities:
// Label: expm1(x), x = (S - m) - rel (p - 1); "mean": expm1(x + log c) / c (p - 1/c); "sum": y * expm1(d),
// y = exp((S - pm) - pr) the positive's share of its positives and d = (pm - m) + (pr - rel) <= 0 the log
// of their share of the softmax. With one positive (c = 1; pm = S, pr = 0) each is Label's bit for bit.
template <typename Acc>
inline Acc positive_term(Positives kind, Acc s, Acc m, Acc rel, const PositiveGrads<Acc>& y, int64_t t) {
  const Acc x = (s - m) - rel;
  switch (kind) {
    case Positives::Mean:
      return std::expm1(x + std::log(y.count[t])) / y.count[t];
    case Positives::Sum:
      return std::exp((s - y.max[t]) - y.rel[t]) * std::expm1((y.max[t] - m) + (y.rel[t] - rel));
    default:
      return std::expm1(x);
  }
}

// One row of a masked tile: the spans between its positives (sorted; masked only if the row has an
// exclusion) and each positive, in column order (uniform: every kept entry less its lines' uniform weights,
// a positive's too: it is never excluded). Flattened: with the plain and the masked rows in one
// caller, GCC stopped inlining fast_exp into these loops, whose scalar calls then cost ~13% of a pass.
template <Terms terms, bool uniform, typename Acc, typename DS>
__attribute__((flatten)) inline void ds_masked_row(int64_t nj, const TileMasks& masks, int64_t r, const Acc* raw, const Acc* s, DS* ds,
                          const RowGrad<Acc>& row, Acc row_factor, const ColGrads<Acc>& col,
                          const PositiveGrads<Acc>& row_pos, const PositiveGrads<Acc>& col_pos, Acc& acc_row,
                          Acc& acc_col) {
  const bool any = masks.any(r);
  const uint8_t* er = masks.row_excluded(r);
  const uint8_t* ec = masks.col_excluded(r);
  auto span = [&](int64_t c0, int64_t c1) {
    if (any) {
      ds_span_masked<terms, uniform>(c0, c1, raw, s, ds, row, row_factor, col, er, ec, acc_row, acc_col);
    } else {
      ds_span<terms, uniform>(c0, c1, raw, s, ds, row, row_factor, col, acc_row, acc_col);
    }
  };
  int64_t next = 0;
  for (const int64_t* p = masks.positives_begin(r); p != masks.positives_end(r); ++p) {
    const int64_t c = *p;
    span(next, c);
    const Acc x = raw[c];
    Acc pr = row.g * positive_term(masks.kind(), s[c], row.m, row.rel, row_pos, r);
    if constexpr (uniform) pr -= row.u;
    Acc v = pr;
    acc_row += pr * x;
    if constexpr (terms != Terms::Rows) {
      Acc pc = col.g[c] * positive_term(masks.kind(), s[c], col.m[c], col.rel[c], col_pos, c);
      if constexpr (uniform) pc -= col.u[c];
      acc_col += pc * x;
      v += pc;
    }
    store_ds(ds, c, v);
    next = c + 1;
  }
  span(next, nj);
}

// The masked backward's positives of one side, from the contiguous accumulation-dtype tensors given.
template <typename Acc>
PositiveGrads<Acc> positive_grads(const PositiveInputs& in) {
  PositiveGrads<Acc> out;
  if (in.count.defined()) out.count = in.count.data_ptr<Acc>();
  if (in.stats.defined()) {
    out.max = in.stats.data_ptr<Acc>();
    out.rel = out.max + in.stats.size(1);
  }
  return out;
}

}  // namespace softmax
}  // namespace infcl
