// The masked softmax forward's per-tile statistics (shared by softmax_forward.cpp and matryoshka_forward.cpp;
// the masks: softmax_masks.h): S with the maxima over the entries each direction keeps (scale_mask_maxima), the
// positives' running partials (PositiveRun), and the stats over the kept entries (add_masked_terms), with
// label smoothing's kept sums (KeptTile) for the plain masked forward.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "softmax.h"
#include "softmax_stats.h"

namespace infcl {
namespace softmax {

// Label smoothing's uniform part (the masked forward with kept sums, softmax.h: KEPT_SUM_ROW): whose kept
// logits a tile sums, none, its rows', or its rows' and columns' (symmetric).
enum class Kept { None, Rows, Both };

// One tile's sums and numbers of the kept S, per row (ni) and per column (nj): one thread's scratch, in
// Acc (a tile's counts, at most TILE_K or TILE_Q, are exact in float).
template <typename Acc>
struct KeptTile {
  Acc* row_sum = nullptr;
  Acc* row_count = nullptr;
  Acc* col_sum = nullptr;
  Acc* col_count = nullptr;
  void clear(int64_t nj) const {
    std::fill(col_sum, col_sum + nj, Acc(0));
    std::fill(col_count, col_count + nj, Acc(0));
  }
};

// The running sums and numbers of n lines' kept logits, in double (KeptRun: a view from a tile's first line;
// sum null: not wanted).
struct KeptRun {
  double* sum = nullptr;
  double* count = nullptr;
  template <typename Acc>
  void add(const Acc* tile_sum, const Acc* tile_count, int64_t n) const {
    for (int64_t t = 0; t < n; ++t) {
      sum[t] += tile_sum[t];
      count[t] += tile_count[t];
    }
  }
};
struct KeptStore {
  std::vector<double> sum, count;
  void reset(int64_t n) {
    sum.assign(n, 0.0);
    count.assign(n, 0.0);
  }
  KeptRun at(int64_t t) { return sum.empty() ? KeptRun{} : KeptRun{sum.data() + t, count.data() + t}; }
};

// Masked forward: S = raw * scale in place (the product scale_with_maxima forms), and the maxima over
// the entries each direction keeps. Unless `split` (a guide with the columns wanted: the two directions
// exclude different entries, add_split_terms reads the mask bytes), the excluded entries are then set
// to -inf in S, for the plain loss's add_terms: a row with nothing excluded keeps S as it is, so with no
// exclusion at all every later step sees the plain loss's tile bit for bit. An excluded entry adds
// nothing: exp(-inf) = 0, and while a whole row (column) so far is excluded its max is -inf, its -inf
// entries count in `top`, and the first finite max rescales them by exp(-inf) = 0.
// With `kept` (label smoothing's uniform part) also the tile's sums of the kept S and their number, per
// row and (Kept::Both) per column, from the same mask bytes: the entries the stats count.
// Matryoshka (renorm): S = ((raw * a_i) * b_j) * scale, the product scale_with_maxima forms, into s (raw
// itself elsewhere), from the prefix's factors f.
template <bool renorm, bool split, Kept kept, typename Acc>
void scale_mask_maxima(const Acc* raw, Acc* s, int64_t ni, int64_t nj, Acc sc, const TileFactors<Acc>& f,
                       const TileMasks& masks, Acc* row_max, Acc* col_max, const KeptTile<Acc>& sums) {
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  constexpr bool rows_kept = kept != Kept::None, cols_kept = kept == Kept::Both;
  std::fill(col_max, col_max + nj, neg_inf);
  if constexpr (cols_kept) sums.clear(nj);
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* xr = raw + r * nj;
    Acc* sr = s + r * nj;
    const Acc a = renorm ? f.row[r] : Acc(1);
    Acc m = neg_inf, sum = 0, count = 0;
    if (!masks.any(r)) {
#pragma omp simd reduction(max : m) reduction(+ : sum)
      for (int64_t c = 0; c < nj; ++c) {
        const Acc v = prefix_product<renorm>(xr[c], a, f.col, c) * sc;
        sr[c] = v;
        m = m > v ? m : v;
        col_max[c] = col_max[c] > v ? col_max[c] : v;
        if constexpr (rows_kept) sum += v;
        if constexpr (cols_kept) {
          sums.col_sum[c] += v;
          sums.col_count[c] += Acc(1);
        }
      }
      count = static_cast<Acc>(nj);
    } else {
      const uint8_t* er = masks.row_excluded(r);
      const uint8_t* ec = masks.col_excluded(r);
#pragma omp simd reduction(max : m) reduction(+ : sum, count) simdlen(kLanes<Acc>)
      for (int64_t c = 0; c < nj; ++c) {
        const Acc v = prefix_product<renorm>(xr[c], a, f.col, c) * sc;
        const Acc vr = er[c] ? neg_inf : v;
        const Acc vc = ec[c] ? neg_inf : v;
        sr[c] = split ? v : vr;
        m = m > vr ? m : vr;
        col_max[c] = col_max[c] > vc ? col_max[c] : vc;
        if constexpr (rows_kept) {
          sum += er[c] ? Acc(0) : v;
          count += er[c] ? Acc(0) : Acc(1);
        }
        if constexpr (cols_kept) {
          sums.col_sum[c] += ec[c] ? Acc(0) : v;
          sums.col_count[c] += ec[c] ? Acc(0) : Acc(1);
        }
      }
    }
    row_max[r] = m;
    if constexpr (rows_kept) {
      sums.row_sum[r] = sum;
      sums.row_count[r] = count;
    }
  }
}

// An entry's term like add_term, where `kept`; nothing where the direction excludes it.
template <typename Acc>
inline void add_kept_term(bool kept, Acc s, Acc m, Acc e, Acc& top, Acc& rest) {
  const bool is_top = kept && s == m;
  top += is_top ? Acc(1) : Acc(0);
  rest += (kept && !is_top) ? e : Acc(0);
}

// add_row_col_terms for a tile whose rows and columns exclude different entries (a guide with the
// columns wanted): S as it is, each direction's mask bytes deciding which entries it counts; one exp per
// entry against ref when one_exp, else two. An excluded entry's exp may overflow; it is never added.
// Flattened like ds_masked_row, so that fast_exp is inlined into the vector loop.
template <bool one_exp, typename Acc>
__attribute__((flatten)) void add_split_terms(const Acc* s, int64_t ni, int64_t nj, const TileMasks& masks, const Running<Acc>& rows,
                     const Running<Acc>& cols, Acc ref, Acc* col_top, Acc* col_rest) {
  std::fill(col_top, col_top + nj, Acc(0));
  std::fill(col_rest, col_rest + nj, Acc(0));
  const Acc* col_max = cols.max;
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* sr = s + r * nj;
    const uint8_t* er = masks.row_excluded(r);
    const uint8_t* ec = masks.col_excluded(r);
    // The bytes are only written for rows with an exclusion: the others read them through a zero mask
    // (a branch in the loop would keep it from vectorizing).
    const uint8_t live = masks.any(r) ? 0xFF : 0;
    const Acc m = rows.max[r];
    Acc top = 0, rest = 0;
#pragma omp simd reduction(+ : top, rest) simdlen(kLanes<Acc>)
    for (int64_t c = 0; c < nj; ++c) {
      const Acc v = sr[c];
      const bool row_kept = (er[c] & live) == 0;
      const bool col_kept = (ec[c] & live) == 0;
      if constexpr (one_exp) {
        const Acc e = fast_exp(v - ref);
        add_kept_term(row_kept, v, m, e, top, rest);
        add_kept_term(col_kept, v, col_max[c], e, col_top[c], col_rest[c]);
      } else {
        add_kept_term(row_kept, v, m, fast_exp(v - m), top, rest);
        add_kept_term(col_kept, v, col_max[c], fast_exp(v - col_max[c]), col_top[c], col_rest[c]);
      }
    }
    rows.top[r] += top;
    // A line with nothing kept so far (max -inf) has nothing to rebase (and exp(ref + inf) * 0 is NaN).
    rows.rest[r] += one_exp && rest != 0 ? rest * rescale_factor(ref, m) : rest;
  }
  for (int64_t c = 0; c < nj; ++c) {
    cols.top[c] += col_top[c];
    cols.rest[c] += one_exp && col_rest[c] != 0 ? col_rest[c] * rescale_factor(ref, col_max[c]) : col_rest[c];
  }
}

