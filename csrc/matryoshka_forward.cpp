// The Matryoshka softmax loss's forward (matryoshka.h): per tile, the raw product grows segment by segment
// (KeySegments) and at each prefix's boundary takes the plain forward's steps on that prefix's S (its maxima,
// positives and running row and column stats: softmax_stats.h). Threads share the plain forward's column
// groups, key tiles outer, so the outputs do not depend on the thread count. With the mask options the tile's
// masks are built once (softmax_masks.h) and every prefix's S^k takes the masked forward's steps
// (softmax_masked_stats.h); the symmetric loss's column positives are kept per positive group, as there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <memory>

#include "matryoshka.h"
#include "softmax_masked_stats.h"
#include "softmax_stats.h"

namespace infcl {
namespace softmax {
namespace {

// Every prefix's running stats of n rows (or of groups x n column partials), one store per prefix.
template <typename Acc>
std::vector<RunningStore<Acc>> prefix_stores(int64_t prefixes, int64_t n) {
  std::vector<RunningStore<Acc>> stores(prefixes);
  for (auto& store : stores) store.reset(n);
  return stores;
}

// One thread's forward work: its column groups' row tiles against one key tile at a time.
template <typename T>
class PrefixForward {
 public:
  struct Args {
    PrefixOperands<T> in;
    T* positives;  // [K, 3, bq]: row 2 of each prefix's block (the plain loss)
    const MaskArgs* masks;  // null: the plain loss
    bool symmetric;
  };

  explicit PrefixForward(const Args& a)
      : a_(a.in), positives_(a.positives), tk_(std::min(prefix_tile_k(a.masks), a_.bk)),
        keys_(a_.prefixes, /*scores=*/true, a_.tiles.size, tk_, a_.d), raw_(a_.tiles.size * tk_),
        s_(a_.tiles.size * tk_), stats_(a_.tiles.size, tk_) {
    if (a.masks) {
      masks_ = std::make_unique<TileMasks>(*a.masks, a_.tiles.size, tk_, a.symmetric);
      split_ = a.masks->has_guide() && a.symmetric;
    }
  }

  void set_keys(int64_t j0, int64_t nj) {
    keys_.set(a_.k + j0 * a_.d, nj, T(1));
    if (masks_) masks_->set_keys(j0, nj);
  }

  // Row tile t against key tile [j0, j0 + nj): rows[k] prefix k's running row stats, cols[k] its group's
  // running column partials at this key tile (max null: rows only).
  void tile(int64_t t, int64_t j0, int64_t nj, const std::vector<Running<T>>& rows,
            const std::vector<Running<T>>& cols) {
    const int64_t i0 = a_.tiles.begin(t), ni = a_.tiles.height(t);
    T* raw = raw_.data();
    T* s = s_.data();
    for (int64_t k = 0; k < a_.prefixes.count(); ++k) {
      keys_.product(k, ni, a_.q + i0 * a_.d + a_.prefixes.begin(k), a_.d, k ? T(1) : T(0), raw, nj);
      if (a_.prefixes.renormalize[k]) {
        scale_with_maxima<true>(raw, s, ni, nj, a_.scale, a_.factors(k, i0, j0), stats_.row_max(), stats_.col_max());
      } else {
        scale_with_maxima<false>(raw, s, ni, nj, a_.scale, {}, stats_.row_max(), stats_.col_max());
      }
      take_positives(s, ni, nj, a_.pos, i0, j0, positives_ + (3 * k + 2) * a_.bq);
      stats_.add_terms(s, ni, nj, rows[k].offset(i0), cols[k]);
    }
  }

