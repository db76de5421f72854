// The Matryoshka softmax loss's backward (matryoshka.h). Per tile: every prefix's raw^k, grown segment by
// segment as the forward grows it (one buffer per prefix); then, widest prefix first, S^k, its dS^k by the
// plain backward's row pass (softmax_grads.h: ds_row, in place over raw^k), the renormalization's sums
// c^k = sum dS^k * S^k per row and column, and W += dS^k * a^k_i * b^k_j, whose products with segment k's
// columns are dq's and dk's share of that segment: W then holds every prefix that includes the segment.
// After the tiles, the normalization's own gradient, -(a^k)^2 c^k x[:m_k] per renormalized prefix.
//
// With the mask options the tile's masks are built once for every prefix (softmax_masks.h) and each dS^k is the
// masked backward's (softmax_masked_grads.h: ds_masked_row, with prefix k's positives' count or stats).
//
// Threads: the plain backward's lanes (dq rows per lane, dk and the column sums per lane, merged in lane
// order), so the results depend on the backward's thread count, never on scheduling.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "matryoshka.h"
#include "softmax_grads.h"
#include "softmax_masked_grads.h"
#include "softmax_stats.h"

namespace infcl {
namespace softmax {
namespace {

// u = raw * a_i * b_j in place (the product scale_with_maxima forms) and S = u * scale: a renormalized
// prefix's tile, as the forward rounds it.
template <typename T>
void scale_prefix_tile(T* u, T* s, int64_t ni, int64_t nj, T sc, const TileFactors<T>& f) {
  for (int64_t r = 0; r < ni; ++r) {
    T* ur = u + r * nj;
    T* sr = s + r * nj;
    const T a = f.row[r];
#pragma omp simd
    for (int64_t c = 0; c < nj; ++c) {
      const T v = prefix_product<true>(ur[c], a, f.col, c);
      ur[c] = v;
      sr[c] = v * sc;
    }
  }
}

// One row of add_prefix_gradient: W (+)= dS * a * b_j, returning the row's sum of dS * S (renorm), its
// columns' added to col_c. Separate loops for W = and W += (first), so that each vectorizes.
template <bool renorm, bool first, typename T>
inline T prefix_gradient_row(const T* dr, const T* sr, int64_t nj, T a, const T* b, T* wr, T* col_c) {
  T rc = 0;
#pragma omp simd reduction(+ : rc)
  for (int64_t c = 0; c < nj; ++c) {
    T v = dr[c];
    if constexpr (renorm) {
      const T ds_s = v * sr[c];
      rc += ds_s;
      col_c[c] += ds_s;
      v = (v * a) * b[c];
    }
    if constexpr (first) {
      wr[c] = v;
    } else {
      wr[c] += v;
    }
  }
  return rc;
}

// W (+)= dS * a_i * b_j (first: W = ...), and for a renormalized prefix the normalization's sums
// c = sum dS * S of each row (row_c) and column (col_c, nj partial sums of this tile).
template <bool renorm, typename T>
void add_prefix_gradient(const T* ds, const T* s, int64_t ni, int64_t nj, const TileFactors<T>& f, bool first,
                         T* w, double* row_c, T* col_c) {
  for (int64_t r = 0; r < ni; ++r) {
    const int64_t at = r * nj;
    const T a = renorm ? f.row[r] : T(1);
    const T rc = first ? prefix_gradient_row<renorm, true>(ds + at, s + at, nj, a, f.col, w + at, col_c)
                       : prefix_gradient_row<renorm, false>(ds + at, s + at, nj, a, f.col, w + at, col_c);
    if constexpr (renorm) row_c[r] += rc;
  }
}

// One lane's backward: dq of its rows, dk (lane 0) or a dk partial, its column sums, its two dscale sums.
template <typename T>
class PrefixBackwardLane {
 public:
  struct Args {
    PrefixOperands<T> in;
    const T* row_stats;  // [2, K, bq]
    const T* g_row;      // [K, bq]
    const T* col_stats;  // [2, K, bk] or nullptr (one direction)
    const T* g_col;
    T* dq;
    double* row_c;  // [K, bq] the rows' normalization sums (each row belongs to one lane)
    // The masked loss (null: the plain loss), with each side's positives of every prefix: count [K, n]
    // ("mean") or stats [2, K, n] ("sum"; rel at max + K * n).
    const MaskArgs* masks = nullptr;
    PositiveGrads<T> row_pos{}, col_pos{};
  };