// shared_reference for add_split_terms: over the tile's rows and columns that keep an entry (an empty
// line, max -inf, adds nothing), and with the columns' maxima in the top too, since a column may keep an
// entry above every row's kept maximum.
template <typename Acc>
Acc shared_reference_kept(const Acc* tile_row_max, int64_t ni, const Acc* tile_col_max, int64_t nj) {
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  Acc top = neg_inf, low = std::numeric_limits<Acc>::infinity();
  for (const Acc* line : {tile_row_max, tile_col_max}) {
    for (int64_t t = 0, n = line == tile_row_max ? ni : nj; t < n; ++t) {
      if (line[t] == neg_inf) continue;
      top = nan_max(top, line[t]);
      low = std::min(low, line[t]);
    }
  }
  const bool usable = std::isfinite(top) && low >= top - SHARED_REF_SPAN;
  return usable ? top : std::numeric_limits<Acc>::quiet_NaN();
}

// The positives' running partials of n rows or columns (masked forward): their max, and for "sum" only
// their log-sum-exp as Running's (top, rest) about it; the sum of their logits (double) and their count.
// The symmetric forward keeps one per positive group and column ([positive groups, bk]), so every byte
// counts: 16 per entry ("mean" / one positive) or 32 ("sum"), beside the column stats' 20.
template <typename Acc>
struct PositiveStore {
  RunningStore<Acc> lse;  // top and rest empty unless "sum"
  std::vector<double> sum;
  std::vector<int32_t> count;  // a group's rows: far below 2^31
  void reset(int64_t n, bool lse_wanted) {
    lse.max.assign(n, -std::numeric_limits<Acc>::infinity());
    lse.top.assign(lse_wanted ? n : 0, 0.0);
    lse.rest.assign(lse_wanted ? n : 0, 0.0);
    sum.assign(n, 0.0);
    count.assign(n, 0);
  }
};

