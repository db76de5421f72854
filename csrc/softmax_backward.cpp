// The softmax loss's backward (softmax.h: backward()). Per tile: raw once (RawTiles, the forward's route),
// S = raw * scale (scale_tile), then per row the dS pass over the columns on either side of the row's
// positive (ds_span), the positive itself (ds_positive), then dq_i += scale * dS @ k_j and
// dk_j += scale * dS.T @ q_i.
//
// The row tiles are cut into `lanes` contiguous ranges (one per thread), each walking key tiles outer; dq
// rows belong to one lane, dk is kept per lane and merged in lane order at the end, so dk and dscale depend
// on the backward's own thread count (never on scheduling): bit-identical run to run, and to a run whose
// forward had another thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "softmax.h"
#include "softmax_grads.h"
#include "softmax_masked_grads.h"

namespace infcl {
namespace softmax {
namespace {

// One lane's backward: dq of its rows, dk (lane 0) or a dk partial, and its two dscale sums.
template <typename In>
class BackwardLane {
 public:
  using Acc = typename Types<In>::acc;
  using DS = typename Types<In>::ds;

  struct Args : BlockOperands<In, Acc> {
    const Acc* row_stats;  // [2, bq]
    const Acc* g_row;
    const Acc* col_stats;  // [2, bk] or nullptr (one direction)
    const Acc* g_col;
    Acc* dq;
    // The masked loss (null: the plain loss), with the rows' and columns' global positives.
    const MaskArgs* masks = nullptr;
    PositiveGrads<Acc> row_pos{}, col_pos{};
    // Label smoothing's uniform weights ([bq], and [bk] with col_stats; null: none), masked loss only.
    const Acc* row_uniform = nullptr;
    const Acc* col_uniform = nullptr;
    // bfloat16 on the Brgemm route: dq above and each lane's dk are accumulated without the scale (brgemm
    // has no alpha; backward_impl applies it once at the end), dk transposed ([d, bk]); q_t is q.T
    // ([d, ld_t], zero past column bq).
    bool brgemm = false;
    const In* q_t = nullptr;
    int64_t ld_t = 0;
  };

  explicit BackwardLane(const Args& a)
      : a_(a), tk_(std::min(TILE_K, a.bk)), raw_tiles_(a.tiles.size, tk_, a.d, a.brgemm, /*backward=*/true),
        k_tile_(/*tb=*/false, a.tiles.size, a.d, tk_), raw_(a.tiles.size * tk_), s_(a.tiles.size * tk_),
        ds_buf_(std::is_same<DS, Acc>::value ? 0 : a.tiles.size * round_up_even(tk_)), shared_(tk_) {
    if (a.masks) masks_ = std::make_unique<TileMasks>(*a.masks, a.tiles.size, tk_, a.col_stats != nullptr);
  }

  // Row tiles [t_begin, t_end), accumulating into dk ([bk, d]); returns (row part, column part) of dscale.
  std::pair<double, double> run(int64_t t_begin, int64_t t_end, Acc* dk) {
    double lane_row = 0.0, lane_col = 0.0;
    for (int64_t j0 = 0; j0 < a_.bk; j0 += tk_) {
      const int64_t nj = std::min(tk_, a_.bk - j0);
      raw_tiles_.set_keys(a_.k + j0 * a_.d, nj);
      if (masks_) masks_->set_keys(j0, nj);
      k_tile_.set(a_.k + j0 * a_.d, a_.d, a_.d, nj, a_.scale);  // scale * k_j, for dq_i += dS @ k_j
      for (int64_t t = t_begin; t < t_end; ++t) {
        const auto parts = tile(a_.tiles.begin(t), a_.tiles.height(t), j0, nj, dk);
        lane_row += parts.first;
        lane_col += parts.second;
      }
    }
    return {lane_row, lane_col};
  }

