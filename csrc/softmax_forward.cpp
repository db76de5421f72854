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
#include "softmax_masked_stats.h"
#include "softmax_stats.h"

namespace infcl {
namespace softmax {
namespace {

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
    add_masked_terms<In>(s, ni, nj, *masks_, split, stats_, rows, cols, row_pos, col_pos);
  }

 private:
  template <Kept kept>
  void scale_and_mask(bool split, Acc* s, int64_t ni, int64_t nj) {
    if (split) {
      softmax::scale_mask_maxima<false, true, kept>(s, s, ni, nj, sc_, {}, *masks_, stats_.row_max(),
                                                    stats_.col_max(), kept_);
    } else {
      softmax::scale_mask_maxima<false, false, kept>(s, s, ni, nj, sc_, {}, *masks_, stats_.row_max(),
                                                     stats_.col_max(), kept_);
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