template <typename Acc>
struct PositiveRun {
  Running<Acc> lse;  // top, rest: null unless "sum"
  double* sum;
  int32_t* count;
  static PositiveRun at(PositiveStore<Acc>& store, int64_t t) {
    const bool lse_wanted = !store.lse.top.empty();
    return {{store.lse.max.data() + t, lse_wanted ? store.lse.top.data() + t : nullptr,
             lse_wanted ? store.lse.rest.data() + t : nullptr},
            store.sum.data() + t, store.count.data() + t};
  }
  // One positive logit v of line t. "sum": a new max rescales what is there (as raise_maxima), ties with
  // it count in top, the rest add exp(v - max) in double: positives are few, one exp each.
  void add(int64_t t, Acc v, bool lse_wanted) const {
    sum[t] += v;
    count[t] += 1;
    const Acc m = lse.max[t];
    if (!lse_wanted) {
      lse.max[t] = nan_max(m, v);
    } else if (v > m || v != v) {
      lse.rest[t] = (lse.top[t] + lse.rest[t]) * rescale_factor(m, v);
      lse.top[t] = 1.0;
      lse.max[t] = v;
    } else if (v == m) {
      lse.top[t] += 1.0;
    } else {
      lse.rest[t] += std::exp(static_cast<double>(v) - static_cast<double>(m));
    }
  }
};

