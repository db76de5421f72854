// infcl native CPU kernel for the distillation loss (infcl/losses/distill.py has the math and the partials;
// infcl/backends/torch_tiles/distill.py the torch tiles' version): per block, the student's S = scale * q @ k.T
// beside the teacher's T = teacher_scale * tq @ tk.T, tile by tile, never whole.
//
//   distill_forward_block(q [Bq,D], k [Bk,D], scale, tq [Bq,DT], tk [Bk,DT], teacher_scale, symmetric)
//       -> (rows [5,Bq], cols [5,Bk] or [5,0])
//     per row (column) over the block: (m, r, mT, rT, cross): the student's stats (max, log1p(rest)), the
//     teacher's, and cross = sum_j exp(T - mT) * (m - S), relative to the block's own maxima.
//   distill_backward_block(q, k, scale, tq, tk, teacher_scale, row_stats [4,Bq], g_row [Bq], col_stats? [4,Bk],
//       g_col? [Bk], dq!, dk!) -> dscale [2] (the rows' part, the columns' part)
//     with the global (m, r, mT, rT) per row (column): dS = g * (softmax(S) - softmax(T)) in the tile,
//     dq += scale * dS @ k, dk += scale * dS.T @ q, dscale = sums of dS * (q @ k.T) per direction.
//
// GEMMs per block: forward 2 (S, T), backward 4 (S, T, dq, dk).
//
// Online rescaling. A line's partials over a set of columns are kept in "rest" form: rest = sum exp(S - m)
// less the maximum's own exact 1 (left out by position), so a confident line's tiny rest keeps its digits;
// the teacher's likewise; cross >= 0 (sum of non-negative terms). Two partials over disjoint sets merge by
// merge_into() (the logaddexp form of infcl.lse.lse_merge in rest form: the side holding the new maximum
// keeps its rest unscaled, the other's 1 + rest is scaled by exp(its max - the new max)) and cross by
// (cross + (M - m) * (1 + restT)) * exp(mT - MT) per side, the teacher's weights and the student's gap
// rescaled together. Running partials are double.
//
// Exactness: S and T are each formed by one rounded multiply stored to the tile (scaled_tile), in both
// passes from the same gemm() on the same tiles, so the backward's S - m and T - mT are the forward's, and
// exactly 0 at a line's maximum. dS at an entry equal to its line's student maximum (the only place where
// both probabilities can exceed 1/2) is -sign(a - b) * exp(max(a, b)) * expm1(-|a - b|) with
// a = (S - m) - r and b = (T - mT) - rT, so two near-1 probabilities keep their difference's digits.
//
// dtypes: float64 in float64; everything else on float32 copies (exact). Parallel layout: common.h's row
// tiles split into lanes, one per thread, key tiles outer. Rows belong to one lane; the columns' forward
// partials, dk and dscale are per lane, merged in lane order (deterministic for a given thread count).
// Memory: a few tiles per lane, O(lanes * Bk) column partials, (lanes - 1) dk partials of [Bk, D].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace infcl {
namespace distill {
namespace {

constexpr double NEG_INF = -std::numeric_limits<double>::infinity();

// A line's forward partials over a set of columns (rows), rest form (see the header).
struct Partial {
  double m = NEG_INF, rest = 0, mt = NEG_INF, rest_t = 0, cross = 0;
};

// Merge the partials of a disjoint set into acc. An empty side (m = -inf) is the identity.
inline void merge_into(Partial& acc, const Partial& part) {
  if (part.m == NEG_INF) return;
  if (acc.m == NEG_INF) {
    acc = part;
    return;
  }
  const double m = std::max(acc.m, part.m), mt = std::max(acc.mt, part.mt);
  const double cross = (acc.cross + (m - acc.m) * (1 + acc.rest_t)) * std::exp(acc.mt - mt) +
                       (part.cross + (m - part.m) * (1 + part.rest_t)) * std::exp(part.mt - mt);
  auto rest_of = [](double ma, double ra, double mb, double rb) {
    // The side with the larger maximum keeps its rest unscaled (acc's on a tie: its maximum stays the one).
    return ma >= mb ? ra + (1 + rb) * std::exp(mb - ma) : (1 + ra) * std::exp(ma - mb) + rb;
  };
  acc.rest = rest_of(acc.m, acc.rest, part.m, part.rest);
  acc.rest_t = rest_of(acc.mt, acc.rest_t, part.mt, part.rest_t);
  acc.m = m, acc.mt = mt, acc.cross = cross;
}

// out[t] = raw[t] * scale, each product rounded and stored: never contracted into a later subtraction, so
// both passes form S (and T) by the same one multiply.
template <typename T>
inline void scaled_tile(const T* raw, T* out, int64_t n, T scale) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) out[t] = raw[t] * scale;
}