  explicit PrefixBackwardLane(const Args& a)
      : a_(a.in), g_(a), tk_(std::min(prefix_tile_k(a.masks), a_.bk)),
        keys_(a_.prefixes, /*scores=*/true, a_.tiles.size, tk_, a_.d),
        grads_(a_.prefixes, /*scores=*/false, a_.tiles.size, tk_, a_.d),
        raws_(a_.prefixes.count(), std::vector<T>(a_.tiles.size * tk_)), s_(a_.tiles.size * tk_),
        w_(a_.tiles.size * tk_), col_sums_(tk_), shared_(tk_) {
    if (a.masks) masks_ = std::make_unique<TileMasks>(*a.masks, a_.tiles.size, tk_, a.col_stats != nullptr);
  }

  // Row tiles [t_begin, t_end) into dk ([bk, d]) and col_c ([K, bk]); returns the two parts of dscale.
  std::pair<double, double> run(int64_t t_begin, int64_t t_end, T* dk, double* col_c) {
    double lane_row = 0.0, lane_col = 0.0;
    for (int64_t j0 = 0; j0 < a_.bk; j0 += tk_) {
      const int64_t nj = std::min(tk_, a_.bk - j0);
      keys_.set(a_.k + j0 * a_.d, nj, T(1));
      grads_.set(a_.k + j0 * a_.d, nj, a_.scale);  // scale * k_j[:, seg], for dq_i += W @ k_j
      if (masks_) masks_->set_keys(j0, nj);
      for (int64_t t = t_begin; t < t_end; ++t) {
        const auto parts = tile(a_.tiles.begin(t), a_.tiles.height(t), j0, nj, dk, col_c);
        lane_row += parts.first;
        lane_col += parts.second;
      }
    }
    return {lane_row, lane_col};
  }

 private:
  std::pair<double, double> tile(int64_t i0, int64_t ni, int64_t j0, int64_t nj, T* dk, double* col_c) {
    const Prefixes& p = a_.prefixes;
    const int64_t n = p.count();
    for (int64_t k = 0; k < n; ++k) {  // raw^k, each product as the forward's running one
      if (k) std::copy(raws_[k - 1].begin(), raws_[k - 1].begin() + ni * nj, raws_[k].begin());
      keys_.product(k, ni, a_.q + i0 * a_.d + p.begin(k), a_.d, k ? T(1) : T(0), raws_[k].data(), nj);
    }
    if (masks_) masks_->build(a_.pos, i0, ni, j0, nj);  // once for every prefix
    double tile_row = 0.0, tile_col = 0.0;
    T* s = s_.data();
    T* w = w_.data();
    for (int64_t k = n - 1; k >= 0; --k) {
      T* u = raws_[k].data();  // raw^k, then u^k, then dS^k
      const bool renorm = p.renormalize[k];
      const TileFactors<T> f = a_.factors(k, i0, j0);
      if (renorm) {
        scale_prefix_tile(u, s, ni, nj, a_.scale, f);
      } else {
        scale_tile(u, s, ni * nj, a_.scale);
      }
      const auto parts = prefix_ds(k, i0, ni, j0, nj, u, s);
      tile_row += parts.first;
      tile_col += parts.second;
      T* col_sums = col_sums_.data();
      if (renorm && p.dims[k] == 1) {
        // A one-wide renormalized prefix: S = scale * sign(q_0) * sign(k_0), whose gradient of the features is
        // exactly 0 (infcl.matryoshka.Prefixes.sign_only); formed, it would be the difference of two equal
        // sums of size |g| / |x_0| that cancel only to their rounding. Nothing joins W or the sums.
        if (k == n - 1) std::fill(w, w + ni * nj, T(0));
      } else if (renorm) {
        std::fill(col_sums, col_sums + nj, T(0));
        add_prefix_gradient<true>(u, s, ni, nj, f, k == n - 1, w, g_.row_c + k * a_.bq + i0, col_sums);
        double* cc = col_c + k * a_.bk + j0;
        for (int64_t c = 0; c < nj; ++c) cc[c] += col_sums[c];
      } else {
        add_prefix_gradient<false, T>(u, s, ni, nj, f, k == n - 1, w, nullptr, nullptr);
      }
      // Segment k's share: dq_i[:, seg] += scale * W @ k_j[:, seg], dk_j[:, seg] += scale * W.T @ q_i[:, seg].
      grads_.product(k, ni, w, nj, T(1), g_.dq + i0 * a_.d + p.begin(k), a_.d);
      gemm(true, false, nj, p.width(k), ni, a_.scale, w, nj, a_.q + i0 * a_.d + p.begin(k), a_.d, T(1),
           dk + j0 * a_.d + p.begin(k), a_.d);
    }
    return {tile_row, tile_col};
  }