// A masked tile's terms once S and its kept maxima are formed (scale_mask_maxima; masks built for the tile):
// each row's positives' partials (row_pos, offset to the tile's rows) and, cols.max set, each column's (col_pos,
// offset to the key tile); then the running stats over the kept entries, by the plain add_terms on S with its
// excluded entries at -inf, or, split (rows and columns exclude different entries), by each direction's bytes.
template <typename In>
void add_masked_terms(const typename Types<In>::acc* s, int64_t ni, int64_t nj, const TileMasks& masks, bool split,
                      TileStats<In>& stats, const Running<typename Types<In>::acc>& rows,
                      const Running<typename Types<In>::acc>& cols,
                      const PositiveRun<typename Types<In>::acc>& row_pos,
                      const PositiveRun<typename Types<In>::acc>& col_pos) {
  using Acc = typename Types<In>::acc;
  // A positive is never excluded: its logit in s is S itself.
  const bool lse_wanted = masks.kind() == Positives::Sum;
  for (int64_t r = 0; r < ni; ++r) {
    for (const int64_t* c = masks.positives_begin(r); c != masks.positives_end(r); ++c) {
      const Acc v = s[r * nj + *c];
      row_pos.add(r, v, lse_wanted);
      if (cols.max) col_pos.add(*c, v, lse_wanted);
    }
  }
  if (!split) {
    stats.add_terms(s, ni, nj, rows, cols);
    return;
  }
  raise_maxima(rows, stats.row_max(), ni);
  raise_maxima(cols, stats.col_max(), nj);
  const Acc ref = kOneExp<In> ? shared_reference_kept(stats.row_max(), ni, stats.col_max(), nj) : Acc(0);
  if (kOneExp<In> && !std::isnan(ref)) {
    add_split_terms<true>(s, ni, nj, masks, rows, cols, ref, stats.col_top(), stats.col_rest());
  } else {
    add_split_terms<false>(s, ni, nj, masks, rows, cols, ref, stats.col_top(), stats.col_rest());
  }
}

// The positives' rows of a masked result ([4, n] at out: max, log-sum relative to it ("sum" only, else
// -inf: the empty set's), sum, count) from `groups` partials ([groups, n], merged in group order like
// merge_column_partials; rows have one).
template <typename Acc>
void merge_positive_partials(PositiveStore<Acc>& parts, int64_t groups, int64_t n, bool lse_wanted, Acc* out) {
  at::parallel_for(0, n, 1024, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      Acc m = -std::numeric_limits<Acc>::infinity();
      for (int64_t p = 0; p < groups; ++p) m = nan_max(m, parts.lse.max[p * n + c]);
      double top = 0.0, rest = 0.0, sum = 0.0, count = 0.0;
      for (int64_t p = 0; p < groups; ++p) {
        const int64_t at = p * n + c;
        sum += parts.sum[at];
        count += parts.count[at];
        if (!lse_wanted) continue;
        if (parts.lse.max[at] == m) {
          top += parts.lse.top[at];
          rest += parts.lse.rest[at];
        } else {
          rest += (parts.lse.top[at] + parts.lse.rest[at]) * rescale_factor(parts.lse.max[at], m);
        }
      }
      out[c] = m;
      out[n + c] = lse_wanted ? log_rel(m, top, rest) : -std::numeric_limits<Acc>::infinity();
      out[2 * n + c] = static_cast<Acc>(sum);
      out[3 * n + c] = static_cast<Acc>(count);
    }
  });
}

// The masked symmetric forward's columns also need their positives' partials (16 or 32 bytes an entry
// beside the stats' 20): those are kept per positive group, a run of `span` consecutive column groups
// (at most MAX_POSITIVE_GROUPS of them), and the threads then take whole positive groups, so each one's
// partial is updated in one fixed order (key tiles, then its groups and row tiles in turn) whatever the
// thread count. That caps the masked symmetric forward at MAX_POSITIVE_GROUPS threads and keeps its
// extra memory within 2x of the plain loss's. The column stats stay per column group, so with all ids
// distinct (one positive per column: its partial is exact in any grouping) the loss is the plain one's bits.
constexpr int64_t MAX_POSITIVE_GROUPS = 16;

}  // namespace softmax
}  // namespace infcl
