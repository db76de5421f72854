// The Matryoshka softmax loss's forward (matryoshka.h): per tile, the raw product grows segment by segment
// (KeySegments) and at each prefix's boundary takes the plain forward's steps on that prefix's S (its maxima,
// positives and running row and column stats: softmax_stats.h). Threads share the plain forward's column
// groups, key tiles outer, so the outputs do not depend on the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "matryoshka.h"
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
    T* positives;  // [K, 3, bq]: row 2 of each prefix's block
  };

  explicit PrefixForward(const Args& a)
      : a_(a.in), positives_(a.positives), tk_(std::min(MATRYOSHKA_TILE_K, a_.bk)),
        keys_(a_.prefixes, /*scores=*/true, a_.tiles.size, tk_, a_.d), raw_(a_.tiles.size * tk_),
        s_(a_.tiles.size * tk_), stats_(a_.tiles.size, tk_) {}

  void set_keys(int64_t j0, int64_t nj) { keys_.set(a_.k + j0 * a_.d, nj, T(1)); }

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

 private:
  PrefixOperands<T> a_;
  T* positives_;
  int64_t tk_;
  KeySegments<T> keys_;
  std::vector<T> raw_, s_;
  TileStats<T> stats_;
};

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
                  const Prefixes& prefixes, const at::Tensor& q_factors, const at::Tensor& k_factors,
                  at::Tensor& rows, at::Tensor& cols) {
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1), n = prefixes.count();
  const RowTiles tiles(bq);
  // Symmetric: every column group keeps K prefixes' partials (20 bytes per prefix and column), so the groups
  // share the plain forward's budget of MAX_COLUMN_GROUPS partials, which caps this forward at
  // MAX_COLUMN_GROUPS / K threads (12 at K = 5); one direction keeps none.
  const int64_t group_cap = symmetric ? std::max<int64_t>(1, MAX_COLUMN_GROUPS / n) : MAX_COLUMN_GROUPS;
  const int64_t groups = std::max<int64_t>(1, std::min(tiles.count, group_cap));
  const int64_t tk = std::min(MATRYOSHKA_TILE_K, bk);
  auto row_run = prefix_stores<T>(n, bq);
  auto col_parts = prefix_stores<T>(n, symmetric ? groups * bk : 0);  // each [groups, bk]
  rows.zero_();  // the positives stay 0 where they lie in another block
  T* out = rows.data_ptr<T>();
  const typename PrefixForward<T>::Args args{{{q.data_ptr<T>(), k.data_ptr<T>(), bq, bk, d, tiles,
                                              static_cast<T>(scale), pos.data_ptr<int64_t>()}, prefixes,
                                              q_factors.data_ptr<T>(), k_factors.data_ptr<T>()},
                                             out};
  std::vector<Running<T>> row_lines(n);
  for (int64_t p = 0; p < n; ++p) row_lines[p] = row_run[p].at(0);
  at::parallel_for(0, groups, 1, [&](int64_t g_begin, int64_t g_end) {
    const SingleThreadedBlas one_thread;
    PrefixForward<T> work(args);
    std::vector<Running<T>> col_lines(n, Running<T>{nullptr, nullptr, nullptr});
    for (int64_t j0 = 0; j0 < bk; j0 += tk) {
      const int64_t nj = std::min(tk, bk - j0);
      work.set_keys(j0, nj);
      for (int64_t g = g_begin; g < g_end; ++g) {
        for (int64_t p = 0; p < n && symmetric; ++p) col_lines[p] = col_parts[p].at(g * bk + j0);
        for (int64_t t = group_start(tiles.count, groups, g); t < group_start(tiles.count, groups, g + 1); ++t) {
          work.tile(t, j0, nj, row_lines, col_lines);
        }
      }
    }
  });
  for (int64_t p = 0; p < n; ++p) {
    T* line = out + 3 * p * bq;
    for (int64_t i = 0; i < bq; ++i) {
      line[i] = row_run[p].max[i];
      line[bq + i] = log_rel(row_run[p].max[i], row_run[p].top[i], row_run[p].rest[i]);
    }
    if (symmetric) merge_column_partials(col_parts[p], groups, bk, cols.data_ptr<T>() + 2 * p * bk);
  }
}

}  // namespace

void matryoshka_forward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                        bool symmetric, const Prefixes& prefixes, const at::Tensor& q_factors,
                        const at::Tensor& k_factors, at::Tensor& rows, at::Tensor& cols) {
  if (q.scalar_type() == at::kDouble) {
    forward_impl<double>(q, k, scale, pos, symmetric, prefixes, q_factors, k_factors, rows, cols);
  } else {
    forward_impl<float>(q, k, scale, pos, symmetric, prefixes, q_factors, k_factors, rows, cols);
  }
}

}  // namespace softmax
}  // namespace infcl
