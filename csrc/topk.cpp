// infcl native CPU kernel for the top-k search (infcl/topk.py; definitions, tie rule and the torch tiles'
// version: infcl/backends/topk_tiles.py): each row's n best columns of one block of S = q @ k.T, no grad.
//
//   topk_block(q [Bq,D], k [Bk,D], col_index [Bk], n, largest, pos? [Bq], q_ids? [Bq], k_ids? [Bk])
//       -> (key [Bq,n], index [Bq,n], nan [Bq])
//     key: the row's n best keys, best first (key = score, or -score when not `largest`: exact, the order
//     reversed and ties kept), in the accumulation dtype; index: their global column indices (col_index),
//     NO_INDEX in a slot past the eligible columns (key -inf there); nan: the number of NaN scores among the
//     row's eligible columns. Eligible: every column, less pos[i] (the column within the block of the row's
//     positive, -1 for none; absent: none) and the columns with k_ids[j] == q_ids[i].
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
// Memory: one tile per lane, the Bq x n heaps (the output's size).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace infcl {
namespace topk {
namespace {

// The index of an empty slot: larger than every global index, so any real entry beats it at -inf.
constexpr int64_t NO_INDEX = std::numeric_limits<int64_t>::max();

template <typename T>
struct Entry {
  T key;
  int64_t index;
};

// The order of the lists: a higher key, then a lower index.
template <typename T>
inline bool better(const Entry<T>& a, const Entry<T>& b) {
  return a.key > b.key || (a.key == b.key && a.index < b.index);
}

// One row's n best as a heap with the worst on top: heap[0] is beaten by every other entry.
template <typename T>
class RowHeap {
 public:
  RowHeap(Entry<T>* slots, int64_t n) : heap_(slots), n_(n) {}

  const Entry<T>& worst() const { return heap_[0]; }

  // Put `e` in place of the worst if it beats it.
  void offer(const Entry<T>& e) {
    if (!better(e, heap_[0])) return;
    int64_t at = 0;
    while (true) {  // sift down: move the worse child up while it is worse than e
      const int64_t left = 2 * at + 1;
      if (left >= n_) break;
      int64_t child = left;
      if (left + 1 < n_ && better(heap_[left], heap_[left + 1])) child = left + 1;
      if (!better(e, heap_[child])) break;
      heap_[at] = heap_[child];
      at = child;
    }
    heap_[at] = e;
  }

 private:
  Entry<T>* heap_;
  int64_t n_;
};

template <typename T>
struct Exclusions {
  const int64_t* pos;    // [Bq] column within the block to leave out, -1 for none; nullptr: none
  const int64_t* q_ids;  // [Bq] or nullptr
  const int64_t* k_ids;  // [Bk] or nullptr

  bool eligible(int64_t i, int64_t j) const {
    return (pos == nullptr || pos[i] != j) && (q_ids == nullptr || q_ids[i] != k_ids[j]);
  }
};

template <typename T>
void topk_impl(const ScoreOperands<T>& o, const int64_t* col_index, int64_t n, bool largest, const Exclusions<T>& ex,
               Entry<T>* heaps, int64_t* nan) {
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
      RowHeap<T> heap(heaps + i * n, n);
      T floor = heap.worst().key;
      // Entries below the worst cannot enter; NaN fails the test too, and is counted below.
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
        heap.offer({key[c], col_index[j0 + c]});
        floor = heap.worst().key;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// Op entry point.

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_block(const at::Tensor& q_in, const at::Tensor& k_in,
                                                          const at::Tensor& col_index_in, int64_t n, bool largest,
                                                          const std::optional<at::Tensor>& pos_in,
                                                          const std::optional<at::Tensor>& q_ids_in,
                                                          const std::optional<at::Tensor>& k_ids_in) {
  check_score_operands(q_in, k_in, "infcl native top-k");
  TORCH_CHECK(n >= 1, "infcl native top-k: n must be >= 1, got ", n);
  TORCH_CHECK(q_ids_in.has_value() == k_ids_in.has_value(), "infcl native top-k: q_ids and k_ids go together");
  TORCH_CHECK(col_index_in.numel() == k_in.size(0), "infcl native top-k: col_index must have one entry per k row");
  const auto acc = accumulation_type(q_in.scalar_type());
  const at::Tensor q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous();
  const int64_t bq = q.size(0), bk = k.size(0);
  const at::Tensor col_index = as_longs(col_index_in);
  at::Tensor pos, q_ids, k_ids;
  const int64_t* pi = optional_longs(pos_in, pos);
  const int64_t* qi = optional_longs(q_ids_in, q_ids);
  const int64_t* ki = optional_longs(k_ids_in, k_ids);
  const auto ints = q.options().dtype(at::kLong);
  at::Tensor key = at::empty({bq, n}, q.options()), index = at::empty({bq, n}, ints), nan = at::zeros({bq}, ints);
  AT_DISPATCH_FLOATING_TYPES(acc, "topk_block", [&] {
    using T = scalar_t;
    std::vector<Entry<T>> heaps(bq * n, Entry<T>{-std::numeric_limits<T>::infinity(), NO_INDEX});
    const ScoreOperands<T> o{q.data_ptr<T>(), k.data_ptr<T>(), bq, bk, q.size(1)};
    topk_impl<T>(o, col_index.data_ptr<int64_t>(), n, largest, Exclusions<T>{pi, qi, ki}, heaps.data(),
                 nan.data_ptr<int64_t>());
    T* key_out = key.data_ptr<T>();
    int64_t* index_out = index.data_ptr<int64_t>();
    at::parallel_for(0, bq, 64, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        Entry<T>* row = heaps.data() + i * n;
        std::sort(row, row + n, better<T>);
        for (int64_t s = 0; s < n; ++s) {
          key_out[i * n + s] = row[s].key;
          index_out[i * n + s] = row[s].index;
        }
      }
    });
  });
  return {key, index, nan};
}

}  // namespace
}  // namespace topk

// The namespace `infcl` is defined by csrc/softmax_ops.cpp's TORCH_LIBRARY; this file adds its op to it.
TORCH_LIBRARY_FRAGMENT(infcl, m) {
  m.def(
      "topk_block(Tensor q, Tensor k, Tensor col_index, int n, bool largest, Tensor? pos, Tensor? q_ids, "
      "Tensor? k_ids) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(infcl, CPU, m) { m.impl("topk_block", &topk::topk_block); }

}  // namespace infcl