 private:
  std::pair<double, double> tile(int64_t i0, int64_t ni, int64_t j0, int64_t nj, Acc* dk) {
    Acc* raw = raw_.data();
    Acc* s = s_.data();
    // float32 / float64 write dS over raw (each entry is read before it is written); bfloat16 to ds_buf_,
    // in rows of an even length (brgemm multiplies over an even depth), zero past column nj.
    DS* ds = ds_buf_.empty() ? reinterpret_cast<DS*>(raw) : ds_buf_.data();
    const int64_t ld_ds = ds_buf_.empty() ? nj : round_up_even(nj);
    raw_tiles_.product(a_.q + i0 * a_.d, ni, raw, nj);
    scale_tile(raw, s, ni * nj, a_.scale);
    ColGrads<Acc> col;
    if (a_.col_stats) col = {a_.col_stats + j0, a_.col_stats + a_.bk + j0, a_.g_col + j0};
    if (a_.col_uniform) col.u = a_.col_uniform + j0;
    const bool shared =
        kOneExp<In> && a_.col_stats && shared_.prepare(a_.row_stats + i0, a_.row_stats + a_.bq + i0, ni, col, nj);
    if (shared) col.factor = shared_.col_factors();
    if (masks_) masks_->build(a_.pos, i0, ni, j0, nj);
    double tile_row = 0.0, tile_col = 0.0;
    for (int64_t r = 0; r < ni; ++r) {
      const int64_t i = i0 + r;
      const RowGrad<Acc> row{a_.row_stats[i], a_.row_stats[a_.bq + i], a_.g_row[i],
                             a_.row_uniform ? a_.row_uniform[i] : Acc(0)};
      Acc acc_row = 0, acc_col = 0;
      const Acc* raw_r = raw + r * nj;
      const Acc* s_r = s + r * nj;
      DS* ds_r = ds + r * ld_ds;
      if (ld_ds != nj) ds_r[nj] = DS(0);
      if (!a_.col_stats) {
        row_terms<Terms::Rows>(r, i, j0, nj, raw_r, s_r, ds_r, row, Acc(0), col, acc_row, acc_col);
      } else if (shared) {
        row_terms<Terms::BothShared>(r, i, j0, nj, raw_r, s_r, ds_r, row, shared_.row_factor(row.m, row.rel), col,
                                     acc_row, acc_col);
      } else {
        row_terms<Terms::Both>(r, i, j0, nj, raw_r, s_r, ds_r, row, Acc(0), col, acc_row, acc_col);
      }
      tile_row += acc_row;
      tile_col += acc_col;
    }
    if constexpr (std::is_same<In, at::BFloat16>::value) {
      if (BrgemmKeyTile* b = raw_tiles_.brgemm_tile()) {
        b->add_dq(ds, ld_ds, ni, a_.dq + i0 * a_.d, a_.d);
        b->add_dk_t(a_.q_t + i0, a_.ld_t, ds, ld_ds, ni, dk + j0, a_.bk);
        return {tile_row, tile_col};
      }
    }
    k_tile_.product(ni, ds, ld_ds, Acc(1), a_.dq + i0 * a_.d, a_.d);
    gemm(true, false, nj, a_.d, ni, a_.scale, ds, ld_ds, a_.q + i0 * a_.d, a_.d, Acc(1), dk + j0 * a_.d, a_.d);
    return {tile_row, tile_col};
  }

  // Row r (global row i) of the tile at key column j0: the plain loss's dS row, or the masked one. A masked
  // row that is the plain loss's (plain_positive) takes ds_row at the plain loss's own call site, so that
  // the compiler cannot lay out its reductions differently: distinct ids give the plain loss bit for bit.
  // With uniform weights every row is masked (each kept entry takes its weight).
  template <Terms terms>
  void row_terms(int64_t r, int64_t i, int64_t j0, int64_t nj, const Acc* raw_r, const Acc* s_r, DS* ds_r,
                 const RowGrad<Acc>& row, Acc row_factor, const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
    if (a_.row_uniform) {
      ds_masked_row<terms, true>(nj, *masks_, r, raw_r, s_r, ds_r, row, row_factor, col, a_.row_pos.offset(i - r),
                                 a_.col_pos.offset(j0), acc_row, acc_col);
      return;
    }
    const int64_t p = masks_ ? plain_positive(r, i, j0, s_r) : positive_in_tile(a_.pos, i, j0, nj);
    if (p == kNotPlain) {
      ds_masked_row<terms, false>(nj, *masks_, r, raw_r, s_r, ds_r, row, row_factor, col, a_.row_pos.offset(i - r),
                                  a_.col_pos.offset(j0), acc_row, acc_col);
      return;
    }
    ds_row<terms>(nj, p, raw_r, s_r, ds_r, row, row_factor, col, acc_row, acc_col);
  }

  // The tile column of masked row r's positive (-1: none in the tile) when the row is the plain loss's:
  // nothing excluded, at most one positive here, and its P - Y Label's (positive_term: "mean" with one
  // positive in all, "sum" with pm = S and pr = 0), in the column direction too; else kNotPlain.
  static constexpr int64_t kNotPlain = -2;
  int64_t plain_positive(int64_t r, int64_t i, int64_t j0, const Acc* s_r) const {
    const int64_t* first = masks_->positives_begin(r);
    const int64_t* last = masks_->positives_end(r);
    if (masks_->any(r) || last - first > 1) return kNotPlain;
    if (first == last) return -1;
    const int64_t c = *first;
    const bool cols = a_.col_stats != nullptr;
    auto lone = [&](const PositiveGrads<Acc>& y, int64_t t) {
      return masks_->kind() == Positives::Mean ? y.count[t] == Acc(1) : (y.max[t] == s_r[c] && y.rel[t] == Acc(0));
    };
    if (masks_->kind() == Positives::Label || (lone(a_.row_pos, i) && (!cols || lone(a_.col_pos, j0 + c)))) return c;
    return kNotPlain;
  }