  // Prefix k's dS over the tile, in place over u (ds_row, the plain backward's row pass), with its stats.
  std::pair<double, double> prefix_ds(int64_t k, int64_t i0, int64_t ni, int64_t j0, int64_t nj, T* u,
                                      const T* s) {
    const T* row_m = g_.row_stats + k * a_.bq;
    const T* row_rel = g_.row_stats + (a_.prefixes.count() + k) * a_.bq;
    const T* g_row = g_.g_row + k * a_.bq;
    ColGrads<T> col;
    if (g_.col_stats) {
      col = {g_.col_stats + k * a_.bk + j0, g_.col_stats + (a_.prefixes.count() + k) * a_.bk + j0,
             g_.g_col + k * a_.bk + j0};
    }
    const bool shared = kOneExp<T> && g_.col_stats && shared_.prepare(row_m + i0, row_rel + i0, ni, col, nj);
    if (shared) col.factor = shared_.col_factors();
    double tile_row = 0.0, tile_col = 0.0;
    const PositiveGrads<T> row_pos = prefix_positives(g_.row_pos, k, a_.bq).offset(i0);
    const PositiveGrads<T> col_pos = prefix_positives(g_.col_pos, k, a_.bk).offset(j0);
    for (int64_t r = 0; r < ni; ++r) {
      const int64_t i = i0 + r;
      const RowGrad<T> row{row_m[i], row_rel[i], g_row[i]};
      const int64_t c = positive_in_tile(a_.pos, i, j0, nj);
      T* u_r = u + r * nj;
      const T* s_r = s + r * nj;
      T acc_row = 0, acc_col = 0;
      if (masks_) {
        masked_row(r, nj, u_r, s_r, row, shared, col, row_pos, col_pos, acc_row, acc_col);
      } else if (!g_.col_stats) {
        ds_row<Terms::Rows>(nj, c, u_r, s_r, u_r, row, T(0), col, acc_row, acc_col);
      } else if (shared) {
        ds_row<Terms::BothShared>(nj, c, u_r, s_r, u_r, row, shared_.row_factor(row.m, row.rel), col, acc_row,
                                  acc_col);
      } else {
        ds_row<Terms::Both>(nj, c, u_r, s_r, u_r, row, T(0), col, acc_row, acc_col);
      }
      tile_row += acc_row;
      tile_col += acc_col;
    }
    return {tile_row, tile_col};
  }

  // Row r of a masked tile: ds_masked_row (in place over u, as ds_row) with prefix k's positives.
  void masked_row(int64_t r, int64_t nj, T* u_r, const T* s_r, const RowGrad<T>& row, bool shared,
                  const ColGrads<T>& col, const PositiveGrads<T>& row_pos, const PositiveGrads<T>& col_pos,
                  T& acc_row, T& acc_col) {
    if (!g_.col_stats) {
      ds_masked_row<Terms::Rows, false>(nj, *masks_, r, u_r, s_r, u_r, row, T(0), col, row_pos, col_pos, acc_row,
                                        acc_col);
    } else if (shared) {
      ds_masked_row<Terms::BothShared, false>(nj, *masks_, r, u_r, s_r, u_r, row, shared_.row_factor(row.m, row.rel),
                                              col, row_pos, col_pos, acc_row, acc_col);
    } else {
      ds_masked_row<Terms::Both, false>(nj, *masks_, r, u_r, s_r, u_r, row, T(0), col, row_pos, col_pos, acc_row,
                                        acc_col);
    }
  }

  // Prefix k's view of every prefix's positives (n lines each).
  PositiveGrads<T> prefix_positives(const PositiveGrads<T>& all, int64_t k, int64_t n) const {
    const int64_t count = a_.prefixes.count();
    return {all.count ? all.count + k * n : nullptr, all.max ? all.max + k * n : nullptr,
            all.max ? all.max + (count + k) * n : nullptr};
  }