  // The masked loss's tile: as tile(), the masks built once for every prefix, each S^k over the entries kept,
  // with prefix k's positives' partials of the tile's rows (row_pos[k], offset to the row tile) and of its
  // group's columns (col_pos[k], offset to the key tile).
  void masked_tile(int64_t t, int64_t j0, int64_t nj, const std::vector<Running<T>>& rows,
                   const std::vector<Running<T>>& cols, const std::vector<PositiveRun<T>>& row_pos,
                   const std::vector<PositiveRun<T>>& col_pos) {
    const int64_t i0 = a_.tiles.begin(t), ni = a_.tiles.height(t);
    T* raw = raw_.data();
    T* s = s_.data();
    masks_->build(a_.pos, i0, ni, j0, nj);
    const bool split = split_ && cols[0].max;
    for (int64_t k = 0; k < a_.prefixes.count(); ++k) {
      keys_.product(k, ni, a_.q + i0 * a_.d + a_.prefixes.begin(k), a_.d, k ? T(1) : T(0), raw, nj);
      if (a_.prefixes.renormalize[k]) {
        scale_masked<true>(split, raw, s, ni, nj, a_.factors(k, i0, j0));
      } else {
        scale_masked<false>(split, raw, s, ni, nj, {});
      }
      add_masked_terms<T>(s, ni, nj, *masks_, split, stats_, rows[k].offset(i0), cols[k], row_pos[k], col_pos[k]);
    }
  }

 private:
  template <bool renorm>
  void scale_masked(bool split, const T* raw, T* s, int64_t ni, int64_t nj, const TileFactors<T>& f) {
    if (split) {
      scale_mask_maxima<renorm, true, Kept::None>(raw, s, ni, nj, a_.scale, f, *masks_, stats_.row_max(),
                                                  stats_.col_max(), {});
    } else {
      scale_mask_maxima<renorm, false, Kept::None>(raw, s, ni, nj, a_.scale, f, *masks_, stats_.row_max(),
                                                   stats_.col_max(), {});
    }
  }