  Args a_;
  int64_t tk_;
  RawTiles<In> raw_tiles_;
  ReusedB<DS, In, Acc> k_tile_;
  std::vector<Acc> raw_, s_;
  std::vector<DS> ds_buf_;
  SharedRef<Acc> shared_;
  std::unique_ptr<TileMasks> masks_;
};

// masks: null for the plain loss; else the masked loss's inputs, with each side's positives (row_pos [bq],
// col_pos [bk]).
template <typename In>
void backward_impl(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                   const at::Tensor& row_stats, const at::Tensor& g_row, const at::Tensor& col_stats,
                   const at::Tensor& g_col, at::Tensor& dq, at::Tensor& dk, at::Tensor& dscale, bool brgemm,
                   const MaskArgs* masks, const PositiveInputs& row_pos, const PositiveInputs& col_pos,
                   const at::Tensor& row_uniform, const at::Tensor& col_uniform) {
  using Acc = typename Types<In>::acc;
  const bool both = col_stats.defined();
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  const RowTiles tiles(bq);
  const int64_t lanes = lane_count(tiles);
  typename BackwardLane<In>::Args args{{q.data_ptr<In>(), k.data_ptr<In>(), bq, bk, d, tiles,
                                        static_cast<Acc>(scale), pos.data_ptr<int64_t>()},
                                       row_stats.data_ptr<Acc>(), g_row.data_ptr<Acc>(),
                                       both ? col_stats.data_ptr<Acc>() : nullptr,
                                       both ? g_col.data_ptr<Acc>() : nullptr, dq.data_ptr<Acc>()};
  args.masks = masks;
  args.row_pos = positive_grads<Acc>(row_pos);
  args.col_pos = positive_grads<Acc>(col_pos);
  if (row_uniform.defined()) args.row_uniform = row_uniform.data_ptr<Acc>();
  if (col_uniform.defined()) args.col_uniform = col_uniform.data_ptr<Acc>();
  // Lane 0 accumulates straight into dk; every other lane into its own [Bk, D] partial. Brgemm: every
  // lane into its own [D, Bk] partial and dq into dq_unscaled, q's row length d (even) possibly one past
  // the caller's D, the scale applied once when they join dq and dk.
  at::Tensor dq_unscaled, q_t, dk_parts;
  if (brgemm) {
    dq_unscaled = at::zeros({bq, d}, dq.options());
    q_t = transposed_pairs_operand(q);
    args.dq = dq_unscaled.data_ptr<Acc>();
    args.brgemm = true;
    args.q_t = q_t.data_ptr<In>();
    args.ld_t = q_t.size(1);
    dk_parts = at::zeros({lanes, d, bk}, dk.options());
  } else if (lanes > 1) {
    dk_parts = at::zeros({lanes - 1, bk, d}, dk.options());
  }
  std::vector<std::pair<double, double>> parts(lanes);
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    const SingleThreadedBlas one_thread;
    BackwardLane<In> work(args);
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      Acc* dkp = brgemm ? dk_parts[lane].data_ptr<Acc>()
                        : (lane == 0 ? dk.data_ptr<Acc>() : dk_parts[lane - 1].data_ptr<Acc>());
      parts[lane] = work.run(lane_start(tiles, lanes, lane), lane_start(tiles, lanes, lane + 1), dkp);
    }
  });
  if (brgemm) {
    for (int64_t p = 1; p < lanes; ++p) dk_parts[0].add_(dk_parts[p]);
    dq.add_(dq_unscaled.narrow(1, 0, dq.size(1)), scale);
    dk.add_(dk_parts[0].narrow(0, 0, dk.size(1)).t(), scale);
  } else {
    for (int64_t p = 1; p < lanes; ++p) dk.add_(dk_parts[p - 1]);
  }
  write_dscale(parts, dscale);
}

}  // namespace

void backward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
              const at::Tensor& row_stats, const at::Tensor& g_row, const at::Tensor& col_stats,
              const at::Tensor& g_col, at::Tensor& dq, at::Tensor& dk, at::Tensor& dscale, bool brgemm,
              const MaskArgs* masks, const PositiveInputs& row_pos, const PositiveInputs& col_pos,
              const at::Tensor& row_uniform, const at::Tensor& col_uniform) {
  switch (q.scalar_type()) {
#define INFCL_BACKWARD(T)                                                                                     \
  backward_impl<T>(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk, dscale, brgemm, masks, row_pos, \
                   col_pos, row_uniform, col_uniform)
    case at::kFloat: INFCL_BACKWARD(float); break;
    case at::kDouble: INFCL_BACKWARD(double); break;
    case at::kBFloat16: INFCL_BACKWARD(at::BFloat16); break;
#undef INFCL_BACKWARD
    default: TORCH_CHECK(false, "infcl native: unreachable dtype");
  }
}

}  // namespace softmax
}  // namespace infcl