  PrefixOperands<T> a_;
  Args g_;  // the upstream stats and gradients, and what it accumulates into
  int64_t tk_;
  KeySegments<T> keys_, grads_;
  std::vector<std::vector<T>> raws_;
  std::vector<T> s_, w_, col_sums_;
  SharedRef<T> shared_;
  std::unique_ptr<TileMasks> masks_;
};

// Every prefix's positives of one side (count [K, n] or stats [2, K, n]; undefined: none), as the lanes read them.
template <typename T>
PositiveGrads<T> prefix_positive_grads(const PositiveInputs& in) {
  PositiveGrads<T> out;
  if (in.count.defined()) out.count = in.count.data_ptr<T>();
  if (in.stats.defined()) out.max = in.stats.data_ptr<T>();
  return out;
}

// dx[:, :m_k] -= (a^k)^2 c^k x[:, :m_k] for every renormalized prefix k: per segment s, one factor
// sum_(k >= s) of the row's weights times x's segment. x, dx: [n, d]; factors [2, K, n]; c [K, n].
template <typename T>
void add_normalization_gradient(const T* x, int64_t n, int64_t d, const Prefixes& p, const T* factors,
                                const double* c, T* dx) {
  const int64_t count = p.count();
  const T* weight = factors + count * n;  // row 1: (a^k)^2, or 0
  at::parallel_for(0, n, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      double f = 0.0;
      for (int64_t k = count - 1; k >= 0; --k) {
        f += static_cast<double>(weight[k * n + i]) * c[k * n + i];
        const T fk = static_cast<T>(f);
        const T* xs = x + i * d + p.begin(k);
        T* ds = dx + i * d + p.begin(k);
#pragma omp simd
        for (int64_t e = 0; e < p.width(k); ++e) ds[e] -= fk * xs[e];
      }
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                   const Prefixes& prefixes, const at::Tensor& q_factors, const at::Tensor& k_factors,
                   const at::Tensor& row_stats, const at::Tensor& g_row, const at::Tensor& col_stats,
                   const at::Tensor& g_col, const MaskArgs* masks, const PositiveInputs& row_pos,
                   const PositiveInputs& col_pos, at::Tensor& dq, at::Tensor& dk, at::Tensor& dscale) {
  const bool both = col_stats.defined();
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1), n = prefixes.count();
  const RowTiles tiles(bq);
  const int64_t lanes = lane_count(tiles);
  std::vector<double> row_c(n * bq, 0.0), col_c(lanes * n * bk, 0.0);  // col_c: [lanes, K, bk]
  const typename PrefixBackwardLane<T>::Args args{{{q.data_ptr<T>(), k.data_ptr<T>(), bq, bk, d, tiles,
                                                   static_cast<T>(scale), pos.data_ptr<int64_t>()}, prefixes,
                                                   q_factors.data_ptr<T>(), k_factors.data_ptr<T>()},
                                                  row_stats.data_ptr<T>(),
                                                  g_row.data_ptr<T>(),
                                                  both ? col_stats.data_ptr<T>() : nullptr,
                                                  both ? g_col.data_ptr<T>() : nullptr,
                                                  dq.data_ptr<T>(),
                                                  row_c.data(),
                                                  masks,
                                                  prefix_positive_grads<T>(row_pos),
                                                  prefix_positive_grads<T>(col_pos)};
  // Lane 0 accumulates straight into dk, every other lane into its own [Bk, D] partial.
  at::Tensor dk_parts = lanes > 1 ? at::zeros({lanes - 1, bk, d}, dk.options()) : at::Tensor();
  std::vector<std::pair<double, double>> parts(lanes);
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    const SingleThreadedBlas one_thread;
    PrefixBackwardLane<T> work(args);
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      T* dkp = lane == 0 ? dk.data_ptr<T>() : dk_parts[lane - 1].data_ptr<T>();
      parts[lane] = work.run(lane_start(tiles, lanes, lane), lane_start(tiles, lanes, lane + 1), dkp,
                             col_c.data() + lane * n * bk);
    }
  });
  for (int64_t lane = 1; lane < lanes; ++lane) {
    dk.add_(dk_parts[lane - 1]);
    for (int64_t e = 0; e < n * bk; ++e) col_c[e] += col_c[lane * n * bk + e];
  }
  add_normalization_gradient(q.data_ptr<T>(), bq, d, prefixes, q_factors.data_ptr<T>(), row_c.data(),
                             dq.data_ptr<T>());
  add_normalization_gradient(k.data_ptr<T>(), bk, d, prefixes, k_factors.data_ptr<T>(), col_c.data(),
                             dk.data_ptr<T>());
  write_dscale(parts, dscale);
}

}  // namespace

void matryoshka_backward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                         const Prefixes& prefixes, const at::Tensor& q_factors, const at::Tensor& k_factors,
                         const at::Tensor& row_stats, const at::Tensor& g_row, const at::Tensor& col_stats,
                         const at::Tensor& g_col, const MaskArgs* masks, const PositiveInputs& row_pos,
                         const PositiveInputs& col_pos, at::Tensor& dq, at::Tensor& dk, at::Tensor& dscale) {
  if (q.scalar_type() == at::kDouble) {
    backward_impl<double>(q, k, scale, pos, prefixes, q_factors, k_factors, row_stats, g_row, col_stats, g_col, masks,
                          row_pos, col_pos, dq, dk, dscale);
  } else {
    backward_impl<float>(q, k, scale, pos, prefixes, q_factors, k_factors, row_stats, g_row, col_stats, g_col, masks,
                         row_pos, col_pos, dq, dk, dscale);
  }
}

}  // namespace softmax
}  // namespace infcl
