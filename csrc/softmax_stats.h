// The softmax loss's forward statistics (shared by softmax_forward.cpp and matryoshka_forward.cpp): per
// tile, S with its row and column maxima, then the running log-sum-exp stats of its rows and (symmetric)
// columns (TileStats), each row's positive logit read off the tile, and the column groups whose partial
// column stats are merged in group order.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "softmax.h"

namespace infcl {
namespace softmax {

// Span (in natural-log units) within which one tile's row and column maxima must lie for the forward's
// one-exp path (kOneExp): exp(+-SPAN) and their products stay normal floats with room to spare, and a
// term that underflows there is below exp(EXP_LO + SPAN) = e^-47 of its row's or column's largest term.
constexpr float SHARED_REF_SPAN = 40.0f;

// A row's (or column's) running stats are its max m, the number of entries equal to it
// (top), and the sum of exp(S - m) over the others (rest), both in double; at the end
// r = log(top + rest) = log1p((top - 1) + rest). Keeping the exact 1s out of the sum of the small terms
// keeps a confident row's tiny r to full relative precision (1 + rest would round rest to the
// accumulator's ulp of 1), and r >= 0 by construction (top >= 1), so losses (m - pos) + r are >= 0.

template <typename Acc>
struct Running {
  Acc* max;
  double* top;
  double* rest;
  Running offset(int64_t t) const { return {max + t, top + t, rest + t}; }
};

// Running stats storage for n rows or columns (m = -inf, nothing counted: the empty set).
template <typename Acc>
struct RunningStore {
  std::vector<Acc> max;
  std::vector<double> top, rest;
  void reset(int64_t n) {
    max.assign(n, -std::numeric_limits<Acc>::infinity());
    top.assign(n, 0.0);
    rest.assign(n, 0.0);
  }
  Running<Acc> at(int64_t t) { return {max.data() + t, top.data() + t, rest.data() + t}; }
};

// A renormalized prefix's row and column factors over a tile (Matryoshka: a_i = 1 / |q_i[:m]|, b_j alike),
// offset to the tile's first row and column; both null for the plain loss's S = raw * scale.
template <typename Acc>
struct TileFactors {
  const Acc* row = nullptr;
  const Acc* col = nullptr;
};

// One entry's logit: raw * scale, or for a renormalized prefix ((raw * a_i) * b_j) * scale, each product
// rounded in this order (the product scale_tile and scale_prefix_tile form, so a backward recomputes it).
template <bool renorm, typename Acc>
inline Acc prefix_product(Acc raw, Acc a, const Acc* b, int64_t c) {
  if constexpr (renorm) {
    return (raw * a) * b[c];
  } else {
    return raw;
  }
}

// S = raw * scale (renorm: ((raw * a_i) * b_j) * scale) into s, which may be raw itself, with the tile's
// row maxima and column maxima (nj entries).
template <bool renorm, typename Acc>
void scale_with_maxima(const Acc* raw, Acc* s, int64_t ni, int64_t nj, Acc sc, const TileFactors<Acc>& f,
                       Acc* row_max, Acc* col_max) {
  std::fill(col_max, col_max + nj, -std::numeric_limits<Acc>::infinity());
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* xr = raw + r * nj;
    Acc* sr = s + r * nj;
    const Acc a = renorm ? f.row[r] : Acc(1);
    Acc m = -std::numeric_limits<Acc>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < nj; ++c) {
      const Acc v = prefix_product<renorm>(xr[c], a, f.col, c) * sc;  // the product scale_tile forms
      sr[c] = v;
      m = m > v ? m : v;
      col_max[c] = col_max[c] > v ? col_max[c] : v;
    }
    row_max[r] = m;
  }
}

// Raise n running maxima to include a tile's maxima; where one grows, everything so far becomes `rest`,
// rescaled by exp(old - new).
template <typename Acc>
void raise_maxima(const Running<Acc>& run, const Acc* tile_max, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const Acc new_max = nan_max(run.max[t], tile_max[t]);
    if (new_max == run.max[t]) continue;
    run.rest[t] = (run.top[t] + run.rest[t]) * rescale_factor(run.max[t], new_max);
    run.top[t] = 0.0;
    run.max[t] = new_max;
  }
}

