// infcl native CPU kernel for the retrieval ranks (infcl/metrics/retrieval.py; the definitions are
// infcl/contract.py, the torch tiles' version infcl/backends/torch_tiles/rank.py): the two passes over the
// tiles of S = q @ k.T, no grad.
//
//   rank_best_positives(q [Bq,D], k [Bk,D], pos [Bq], row_index [Bq], col_index [Bk], symmetric,
//       q_ids? [Bq], k_ids? [Bk]) -> (row_score, row_best, row_count, col_score, col_best, col_count)
//     Each row's (column's) best positive over this block: its score read off the tile, its global index
//     (the lowest among equal scores) and the number of positives. The positives: pos (the column within the
//     block of each row's positive, -1 elsewhere), or with the ids every entry with q_ids[i] == k_ids[j].
//     Only the tiles that hold a positive are multiplied. Column outputs are [0] unless symmetric.
//   rank_ahead_counts(q, k, row_score, row_best, col_score?, col_best?, row_index, col_index, q_ids?, k_ids?)
//       -> (row_ahead, row_nonfinite, col_ahead, col_nonfinite)
//     Per row (column), the entries of the block ahead of its best positive: scoring strictly higher, or
//     equal with a lower global index; with the ids, entries with the row's id are never ahead (duplicates
//     of the positive). nonfinite: the number of the line's scores that are NaN or infinite.
//
// Ties compare equal: both passes cut S into the same tiles (common.h's for_each_score_tile: RowTiles times
// TILE_K columns) and form each with the same single-threaded gemm() call on the same operands, so pass 2's
// tile is pass 1's bit for bit and an exact duplicate of the positive ties it exactly. Scores are in the
// accumulation dtype: float64 for float64 inputs, float32 (exact float32 copies of 16-bit inputs) otherwise.
//
// Parallel layout: the row tiles are split into lanes (common.h), one per thread, each walking key tiles
// outer. Rows belong to one lane; the columns' results are per lane and merged at the end: integer sums,
// and bests by (score, then index), so nothing depends on the thread count or on scheduling.
// Memory: one tile per lane, O(lanes * Bk) column partials, O(B) outputs.

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
namespace retrieval {
namespace {

// The index of "no positive seen yet": larger than every global index, so any real one wins a tie.
constexpr int64_t NO_INDEX = std::numeric_limits<int64_t>::max();

// A best positive: the higher score wins, then the lower index. NaN never wins (its line is NaN anyway:
// pass 2 counts it as non-finite).
template <typename T>
inline void keep_better(T score, int64_t index, T& best, int64_t& best_index) {
  if (score > best || (score == best && index < best_index)) {
    best = score;
    best_index = index;
  }
}

// ---------------------------------------------------------------------------------------------------
// Pass 1.

template <typename T>
void best_positives_impl(const ScoreOperands<T>& o, const int64_t* pos, const int64_t* row_index, const int64_t* col_index,
                         const int64_t* q_ids, const int64_t* k_ids, bool symmetric, T* row_score, int64_t* row_best,
                         int64_t* row_count, T* col_score, int64_t* col_best, int64_t* col_count) {
  const RowTiles tiles(o.bq);
  const int64_t lanes = lane_count(tiles);
  const int64_t nc = symmetric ? o.bk : 0;
  std::vector<T> lane_score(lanes * nc, -std::numeric_limits<T>::infinity());
  std::vector<int64_t> lane_best(lanes * nc, NO_INDEX), lane_count(lanes * nc, 0);
  const bool by_ids = q_ids != nullptr;
  for_each_score_tile(o, tiles, lanes, [&](int64_t lane, int64_t i0, int64_t ni, int64_t j0, int64_t nj, auto scores) {
    bool holds = false;  // whether the tile holds a positive (else it is never multiplied)
    for (int64_t r = 0; r < ni && !holds; ++r) {
      if (by_ids) {
        for (int64_t c = 0; c < nj && !holds; ++c) holds = q_ids[i0 + r] == k_ids[j0 + c];
      } else {
        holds = pos[i0 + r] >= j0 && pos[i0 + r] < j0 + nj;
      }
    }
    if (!holds) return;
    const T* s = scores(i0, ni, j0, nj);
    T* cs = symmetric ? lane_score.data() + lane * nc : nullptr;
    int64_t* cb = symmetric ? lane_best.data() + lane * nc : nullptr;
    int64_t* cn = symmetric ? lane_count.data() + lane * nc : nullptr;
    auto found = [&](int64_t r, int64_t c) {  // entry (r, c) of the tile is a positive
      const int64_t i = i0 + r, j = j0 + c;
      const T v = s[r * nj + c];
      keep_better(v, col_index[j], row_score[i], row_best[i]);
      row_count[i] += 1;
      if (symmetric) {
        keep_better(v, row_index[i], cs[j], cb[j]);
        cn[j] += 1;
      }
    };
    for (int64_t r = 0; r < ni; ++r) {
      if (by_ids) {
        const int64_t id = q_ids[i0 + r];
        for (int64_t c = 0; c < nj; ++c) {
          if (k_ids[j0 + c] == id) found(r, c);
        }
      } else if (pos[i0 + r] >= j0 && pos[i0 + r] < j0 + nj) {
        found(r, pos[i0 + r] - j0);
      }
    }
  });
  for (int64_t lane = 0; lane < lanes; ++lane) {
    for (int64_t j = 0; j < nc; ++j) {
      keep_better(lane_score[lane * nc + j], lane_best[lane * nc + j], col_score[j], col_best[j]);
      col_count[j] += lane_count[lane * nc + j];
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Pass 2.

// Whether s is ahead of a best (score t, index b) for an entry of index `other`: greater, or tied and lower.
template <typename T>
inline int64_t is_ahead(T s, T t, int64_t other, int64_t b) {
  return (s > t) | ((s == t) & (other < b));
}

template <typename T>
inline int64_t not_finite(T s) {
  return !std::isfinite(s);
}

template <typename T>
void ahead_counts_impl(const ScoreOperands<T>& o, const T* row_score, const int64_t* row_best, const T* col_score,
                       const int64_t* col_best, const int64_t* row_index, const int64_t* col_index,
                       const int64_t* q_ids, const int64_t* k_ids, int64_t* row_ahead, int64_t* row_nonfinite,
                       int64_t* col_ahead, int64_t* col_nonfinite) {
  const RowTiles tiles(o.bq);
  const int64_t lanes = lane_count(tiles);
  const bool symmetric = col_score != nullptr;
  const int64_t nc = symmetric ? o.bk : 0;
  std::vector<int64_t> lane_ahead(lanes * nc, 0), lane_nonfinite(lanes * nc, 0);
  const bool excluding = q_ids != nullptr;
  for_each_score_tile(o, tiles, lanes, [&](int64_t lane, int64_t i0, int64_t ni, int64_t j0, int64_t nj, auto scores) {
    const T* tile = scores(i0, ni, j0, nj);  // bit-identical to pass 1's tile
    const int64_t* cidx = col_index + j0;
    const int64_t* kid = excluding ? k_ids + j0 : nullptr;
    int64_t* ca = symmetric ? lane_ahead.data() + lane * nc + j0 : nullptr;
    int64_t* cf = symmetric ? lane_nonfinite.data() + lane * nc + j0 : nullptr;
    const T* ct = symmetric ? col_score + j0 : nullptr;
    const int64_t* cb = symmetric ? col_best + j0 : nullptr;
    for (int64_t r = 0; r < ni; ++r) {
      const int64_t i = i0 + r;
      const T* s = tile + r * nj;
      const T t = row_score[i];
      const int64_t b = row_best[i], ri = row_index[i];
      int64_t ahead = 0, bad = 0;
      if (excluding) {
        const int64_t id = q_ids[i];
#pragma omp simd reduction(+ : ahead, bad)
        for (int64_t c = 0; c < nj; ++c) {
          ahead += is_ahead(s[c], t, cidx[c], b) & (kid[c] != id);
          bad += not_finite(s[c]);
        }
        if (symmetric) {
#pragma omp simd
          for (int64_t c = 0; c < nj; ++c) {
            ca[c] += is_ahead(s[c], ct[c], ri, cb[c]) & (kid[c] != id);
            cf[c] += not_finite(s[c]);
          }
        }
      } else {
#pragma omp simd reduction(+ : ahead, bad)
        for (int64_t c = 0; c < nj; ++c) {
          ahead += is_ahead(s[c], t, cidx[c], b);
          bad += not_finite(s[c]);
        }
        if (symmetric) {
#pragma omp simd
          for (int64_t c = 0; c < nj; ++c) {
            ca[c] += is_ahead(s[c], ct[c], ri, cb[c]);
            cf[c] += not_finite(s[c]);
          }
        }
      }
      row_ahead[i] += ahead;
      row_nonfinite[i] += bad;
    }
  });
  for (int64_t lane = 0; lane < lanes; ++lane) {
    for (int64_t j = 0; j < nc; ++j) {
      col_ahead[j] += lane_ahead[lane * nc + j];
      col_nonfinite[j] += lane_nonfinite[lane * nc + j];
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Op entry points.

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rank_best_positives(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& pos_in, const at::Tensor& row_index_in,
    const at::Tensor& col_index_in, bool symmetric, const std::optional<at::Tensor>& q_ids_in,
    const std::optional<at::Tensor>& k_ids_in) {
  check_score_operands(q_in, k_in, "infcl native ranks");
  TORCH_CHECK(q_ids_in.has_value() == k_ids_in.has_value(), "infcl native ranks: q_ids and k_ids go together");
  const auto acc = accumulation_type(q_in.scalar_type());
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous();
  const int64_t bq = q.size(0), bk = k.size(0), nc = symmetric ? bk : 0;
  const at::Tensor pos = as_longs(pos_in), row_index = as_longs(row_index_in), col_index = as_longs(col_index_in);
  at::Tensor q_ids, k_ids;
  const int64_t* qi = optional_longs(q_ids_in, q_ids);
  const int64_t* ki = optional_longs(k_ids_in, k_ids);
  const auto real = q.options(), ints = q.options().dtype(at::kLong);
  at::Tensor row_score = at::full({bq}, -INFINITY, real), col_score = at::full({nc}, -INFINITY, real);
  at::Tensor row_best = at::full({bq}, NO_INDEX, ints), col_best = at::full({nc}, NO_INDEX, ints);
  at::Tensor row_count = at::zeros({bq}, ints), col_count = at::zeros({nc}, ints);
  AT_DISPATCH_FLOATING_TYPES(acc, "rank_best_positives", [&] {
    const ScoreOperands<scalar_t> o{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), bq, bk, q.size(1)};
    best_positives_impl<scalar_t>(o, pos.data_ptr<int64_t>(), row_index.data_ptr<int64_t>(),
                                  col_index.data_ptr<int64_t>(), qi, ki, symmetric, row_score.data_ptr<scalar_t>(),
                                  row_best.data_ptr<int64_t>(), row_count.data_ptr<int64_t>(),
                                  col_score.data_ptr<scalar_t>(), col_best.data_ptr<int64_t>(),
                                  col_count.data_ptr<int64_t>());
  });
  return {row_score, row_best, row_count, col_score, col_best, col_count};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rank_ahead_counts(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& row_score_in, const at::Tensor& row_best_in,
    const std::optional<at::Tensor>& col_score_in, const std::optional<at::Tensor>& col_best_in,
    const at::Tensor& row_index_in, const at::Tensor& col_index_in, const std::optional<at::Tensor>& q_ids_in,
    const std::optional<at::Tensor>& k_ids_in) {
  check_score_operands(q_in, k_in, "infcl native ranks");
  TORCH_CHECK(q_ids_in.has_value() == k_ids_in.has_value(), "infcl native ranks: q_ids and k_ids go together");
  TORCH_CHECK(col_score_in.has_value() == col_best_in.has_value(),
              "infcl native ranks: col_score and col_best go together");
  const auto acc = accumulation_type(q_in.scalar_type());
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous();
  const int64_t bq = q.size(0), bk = k.size(0);
  const bool symmetric = col_score_in.has_value();
  const int64_t nc = symmetric ? bk : 0;
  const at::Tensor row_score = row_score_in.to(acc).contiguous(), row_best = as_longs(row_best_in);
  const at::Tensor col_score = symmetric ? col_score_in->to(acc).contiguous() : at::Tensor();
  const at::Tensor col_best = symmetric ? as_longs(*col_best_in) : at::Tensor();
  const at::Tensor row_index = as_longs(row_index_in), col_index = as_longs(col_index_in);
  at::Tensor q_ids, k_ids;
  const int64_t* qi = optional_longs(q_ids_in, q_ids);
  const int64_t* ki = optional_longs(k_ids_in, k_ids);
  const auto ints = q.options().dtype(at::kLong);
  at::Tensor row_ahead = at::zeros({bq}, ints), row_nonfinite = at::zeros({bq}, ints);
  at::Tensor col_ahead = at::zeros({nc}, ints), col_nonfinite = at::zeros({nc}, ints);
  AT_DISPATCH_FLOATING_TYPES(acc, "rank_ahead_counts", [&] {
    const ScoreOperands<scalar_t> o{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), bq, bk, q.size(1)};
    ahead_counts_impl<scalar_t>(o, row_score.data_ptr<scalar_t>(), row_best.data_ptr<int64_t>(),
                                symmetric ? col_score.data_ptr<scalar_t>() : nullptr,
                                symmetric ? col_best.data_ptr<int64_t>() : nullptr, row_index.data_ptr<int64_t>(),
                                col_index.data_ptr<int64_t>(), qi, ki, row_ahead.data_ptr<int64_t>(),
                                row_nonfinite.data_ptr<int64_t>(), col_ahead.data_ptr<int64_t>(),
                                col_nonfinite.data_ptr<int64_t>());
  });
  return {row_ahead, row_nonfinite, col_ahead, col_nonfinite};
}

}  // namespace

// The op schemas: csrc/library.cpp.
TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("rank_best_positives", &rank_best_positives).impl("rank_ahead_counts", &rank_ahead_counts);
}

}  // namespace retrieval

}  // namespace infcl
