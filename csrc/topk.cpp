// infcl native CPU kernel for the top-k search (infcl/topk.py; definitions, tie rule and the torch tiles'
// version: infcl/backends/topk_tiles.py): each row's n best columns of one block of S = q @ k.T, no grad.
//
//   topk_block_(q [Bq,D], k [Bk,D], col_index [Bk], key [Bq,n], index [Bq,n], nan [Bq], largest, pos? [Bq],
//       q_ids? [Bq], k_ids? [Bk]) -> ()
//     Continues each row's list, in place, with this block's columns: key/index hold the row's n best so
//     far (from the previous blocks, or empty slots: key -inf, index NO_INDEX), any order, and leave with
//     its n best over those and this block's eligible columns, best first. key = score, or -score when not
//     `largest` (exact: the order reversed, ties kept), in the accumulation dtype; index: global column
//     indices (col_index); nan += the NaN scores among the row's eligible columns. Eligible: every column,
//     less pos[i] (the column within the block of the row's positive, -1 for none; absent: none) and the
//     columns with k_ids[j] == q_ids[i].
//
// Order: key descending, then global index ascending. It is strict (indices are unique), so the n best are
// the same set whatever order the entries are seen in: each row keeps a heap of its n best (the worst on
// top) and an entry enters only if it beats the top. Nothing depends on the thread count.
//
// Tiles: common.h's for_each_score_tile, the ranks' walk (RowTiles times TILE_K columns, one single-threaded
// gemm() per tile), so a score is the same bits as the ranks'. Scores are in the accumulation dtype: float64
// for float64 inputs, float32 (exact float32 copies of 16-bit inputs) otherwise.
//
// Parallel layout: the row tiles are split into lanes (common.h), one per thread; a row belongs to one lane
// and so does its heap. Per tile row, one pass compares each key with the heap's worst (branch-free: most
// entries of a long walk fall below it), and only the entries at or above it (and NaN) go to the heap.
// Memory: one tile per lane; the heaps are the caller's lists (a list of the previous blocks' best also
// starts the walk at a higher floor).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "common.h"

namespace infcl {
namespace topk {
namespace {

// The index of an empty slot: larger than every global index, so any real entry beats it at -inf.
constexpr int64_t NO_INDEX = std::numeric_limits<int64_t>::max();

// One row's n best, kept in the caller's key and index arrays as a heap with the worst on top (every
// entry beats its parent). Entries are ordered by a higher key, then a lower index.
template <typename T>
class RowHeap {
 public:
  RowHeap(T* key, int64_t* index, int64_t n) : key_(key), index_(index), n_(n) {}

  // (k, i) beats the entry at `at`.
  bool beats(T k, int64_t i, int64_t at) const { return k > key_[at] || (k == key_[at] && i < index_[at]); }

  T floor() const { return key_[0]; }

  // From a list in any order (the previous blocks' best first) to a heap.
  void heapify() {
    for (int64_t at = n_ / 2 - 1; at >= 0; --at) sift_down(at, key_[at], index_[at], n_);
  }

  // Put (k, i) in place of the worst if it beats it.
  void offer(T k, int64_t i) {
    if (beats(k, i, 0)) sift_down(0, k, i, n_);
  }

  // Back to a list, best first (a heap sort: the worst goes last).
  void sort_best_first() {
    for (int64_t end = n_ - 1; end > 0; --end) {
      const T k = key_[end];
      const int64_t i = index_[end];
      key_[end] = key_[0];
      index_[end] = index_[0];
      sift_down(0, k, i, end);
    }
  }

 private:
  // Place (k, i) at `at` or below it, within the first `size` slots: the worse child moves up while
  // (k, i) beats it.
  void sift_down(int64_t at, T k, int64_t i, int64_t size) {
    while (true) {
      int64_t child = 2 * at + 1;
      if (child >= size) break;
      if (child + 1 < size && beats(key_[child], index_[child], child + 1)) child += 1;
      if (!beats(k, i, child)) break;
      key_[at] = key_[child];
      index_[at] = index_[child];
      at = child;
    }
    key_[at] = k;
    index_[at] = i;
  }

  T* key_;
  int64_t* index_;
  int64_t n_;
};

// Rows per parallel task when the lists are turned into heaps and back (a few microseconds of work each).
constexpr int64_t ROWS_PER_TASK = 256;

struct Exclusions {
  const int64_t* pos;    // [Bq] column within the block to leave out, -1 for none; nullptr: none
  const int64_t* q_ids;  // [Bq] or nullptr
  const int64_t* k_ids;  // [Bk] or nullptr