// One entry's term for a row's or column's running stats (max m): an entry equal to m counts in `top`;
// any other adds its exp e to `rest` (e = exp(s - m), or exp(s - M) on the one-exp path).
template <typename Acc>
inline void add_term(Acc s, Acc m, Acc e, Acc& top, Acc& rest) {
  const bool is_top = s == m;
  top += is_top ? Acc(1) : Acc(0);
  rest += is_top ? Acc(0) : e;
}

// Rows only: each row's terms against its running max.
template <typename Acc>
void add_row_terms(const Acc* s, int64_t ni, int64_t nj, const Running<Acc>& rows) {
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* sr = s + r * nj;
    const Acc m = rows.max[r];
    Acc top = 0, rest = 0;
#pragma omp simd reduction(+ : top, rest)
    for (int64_t c = 0; c < nj; ++c) add_term(sr[c], m, fast_exp(sr[c] - m), top, rest);
    rows.top[r] += top;
    rows.rest[r] += rest;
  }
}

// The one-exp path's reference (kOneExp): the tile max M, when every tile row and column maximum lies
// within SHARED_REF_SPAN of it (then exp(M - running max) <= exp(SHARED_REF_SPAN) rebases each row's and
// column's sum once); NaN otherwise.
template <typename Acc>
Acc shared_reference(const Acc* tile_row_max, int64_t ni, const Acc* tile_col_max, int64_t nj) {
  const Acc top = *std::max_element(tile_row_max, tile_row_max + ni);
  const Acc low = std::min(*std::min_element(tile_row_max, tile_row_max + ni),
                           *std::min_element(tile_col_max, tile_col_max + nj));
  const bool usable = std::isfinite(top) && low >= top - SHARED_REF_SPAN;
  return usable ? top : std::numeric_limits<Acc>::quiet_NaN();
}

// Rows and columns. Two exps per entry, each against its own running max (so each largest term is
// exp(0) = 1, counted in top); or, one_exp, e = exp(s - ref) for both, each sum rebased by
// exp(ref - running max) at the end. col_top / col_rest: nj scratch entries (a column's sums over the
// tile; counts up to TILE_Q are exact in float).
template <bool one_exp, typename Acc>
void add_row_col_terms(const Acc* s, int64_t ni, int64_t nj, const Running<Acc>& rows, const Running<Acc>& cols,
                       Acc ref, Acc* col_top, Acc* col_rest) {
  std::fill(col_top, col_top + nj, Acc(0));
  std::fill(col_rest, col_rest + nj, Acc(0));
  const Acc* col_max = cols.max;
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* sr = s + r * nj;
    const Acc m = rows.max[r];
    Acc top = 0, rest = 0;
#pragma omp simd reduction(+ : top, rest)
    for (int64_t c = 0; c < nj; ++c) {
      const Acc v = sr[c];
      if constexpr (one_exp) {
        const Acc e = fast_exp(v - ref);
        add_term(v, m, e, top, rest);
        add_term(v, col_max[c], e, col_top[c], col_rest[c]);
      } else {
        add_term(v, m, fast_exp(v - m), top, rest);
        add_term(v, col_max[c], fast_exp(v - col_max[c]), col_top[c], col_rest[c]);
      }
    }
    rows.top[r] += top;
    rows.rest[r] += one_exp ? rest * rescale_factor(ref, m) : rest;
  }
  for (int64_t c = 0; c < nj; ++c) {
    cols.top[c] += col_top[c];
    cols.rest[c] += one_exp ? col_rest[c] * rescale_factor(ref, col_max[c]) : col_rest[c];
  }
}