template <typename T>
struct Operands {
  const T* q;   // [bq, d]
  const T* k;   // [bk, d]
  const T* tq;  // [bq, dt]
  const T* tk;  // [bk, dt]
  int64_t bq, bk, d, dt;
  T scale, teacher_scale;
};

// One lane's tile buffers: raw (q @ k.T), S, T and a spare for the backward's dS.
template <typename T>
struct TileBuffers {
  std::vector<T> raw, s, t, ds;
  explicit TileBuffers(int64_t n) : raw(n), s(n), t(n), ds(n) {}
  // S and T of the tile [i0, i0 + ni) x [j0, j0 + nj), rows of nj: the one route of both passes.
  void form(const Operands<T>& o, int64_t i0, int64_t ni, int64_t j0, int64_t nj) {
    gemm(false, true, ni, nj, o.d, T(1), o.q + i0 * o.d, o.d, o.k + j0 * o.d, o.d, T(0), raw.data(), nj);
    scaled_tile(raw.data(), s.data(), ni * nj, o.scale);
    gemm(false, true, ni, nj, o.dt, T(1), o.tq + i0 * o.dt, o.dt, o.tk + j0 * o.dt, o.dt, T(0), t.data(), nj);
    scaled_tile(t.data(), t.data(), ni * nj, o.teacher_scale);
  }
};