  bool eligible(int64_t i, int64_t j) const {
    return (pos == nullptr || pos[i] != j) && (q_ids == nullptr || q_ids[i] != k_ids[j]);
  }
};

template <typename T>
void topk_impl(const ScoreOperands<T>& o, const int64_t* col_index, int64_t n, bool largest, const Exclusions& ex,
               T* key_out, int64_t* index_out, int64_t* nan) {
  at::parallel_for(0, o.bq, ROWS_PER_TASK, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) RowHeap<T>(key_out + i * n, index_out + i * n, n).heapify();
  });
  const RowTiles tiles(o.bq);
  const int64_t lanes = lane_count(tiles);
  for_each_score_tile(o, tiles, lanes, [&](int64_t, int64_t i0, int64_t ni, int64_t j0, int64_t nj, auto scores) {
    T* tile = scores(i0, ni, j0, nj);
    if (!largest) {
#pragma omp simd
      for (int64_t e = 0; e < ni * nj; ++e) tile[e] = -tile[e];
    }
    for (int64_t r = 0; r < ni; ++r) {
      const int64_t i = i0 + r;
      const T* key = tile + r * nj;
      RowHeap<T> heap(key_out + i * n, index_out + i * n, n);
      T floor = heap.floor();
      // Entries below the worst kept cannot enter; NaN fails the test too (and is counted below).
      int64_t reaching = 0;
#pragma omp simd reduction(+ : reaching)
      for (int64_t c = 0; c < nj; ++c) reaching += !(key[c] < floor);
      if (reaching == 0) continue;
      for (int64_t c = 0; c < nj; ++c) {
        if (key[c] < floor || !ex.eligible(i, j0 + c)) continue;
        if (std::isnan(key[c])) {
          nan[i] += 1;
          continue;
        }
        heap.offer(key[c], col_index[j0 + c]);
        floor = heap.floor();
      }
    }
  });
  at::parallel_for(0, o.bq, ROWS_PER_TASK, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) RowHeap<T>(key_out + i * n, index_out + i * n, n).sort_best_first();
  });
}

// ---------------------------------------------------------------------------------------------------
// Op entry point.

void topk_block_(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& col_index_in, at::Tensor& key,
                 at::Tensor& index, at::Tensor& nan, bool largest, const std::optional<at::Tensor>& pos_in,
                 const std::optional<at::Tensor>& q_ids_in, const std::optional<at::Tensor>& k_ids_in) {
  const char* op = "infcl native top-k";
  check_score_operands(q_in, k_in, op);
  TORCH_CHECK(q_ids_in.has_value() == k_ids_in.has_value(), op, ": q_ids and k_ids go together");
  TORCH_CHECK(col_index_in.numel() == k_in.size(0), op, ": col_index must have one entry per k row");
  const auto acc = accumulation_type(q_in.scalar_type());
  const int64_t bq = q_in.size(0), bk = k_in.size(0);
  TORCH_CHECK(key.dim() == 2 && key.size(0) == bq && key.size(1) >= 1 && key.scalar_type() == acc &&
                  key.is_contiguous(),
              op, ": key must be a contiguous [Bq, n] tensor of the accumulation dtype, got ", key.sizes());
  TORCH_CHECK(index.sizes() == key.sizes() && index.scalar_type() == at::kLong && index.is_contiguous(), op,
              ": index must be a contiguous int64 tensor like key");
  TORCH_CHECK(nan.dim() == 1 && nan.size(0) == bq && nan.scalar_type() == at::kLong && nan.is_contiguous(), op,
              ": nan must be a contiguous int64 [Bq]");
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous();
  const at::Tensor col_index = as_longs(col_index_in);
  at::Tensor pos, q_ids, k_ids;
  const Exclusions ex{optional_longs(pos_in, pos), optional_longs(q_ids_in, q_ids), optional_longs(k_ids_in, k_ids)};
  AT_DISPATCH_FLOATING_TYPES(acc, "topk_block_", [&] {
    const ScoreOperands<scalar_t> o{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), bq, bk, q.size(1)};
    topk_impl<scalar_t>(o, col_index.data_ptr<int64_t>(), key.size(1), largest, ex, key.data_ptr<scalar_t>(),
                        index.data_ptr<int64_t>(), nan.data_ptr<int64_t>());
  });
}

}  // namespace

// The op schemas: csrc/library.cpp.
TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("topk_block_", &topk_block_);
}

}  // namespace topk

}  // namespace infcl