  PrefixOperands<T> a_;
  T* positives_;
  int64_t tk_;
  KeySegments<T> keys_;
  std::vector<T> raw_, s_;
  TileStats<T> stats_;
  std::unique_ptr<TileMasks> masks_;
  bool split_ = false;  // rows and columns exclude different entries (a guide with the columns wanted)
};

// Every prefix's positives' partials of n lines (the masked loss), "sum" with their log-sum-exp.
template <typename Acc>
std::vector<PositiveStore<Acc>> positive_stores(int64_t prefixes, int64_t n, bool lse_wanted) {
  std::vector<PositiveStore<Acc>> stores(prefixes);
  for (auto& store : stores) store.reset(n, lse_wanted);
  return stores;
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
                  const Prefixes& prefixes, const at::Tensor& q_factors, const at::Tensor& k_factors,
                  const MaskArgs* masks, at::Tensor& rows, at::Tensor& cols) {
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1), n = prefixes.count();
  const RowTiles tiles(bq);
  // Symmetric: every column group keeps K prefixes' partials (20 bytes per prefix and column), so the groups
  // share the plain forward's budget of MAX_COLUMN_GROUPS partials, which caps this forward at
  // MAX_COLUMN_GROUPS / K threads (12 at K = 5); one direction keeps none.
  const int64_t group_cap = symmetric ? std::max<int64_t>(1, MAX_COLUMN_GROUPS / n) : MAX_COLUMN_GROUPS;
  const int64_t groups = std::max<int64_t>(1, std::min(tiles.count, group_cap));
  const int64_t tk = std::min(prefix_tile_k(masks), bk);
  // The masked symmetric loss's column positives per positive group (softmax_masked_stats.h: a run of `span`
  // column groups), which the threads then take whole; 1 group each otherwise. As the column groups, the K
  // prefixes' positive partials share the masked forward's budget of MAX_POSITIVE_GROUPS, which caps this
  // forward at MAX_POSITIVE_GROUPS / K threads (5 at K = 3; measured at B = 16384, K = 3, "sum": 17 MiB of
  // positive partials uncapped, 1.4x one masked loss's peak).
  const int64_t positive_cap = std::max<int64_t>(1, MAX_POSITIVE_GROUPS / n);
  const int64_t span = masks && symmetric ? (groups + positive_cap - 1) / positive_cap : 1;
  const int64_t positive_groups = (groups + span - 1) / span;
  const bool lse_wanted = masks && masks->positives == Positives::Sum;
  auto row_run = prefix_stores<T>(n, bq);
  auto col_parts = prefix_stores<T>(n, symmetric ? groups * bk : 0);  // each [groups, bk]
  auto row_pos = positive_stores<T>(masks ? n : 0, bq, lse_wanted);
  auto col_pos_parts = positive_stores<T>(masks ? n : 0, symmetric ? positive_groups * bk : 0, lse_wanted);
  rows.zero_();  // the positives stay 0 where they lie in another block
  T* out = rows.data_ptr<T>();
  const typename PrefixForward<T>::Args args{{{q.data_ptr<T>(), k.data_ptr<T>(), bq, bk, d, tiles,
                                              static_cast<T>(scale), pos.data_ptr<int64_t>()}, prefixes,
                                              q_factors.data_ptr<T>(), k_factors.data_ptr<T>()},
                                             out, masks, symmetric};
  std::vector<Running<T>> row_lines(n);
  for (int64_t p = 0; p < n; ++p) row_lines[p] = row_run[p].at(0);
  at::parallel_for(0, positive_groups, 1, [&](int64_t p_begin, int64_t p_end) {
    const int64_t g_begin = p_begin * span, g_end = std::min(groups, p_end * span);
    const SingleThreadedBlas one_thread;
    PrefixForward<T> work(args);
    std::vector<Running<T>> col_lines(n, Running<T>{nullptr, nullptr, nullptr});
    std::vector<PositiveRun<T>> row_pos_lines(masks ? n : 0), col_pos_lines(masks ? n : 0);
    for (int64_t j0 = 0; j0 < bk; j0 += tk) {
      const int64_t nj = std::min(tk, bk - j0);
      work.set_keys(j0, nj);
      for (int64_t g = g_begin; g < g_end; ++g) {
        for (int64_t p = 0; p < n && symmetric; ++p) col_lines[p] = col_parts[p].at(g * bk + j0);
        for (int64_t p = 0; p < n && masks && symmetric; ++p) {
          col_pos_lines[p] = PositiveRun<T>::at(col_pos_parts[p], g / span * bk + j0);
        }
        for (int64_t t = group_start(tiles.count, groups, g); t < group_start(tiles.count, groups, g + 1); ++t) {
          if (!masks) {
            work.tile(t, j0, nj, row_lines, col_lines);
            continue;
          }
          for (int64_t p = 0; p < n; ++p) row_pos_lines[p] = PositiveRun<T>::at(row_pos[p], tiles.begin(t));
          work.masked_tile(t, j0, nj, row_lines, col_lines, row_pos_lines, col_pos_lines);
        }
      }
    }
  });
  const int64_t line_rows = masks ? MASKED_ROWS : 3;  // rows [K, 3 or MASKED_ROWS, bq]
  const int64_t col_rows = masks ? MASKED_ROWS : 2;
  for (int64_t p = 0; p < n; ++p) {
    T* line = out + line_rows * p * bq;
    for (int64_t i = 0; i < bq; ++i) {
      line[i] = row_run[p].max[i];
      line[bq + i] = log_rel(row_run[p].max[i], row_run[p].top[i], row_run[p].rest[i]);
    }
    T* col_line = symmetric ? cols.data_ptr<T>() + col_rows * p * bk : nullptr;
    if (symmetric) merge_column_partials(col_parts[p], groups, bk, col_line);
    if (!masks) continue;
    merge_positive_partials(row_pos[p], 1, bq, lse_wanted, line + 2 * bq);
    if (symmetric) merge_positive_partials(col_pos_parts[p], positive_groups, bk, lse_wanted, col_line + 2 * bk);
  }
}

}  // namespace

void matryoshka_forward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                        bool symmetric, const Prefixes& prefixes, const at::Tensor& q_factors,
                        const at::Tensor& k_factors, const MaskArgs* masks, at::Tensor& rows, at::Tensor& cols) {
  if (q.scalar_type() == at::kDouble) {
    forward_impl<double>(q, k, scale, pos, symmetric, prefixes, q_factors, k_factors, masks, rows, cols);
  } else {
    forward_impl<float>(q, k, scale, pos, symmetric, prefixes, q_factors, k_factors, masks, rows, cols);
  }
}

}  // namespace softmax
}  // namespace infcl