// Calls visit(buffers, lane, i0, ni, j0, nj) for every tile of every lane (S and T formed), key tiles outer.
template <typename T, typename Visit>
void for_each_tile(const Operands<T>& o, const RowTiles& tiles, int64_t lanes, Visit visit) {
  at::parallel_for(0, lanes, 1, [&](int64_t first, int64_t last) {
    const SingleThreadedBlas one_thread;
    const int64_t tk = std::min(TILE_K, o.bk);
    TileBuffers<T> buffers(tiles.size * tk);
    for (int64_t lane = first; lane < last; ++lane) {
      for (int64_t j0 = 0; j0 < o.bk; j0 += tk) {
        const int64_t nj = std::min(tk, o.bk - j0);
        for (int64_t t = lane_start(tiles, lanes, lane); t < lane_start(tiles, lanes, lane + 1); ++t) {
          const int64_t i0 = tiles.begin(t), ni = tiles.height(t);
          buffers.form(o, i0, ni, j0, nj);
          visit(buffers, lane, i0, ni, j0, nj);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// Forward.

// The partials of one row of a tile: n entries of s and t at stride 1.
template <typename T>
Partial row_partial(const T* s, const T* t, int64_t n) {
  int64_t top = 0, top_t = 0;
  for (int64_t c = 1; c < n; ++c) {
    if (s[c] > s[top]) top = c;
    if (t[c] > t[top_t]) top_t = c;
  }
  const T m = s[top], mt = t[top_t];
  T rest = 0, rest_t = 0, cross = 0;
#pragma omp simd reduction(+ : rest, rest_t, cross)
  for (int64_t c = 0; c < n; ++c) {
    const T e = fast_exp(s[c] - m);
    const T w = fast_exp(t[c] - mt);
    rest += c == top ? T(0) : e;
    rest_t += c == top_t ? T(0) : w;
    cross += w * (m - s[c]);
  }
  return Partial{double(m), double(rest), double(mt), double(rest_t), double(cross)};
}

// The partials of the columns of a tile [ni, nj], merged into cols[0, nj); m .. sums: the thread's scratch.
template <typename T>
void merge_column_partials(const T* s, const T* t, int64_t ni, int64_t nj, Partial* cols, std::vector<T>& m,
                           std::vector<T>& mt, std::vector<int64_t>& top, std::vector<int64_t>& top_t,
                           std::vector<T>& sums) {
  for (int64_t c = 0; c < nj; ++c) m[c] = s[c], mt[c] = t[c], top[c] = 0, top_t[c] = 0;
  for (int64_t r = 1; r < ni; ++r) {
    const T* sr = s + r * nj;
    const T* tr = t + r * nj;
    for (int64_t c = 0; c < nj; ++c) {
      if (sr[c] > m[c]) m[c] = sr[c], top[c] = r;
      if (tr[c] > mt[c]) mt[c] = tr[c], top_t[c] = r;
    }
  }
  T* rest = sums.data();
  T* rest_t = rest + nj;
  T* cross = rest_t + nj;
  std::fill(sums.begin(), sums.begin() + 3 * nj, T(0));
  for (int64_t r = 0; r < ni; ++r) {
    const T* sr = s + r * nj;
    const T* tr = t + r * nj;
#pragma omp simd
    for (int64_t c = 0; c < nj; ++c) {
      const T e = fast_exp(sr[c] - m[c]);
      const T w = fast_exp(tr[c] - mt[c]);
      rest[c] += top[c] == r ? T(0) : e;
      rest_t[c] += top_t[c] == r ? T(0) : w;
      cross[c] += w * (m[c] - sr[c]);
    }
  }
  for (int64_t c = 0; c < nj; ++c) {
    merge_into(cols[c], Partial{double(m[c]), double(rest[c]), double(mt[c]), double(rest_t[c]), double(cross[c])});
  }
}

// Partials as the contract's [5, n] (m, r = log1p(rest), mT, rT, cross).
template <typename T>
void store_partials(const std::vector<Partial>& parts, at::Tensor& out) {
  const int64_t n = out.size(1);
  T* o = out.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    const Partial& p = parts[i];
    o[i] = T(p.m), o[n + i] = T(std::log1p(p.rest)), o[2 * n + i] = T(p.mt);
    o[3 * n + i] = T(std::log1p(p.rest_t)), o[4 * n + i] = T(p.cross);
  }
}

template <typename T>
void forward_impl(const Operands<T>& o, bool symmetric, at::Tensor& rows_out, at::Tensor& cols_out) {
  const RowTiles tiles(o.bq);
  const int64_t lanes = lane_count(tiles);
  const int64_t nc = symmetric ? o.bk : 0;
  std::vector<Partial> rows(o.bq), lane_cols(lanes * nc);
  for_each_tile(o, tiles, lanes, [&](TileBuffers<T>& b, int64_t lane, int64_t i0, int64_t ni, int64_t j0, int64_t nj) {
    for (int64_t r = 0; r < ni; ++r) {
      merge_into(rows[i0 + r], row_partial(b.s.data() + r * nj, b.t.data() + r * nj, nj));
    }
    if (!symmetric) return;
    // The columns' per-tile maxima, their rows and sums, per thread.
    thread_local std::vector<T> m, mt, sums;
    thread_local std::vector<int64_t> top, top_t;
    m.resize(nj), mt.resize(nj), sums.resize(3 * nj), top.resize(nj), top_t.resize(nj);
    merge_column_partials(b.s.data(), b.t.data(), ni, nj, lane_cols.data() + lane * nc + j0, m, mt, top, top_t, sums);
  });
  store_partials<T>(rows, rows_out);
  if (!symmetric) return;
  std::vector<Partial> cols(nc);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    for (int64_t j = 0; j < nc; ++j) merge_into(cols[j], lane_cols[lane * nc + j]);
  }
  store_partials<T>(cols, cols_out);
}

// ---------------------------------------------------------------------------------------------------
// Backward.

// exp(a) - exp(b) as -sign(a - b) * exp(max(a, b)) * expm1(-|a - b|): keeps the digits of a difference of
// two probabilities near 1.
template <typename T>
inline T gap_from_logs(T a, T b) {
  const T d = a - b;
  const T sign = d > 0 ? T(1) : (d < 0 ? T(-1) : T(0));
  return -sign * std::exp(std::max(a, b)) * std::expm1(-std::abs(d));
}

// ds[0, n) (+)= g * (softmax(S) - softmax(T)) along one line of the tile (stride `step`), from the line's
// global (m, r, mT, rT); returns sum(that * raw). Entries equal to the line's student maximum take the
// exact form (a = -r there when it is the maximum of the whole line), added on their own so that nothing
// rounds against a plain difference first.
template <typename T>
T line_gap(const T* s, const T* t, const T* raw, T* ds, int64_t n, int64_t step, const T* stats, T g, bool add) {
  const T m = stats[0], r = stats[1], mt = stats[2], rt = stats[3];
  T dscale = 0;
#pragma omp simd reduction(+ : dscale)
  for (int64_t c = 0; c < n; ++c) {
    const int64_t at = c * step;
    const T plain = g * (fast_exp((s[at] - m) - r) - fast_exp((t[at] - mt) - rt));
    const T v = s[at] == m ? T(0) : plain;
    dscale += v * raw[at];
    ds[at] = add ? ds[at] + v : v;
  }
  for (int64_t c = 0; c < n; ++c) {
    const int64_t at = c * step;
    if (s[at] != m) continue;
    const T exact = g * gap_from_logs((s[at] - m) - r, (t[at] - mt) - rt);
    dscale += exact * raw[at];
    ds[at] += exact;
  }
  return dscale;
}

// Upstream of one direction: stats [4, n] transposed to [n, 4] (a line's four values together), g [n].
template <typename T>
struct Upstream {
  std::vector<T> stats;
  const T* g;
  Upstream(const at::Tensor& stats_in, const at::Tensor& g_in) : stats(stats_in.numel()), g(g_in.data_ptr<T>()) {
    const int64_t n = stats_in.size(1);
    const at::Tensor st = stats_in.t().contiguous();
    std::copy(st.data_ptr<T>(), st.data_ptr<T>() + 4 * n, stats.begin());
  }
  const T* line(int64_t i) const { return stats.data() + 4 * i; }
};

template <typename T>
void backward_impl(const Operands<T>& o, const Upstream<T>& rows, const Upstream<T>* cols, T* dq, at::Tensor& dk,
                   at::Tensor& dscale_out) {
  const RowTiles tiles(o.bq);
  const int64_t lanes = lane_count(tiles);
  const int64_t own = lanes - 1;  // lane 0 accumulates into dk itself
  at::Tensor parts = own > 0 ? at::zeros({own, o.bk, o.d}, dk.options()) : at::Tensor();
  T* dk_base = dk.data_ptr<T>();
  auto lane_dk = [&](int64_t lane) { return lane == 0 ? dk_base : parts.data_ptr<T>() + (lane - 1) * o.bk * o.d; };
  std::vector<double> per_lane(2 * lanes, 0.0);
  for_each_tile(o, tiles, lanes, [&](TileBuffers<T>& b, int64_t lane, int64_t i0, int64_t ni, int64_t j0, int64_t nj) {
    T* ds = b.ds.data();
    T row_part = 0, col_part = 0;
    for (int64_t r = 0; r < ni; ++r) {
      const int64_t i = i0 + r, at = r * nj;
      row_part += line_gap(b.s.data() + at, b.t.data() + at, b.raw.data() + at, ds + at, nj, 1, rows.line(i),
                           rows.g[i], false);
    }
    if (cols != nullptr) {
      for (int64_t c = 0; c < nj; ++c) {
        const int64_t j = j0 + c;
        col_part += line_gap(b.s.data() + c, b.t.data() + c, b.raw.data() + c, ds + c, ni, nj, cols->line(j),
                             cols->g[j], true);
      }
    }
    per_lane[2 * lane] += row_part;
    per_lane[2 * lane + 1] += col_part;
    gemm(false, false, ni, o.d, nj, o.scale, ds, nj, o.k + j0 * o.d, o.d, T(1), dq + i0 * o.d, o.d);
    gemm(true, false, nj, o.d, ni, o.scale, ds, nj, o.q + i0 * o.d, o.d, T(1), lane_dk(lane) + j0 * o.d, o.d);
  });
  for (int64_t p = 0; p < own; ++p) dk.add_(parts[p]);
  double row_sum = 0, col_sum = 0;
  for (int64_t lane = 0; lane < lanes; ++lane) row_sum += per_lane[2 * lane], col_sum += per_lane[2 * lane + 1];
  dscale_out[0] = row_sum;
  dscale_out[1] = col_sum;
}

// ---------------------------------------------------------------------------------------------------
// Op entry points.

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& tq, const at::Tensor& tk) {
  for (const at::Tensor* t : {&q, &k, &tq, &tk}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && at::isFloatingType(t->scalar_type()),
                "infcl native distill: features must be 2-d float CPU tensors");
  }
  TORCH_CHECK(q.size(1) == k.size(1) && tq.size(1) == tk.size(1) && tq.size(0) == q.size(0) && tk.size(0) == k.size(0),
              "infcl native distill: q ", q.sizes(), ", k ", k.sizes(), ", tq ", tq.sizes(), ", tk ", tk.sizes(),
              " do not match");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "infcl native distill: q and k dtypes differ");
}

at::Tensor distill_backward_block(const at::Tensor& q_in, const at::Tensor& k_in, double scale, const at::Tensor& tq_in,
                                  const at::Tensor& tk_in, double teacher_scale, const at::Tensor& row_stats,
                                  const at::Tensor& g_row, const std::optional<at::Tensor>& col_stats,
                                  const std::optional<at::Tensor>& g_col, at::Tensor& dq, at::Tensor& dk) {
  check_inputs(q_in, k_in, tq_in, tk_in);
  const auto acc = accumulation_type(q_in.scalar_type());
  TORCH_CHECK(col_stats.has_value() == g_col.has_value(), "infcl native distill: col_stats and g_col go together");
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == 4 && row_stats.size(1) == q_in.size(0),
              "infcl native distill: row_stats must be [4, Bq], got ", row_stats.sizes());
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous();
  const at::Tensor tq = tq_in.to(acc).contiguous(), tk = tk_in.to(acc).contiguous();
  ContiguousGrads grads(dq, dk, q_in, k_in, acc, "infcl native distill");
  at::Tensor dscale = at::zeros({2}, at::kDouble);
  AT_DISPATCH_FLOATING_TYPES(acc, "distill_backward_block", [&] {
    const Operands<scalar_t> o{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), tq.data_ptr<scalar_t>(),
                               tk.data_ptr<scalar_t>(), q.size(0), k.size(0), q.size(1), tq.size(1),
                               static_cast<scalar_t>(scale), static_cast<scalar_t>(teacher_scale)};
    const at::Tensor g_r = g_row.to(acc).contiguous();
    const Upstream<scalar_t> rows(row_stats.to(acc), g_r);
    at::Tensor g_c;
    std::optional<Upstream<scalar_t>> cols;
    if (col_stats.has_value()) {
      TORCH_CHECK(col_stats->dim() == 2 && col_stats->size(0) == 4 && col_stats->size(1) == k.size(0),
                  "infcl native distill: col_stats must be [4, Bk], got ", col_stats->sizes());
      g_c = g_col->to(acc).contiguous();
      cols.emplace(col_stats->to(acc), g_c);
    }
    backward_impl<scalar_t>(o, rows, cols ? &*cols : nullptr, grads.dq.data_ptr<scalar_t>(), grads.dk, dscale);
  });
  grads.write_back();
  return dscale.to(acc);
}