// rows[2] for the tile's rows whose positive lies in it: S itself, the very value the max was taken over.
template <typename Acc>
void take_positives(const Acc* s, int64_t ni, int64_t nj, const int64_t* pos, int64_t i0, int64_t j0, Acc* out) {
  for (int64_t r = 0; r < ni; ++r) {
    const int64_t c = positive_in_tile(pos, i0 + r, j0, nj);
    if (c >= 0) out[i0 + r] = s[r * nj + c];
  }
}

// r = log(top + rest) = log1p((top - 1) + rest); an empty set (m = -inf) keeps r = -inf; NaN stays NaN.
template <typename Acc>
inline Acc log_rel(Acc m, double top, double rest) {
  if (m == -std::numeric_limits<Acc>::infinity()) return m;
  return static_cast<Acc>(std::log1p((top - 1.0) + rest));
}

// Column stats from the groups' partials ([groups, bk]), merged in group order: M = max_p m_p; the
// partials at M add their top and rest, the others' top + rest joins rest, times exp(m_p - M).
template <typename Acc>
void merge_column_partials(RunningStore<Acc>& parts, int64_t groups, int64_t bk, Acc* out) {
  at::parallel_for(0, bk, 1024, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      Acc m = -std::numeric_limits<Acc>::infinity();
      for (int64_t p = 0; p < groups; ++p) m = nan_max(m, parts.max[p * bk + c]);
      double top = 0.0, rest = 0.0;
      for (int64_t p = 0; p < groups; ++p) {
        const int64_t at = p * bk + c;
        if (parts.max[at] == m) {
          top += parts.top[at];
          rest += parts.rest[at];
        } else {
          rest += (parts.top[at] + parts.rest[at]) * rescale_factor(parts.max[at], m);
        }
      }
      out[c] = m;
      out[bk + c] = log_rel(m, top, rest);
    }
  });
}

// Column groups: contiguous ranges of row tiles, each with its own running column stats over all of Bk,
// merged in group order at the end. Fixed by the row tiles alone (never by the thread count), so the
// forward's outputs do not depend on it; threads take whole groups, key tiles outer, so one packed key
// tile serves all of a thread's row tiles. At most MAX_COLUMN_GROUPS (partials: 20 bytes per group per
// column), which also caps the forward's threads.
constexpr int64_t MAX_COLUMN_GROUPS = 64;
inline int64_t group_start(int64_t tiles, int64_t groups, int64_t g) { return tiles * g / groups; }

// A tile's terms for its rows' running stats (and, cols.max set, its columns'), once S and its maxima are
// formed: the maxima raised, then one exp per entry (kOneExp, when shared_reference allows) or two. Holds
// the tile's scratch: its row and column maxima and the columns' partial sums.
template <typename In>
class TileStats {
 public:
  using Acc = typename Types<In>::acc;
  TileStats(int64_t rows, int64_t tk) : row_max_(rows), col_max_(tk), col_top_(tk), col_rest_(tk) {}

  Acc* row_max() { return row_max_.data(); }
  Acc* col_max() { return col_max_.data(); }

  void add_terms(const Acc* s, int64_t ni, int64_t nj, const Running<Acc>& rows, const Running<Acc>& cols) {
    raise_maxima(rows, row_max_.data(), ni);
    if (!cols.max) {
      add_row_terms(s, ni, nj, rows);
      return;
    }
    raise_maxima(cols, col_max_.data(), nj);
    const Acc ref = kOneExp<In> ? shared_reference(row_max_.data(), ni, col_max_.data(), nj) : Acc(0);
    if (kOneExp<In> && !std::isnan(ref)) {
      add_row_col_terms<true>(s, ni, nj, rows, cols, ref, col_top_.data(), col_rest_.data());
    } else {
      add_row_col_terms<false>(s, ni, nj, rows, cols, ref, col_top_.data(), col_rest_.data());
    }
  }

  // The shared scratch of the masked forward's split path (rows and columns excluding different entries).
  Acc* col_top() { return col_top_.data(); }
  Acc* col_rest() { return col_rest_.data(); }

 private:
  std::vector<Acc> row_max_, col_max_, col_top_, col_rest_;
};

}  // namespace softmax
}  // namespace infcl
