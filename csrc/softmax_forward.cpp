// The softmax loss's forward (softmax.h: forward()): per tile, raw = q_i @ k_j.T by RawTiles, S = raw * scale
// rounded into the tile, the tile's row and column maxima, then the running log-sum-exp stats of its rows
// and (symmetric) its columns while the tile is in cache, and each row's positive logit read off it.
//
// The row tiles (RowTiles, fixed by Bq) are cut into column groups (at most MAX_COLUMN_GROUPS) that the
// threads share, key tiles outer; each group keeps its own running column stats, merged in group order at
// the end, and each row tile updates its own rows' stats, so the outputs do not depend on the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "softmax.h"
#include "softmax_stats.h"

namespace infcl {
namespace softmax {
namespace {

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
template <bool split, Kept kept, typename Acc>
void scale_mask_maxima(Acc* s, int64_t ni, int64_t nj, Acc sc, const TileMasks& masks, Acc* row_max, Acc* col_max,
                       const KeptTile<Acc>& sums) {
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  constexpr bool rows_kept = kept != Kept::None, cols_kept = kept == Kept::Both;
  std::fill(col_max, col_max + nj, neg_inf);
  if constexpr (cols_kept) sums.clear(nj);
  for (int64_t r = 0; r < ni; ++r) {
    Acc* sr = s + r * nj;
    Acc m = neg_inf, sum = 0, count = 0;
    if (!masks.any(r)) {
#pragma omp simd reduction(max : m) reduction(+ : sum)
      for (int64_t c = 0; c < nj; ++c) {
        const Acc v = sr[c] * sc;
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
        const Acc v = sr[c] * sc;
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

// One thread's forward work: its column groups' row tiles against one key tile at a time, each tile
// updating its rows' running stats and its group's running column partial.
template <typename In>
class ForwardWorker {
 public:
  using Acc = typename Types<In>::acc;

  // masks: null for the plain loss (tile()), else the masked loss's inputs (masked_tile()); kept: the masked
  // tiles also sum and count the kept logits.
  ForwardWorker(const In* q, const In* k, int64_t bk, int64_t d, const RowTiles& tiles, Acc sc, const int64_t* pos,
                bool brgemm, const MaskArgs* masks = nullptr, bool symmetric = false, bool kept = false)
      : q_(q), k_(k), d_(d), sc_(sc), pos_(pos), tiles_(tiles),
        raw_(tiles.size, std::min(TILE_K, bk), d, brgemm, /*backward=*/false),
        s_(tiles.size * std::min(TILE_K, bk)), stats_(tiles.size, TILE_K) {
    if (masks) {
      masks_ = std::make_unique<TileMasks>(*masks, tiles.size, std::min(TILE_K, bk), symmetric);
      split_ = masks->has_guide() && symmetric;
    }
    if (kept) {
      kept_rows_.assign(2 * tiles.size, Acc(0));
      kept_cols_.assign(2 * TILE_K, Acc(0));
      kept_ = {kept_rows_.data(), kept_rows_.data() + tiles.size, kept_cols_.data(), kept_cols_.data() + TILE_K};
    }
  }

  // Packs key tile [j0, j0 + nj) for this thread's products.
  void set_keys(int64_t j0, int64_t nj) {
    raw_.set_keys(k_ + j0 * d_, nj);
    if (masks_) masks_->set_keys(j0, nj);
  }

  // Row tile t against key tile [j0, j0 + nj): rows = the running stats of its rows; cols = its group's
  // running column stats of this key tile (max == nullptr: rows only); positives: [bq].
  void tile(int64_t t, const Running<Acc>& rows, int64_t j0, int64_t nj, const Running<Acc>& cols,
            Acc* positives) {
    const int64_t i0 = tiles_.begin(t), ni = tiles_.height(t);
    Acc* s = s_.data();
    raw_.product(q_ + i0 * d_, ni, s, nj);
    scale_with_maxima<false>(s, s, ni, nj, sc_, {}, stats_.row_max(), stats_.col_max());
    take_positives(s, ni, nj, pos_, i0, j0, positives);
    stats_.add_terms(s, ni, nj, rows, cols);
  }

  // The masked loss's tile: as tile(), over the entries not excluded, with the positives' partials of
  // its rows (row_pos, offset to the row tile) and of its group's columns (col_pos, offset to the key tile),
  // and, where the worker was made with `kept`, the kept logits' sums of its rows (row_kept) and of its
  // group's columns (col_kept; offset likewise).
  void masked_tile(int64_t t, const Running<Acc>& rows, int64_t j0, int64_t nj, const Running<Acc>& cols,
                   const PositiveRun<Acc>& row_pos, const PositiveRun<Acc>& col_pos, const KeptRun& row_kept,
                   const KeptRun& col_kept) {
    const int64_t i0 = tiles_.begin(t), ni = tiles_.height(t);
    Acc* s = s_.data();
    raw_.product(q_ + i0 * d_, ni, s, nj);
    masks_->build(pos_, i0, ni, j0, nj);
    const bool split = split_ && cols.max;
    const Kept kept = !kept_.row_sum ? Kept::None : (cols.max ? Kept::Both : Kept::Rows);
    switch (kept) {
      case Kept::None: scale_and_mask<Kept::None>(split, s, ni, nj); break;
      case Kept::Rows: scale_and_mask<Kept::Rows>(split, s, ni, nj); break;
      case Kept::Both: scale_and_mask<Kept::Both>(split, s, ni, nj); break;
    }
    if (kept != Kept::None) {
      row_kept.add(kept_.row_sum, kept_.row_count, ni);
      if (kept == Kept::Both) col_kept.add(kept_.col_sum, kept_.col_count, nj);
    }
    // A positive is never excluded: its logit in s is S itself.
    const bool lse_wanted = masks_->kind() == Positives::Sum;
    for (int64_t r = 0; r < ni; ++r) {
      for (const int64_t* c = masks_->positives_begin(r); c != masks_->positives_end(r); ++c) {
        const Acc v = s[r * nj + *c];
        row_pos.add(r, v, lse_wanted);
        if (cols.max) col_pos.add(*c, v, lse_wanted);
      }
    }
    if (!split) {
      stats_.add_terms(s, ni, nj, rows, cols);
      return;
    }
    raise_maxima(rows, stats_.row_max(), ni);
    raise_maxima(cols, stats_.col_max(), nj);
    const Acc ref = kOneExp<In> ? shared_reference_kept(stats_.row_max(), ni, stats_.col_max(), nj) : Acc(0);
    if (kOneExp<In> && !std::isnan(ref)) {
      add_split_terms<true>(s, ni, nj, *masks_, rows, cols, ref, stats_.col_top(), stats_.col_rest());
    } else {
      add_split_terms<false>(s, ni, nj, *masks_, rows, cols, ref, stats_.col_top(), stats_.col_rest());
    }
  }

 private:
  template <Kept kept>
  void scale_and_mask(bool split, Acc* s, int64_t ni, int64_t nj) {
    if (split) {
      softmax::scale_mask_maxima<true, kept>(s, ni, nj, sc_, *masks_, stats_.row_max(), stats_.col_max(),
                                             kept_);
    } else {
      softmax::scale_mask_maxima<false, kept>(s, ni, nj, sc_, *masks_, stats_.row_max(), stats_.col_max(),
                                              kept_);
    }
  }

  const In* q_;
  const In* k_;
  int64_t d_;
  Acc sc_;
  const int64_t* pos_;
  RowTiles tiles_;
  RawTiles<In> raw_;
  std::vector<Acc> s_;
  TileStats<In> stats_;
  std::unique_ptr<TileMasks> masks_;
  bool split_ = false;  // rows and columns exclude different entries (a guide with the columns wanted)
  std::vector<Acc> kept_rows_, kept_cols_;
  KeptTile<Acc> kept_;  // the tile's kept sums (row_sum null: not wanted)
};

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

// The kept logits' rows of a masked result with kept sums ([2, n] at out: sum, count) from `groups`
// partials ([groups, n], merged in group order).
template <typename Acc>
void merge_kept_partials(const KeptStore& parts, int64_t groups, int64_t n, Acc* out) {
  at::parallel_for(0, n, 1024, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double sum = 0.0, count = 0.0;
      for (int64_t p = 0; p < groups; ++p) {
        sum += parts.sum[p * n + c];
        count += parts.count[p * n + c];
      }
      out[c] = static_cast<Acc>(sum);
      out[n + c] = static_cast<Acc>(count);
    }
  });
}

// masks: null for the plain loss (rows [3, bq], cols [2, bk]); else the masked loss's (rows [6, bq],
// cols [6, bk]: the stats over the entries kept, then the positives' rows, see merge_positive_partials;
// kept_sums: [8, n], then the kept logits' sum and number, see merge_kept_partials).
template <typename In>
void forward_impl(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
                  const MaskArgs* masks, bool kept_sums, bool brgemm, at::Tensor& rows, at::Tensor& cols) {
  using Acc = typename Types<In>::acc;
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  const RowTiles tiles(bq);
  const int64_t groups = std::max<int64_t>(1, std::min(tiles.count, MAX_COLUMN_GROUPS));
  const int64_t tk = std::min(TILE_K, bk);
  RunningStore<Acc> row_run, col_parts;  // col_parts: [groups, bk]
  row_run.reset(bq);
  col_parts.reset(symmetric ? groups * bk : 0);
  // Column groups per positive group: 1 unless the masked symmetric forward keeps the columns' positives.
  const int64_t span = masks && symmetric ? (groups + MAX_POSITIVE_GROUPS - 1) / MAX_POSITIVE_GROUPS : 1;
  const int64_t positive_groups = (groups + span - 1) / span;
  PositiveStore<Acc> row_pos, col_pos_parts;  // the masked loss's; col_pos_parts: [positive_groups, bk]
  KeptStore row_kept, col_kept_parts;  // with kept_sums; col_kept_parts: [positive_groups, bk], as col_pos_parts
  if (masks) {
    const bool lse_wanted = masks->positives == Positives::Sum;
    row_pos.reset(bq, lse_wanted);
    col_pos_parts.reset(symmetric ? positive_groups * bk : 0, lse_wanted);
    row_kept.reset(kept_sums ? bq : 0);
    col_kept_parts.reset(kept_sums && symmetric ? positive_groups * bk : 0);
  }
  rows.zero_();  // rows[2] stays 0 where the positive lies in another block
  Acc* out = rows.data_ptr<Acc>();
  at::parallel_for(0, positive_groups, 1, [&](int64_t p_begin, int64_t p_end) {
    const int64_t g_begin = p_begin * span, g_end = std::min(groups, p_end * span);
    const SingleThreadedBlas one_thread;
    ForwardWorker<In> work(q.data_ptr<In>(), k.data_ptr<In>(), bk, d, tiles, static_cast<Acc>(scale),
                           pos.data_ptr<int64_t>(), brgemm, masks, symmetric, kept_sums);
    for (int64_t j0 = 0; j0 < bk; j0 += tk) {
      const int64_t nj = std::min(tk, bk - j0);
      work.set_keys(j0, nj);
      for (int64_t g = g_begin; g < g_end; ++g) {
        const Running<Acc> part = symmetric ? col_parts.at(g * bk + j0) : Running<Acc>{nullptr, nullptr, nullptr};
        for (int64_t t = group_start(tiles.count, groups, g); t < group_start(tiles.count, groups, g + 1); ++t) {
          if (!masks) {
            work.tile(t, row_run.at(tiles.begin(t)), j0, nj, part, out + 2 * bq);
            continue;
          }
          const PositiveRun<Acc> col_pos = symmetric ? PositiveRun<Acc>::at(col_pos_parts, g / span * bk + j0)
                                                     : PositiveRun<Acc>{{nullptr, nullptr, nullptr}, nullptr, nullptr};
          work.masked_tile(t, row_run.at(tiles.begin(t)), j0, nj, part, PositiveRun<Acc>::at(row_pos, tiles.begin(t)),
                           col_pos, row_kept.at(tiles.begin(t)), col_kept_parts.at(g / span * bk + j0));
        }
      }
    }
  });
  for (int64_t i = 0; i < bq; ++i) {
    out[i] = row_run.max[i];
    out[bq + i] = log_rel(row_run.max[i], row_run.top[i], row_run.rest[i]);
  }
  if (symmetric) merge_column_partials(col_parts, groups, bk, cols.data_ptr<Acc>());
  if (masks) {
    const bool lse_wanted = masks->positives == Positives::Sum;
    merge_positive_partials(row_pos, 1, bq, lse_wanted, out + 2 * bq);
    if (symmetric) merge_positive_partials(col_pos_parts, positive_groups, bk, lse_wanted, cols.data_ptr<Acc>() + 2 * bk);
  }
  if (kept_sums) {
    merge_kept_partials(row_kept, 1, bq, out + KEPT_SUM_ROW * bq);
    if (symmetric) merge_kept_partials(col_kept_parts, positive_groups, bk, cols.data_ptr<Acc>() + KEPT_SUM_ROW * bk);
  }
}

}  // namespace

void forward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
             const MaskArgs* masks, bool kept_sums, bool brgemm, at::Tensor& rows, at::Tensor& cols) {
  switch (q.scalar_type()) {
    case at::kFloat: forward_impl<float>(q, k, scale, pos, symmetric, masks, kept_sums, brgemm, rows, cols); break;
    case at::kDouble: forward_impl<double>(q, k, scale, pos, symmetric, masks, kept_sums, brgemm, rows, cols); break;
    case at::kBFloat16:
      forward_impl<at::BFloat16>(q, k, scale, pos, symmetric, masks, kept_sums, brgemm, rows, cols);
      break;
    default: TORCH_CHECK(false, "infcl native: unreachable dtype");
  }
}

}  // namespace softmax
}  // namespace infcl