std::tuple<at::Tensor, at::Tensor> distill_forward_block(const at::Tensor& q_in, const at::Tensor& k_in, double scale,
                                                         const at::Tensor& tq_in, const at::Tensor& tk_in,
                                                         double teacher_scale, bool symmetric) {
  check_inputs(q_in, k_in, tq_in, tk_in);
  const auto acc = accumulation_type(q_in.scalar_type());
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous();
  const at::Tensor tq = tq_in.to(acc).contiguous(), tk = tk_in.to(acc).contiguous();
  at::Tensor rows = at::empty({5, q.size(0)}, q.options());
  at::Tensor cols = at::empty({5, symmetric ? k.size(0) : 0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "distill_forward_block", [&] {
    const Operands<scalar_t> o{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), tq.data_ptr<scalar_t>(),
                               tk.data_ptr<scalar_t>(), q.size(0), k.size(0), q.size(1), tq.size(1),
                               static_cast<scalar_t>(scale), static_cast<scalar_t>(teacher_scale)};
    forward_impl<scalar_t>(o, symmetric, rows, cols);
  });
  return {rows, cols};
}

}  // namespace

// The op schemas: csrc/library.cpp.
TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("distill_forward_block", &distill_forward_block).impl("distill_backward_block", &distill_backward_block);
}

}  // namespace distill

}  // namespace infcl
