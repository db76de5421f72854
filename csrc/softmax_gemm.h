// The softmax kernel's tile products: MKL's packed sgemm for a key tile that serves many row tiles
// (ReusedB), and the one route by which both passes form raw = q_i @ k_j.T (RawTiles), so that the
// backward recomputes the forward's S bit for bit. The routes themselves (ATen, MKL's bf16 GEMM, oneDNN's
// brgemm) are common.h's; what was tried and dropped is in docs/benchmarks.md.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "common.h"

extern "C" {
// MKL's packed-operand sgemm: op(B) packed once, then multiplied by many A tiles.
enum { kCblasPacked = 151, kCblasBMatrix = 162 };
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace infcl {
namespace softmax {

inline bool has_sgemm_pack() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
}

// The B operand of C[m, n] = A[m, kk] @ op(B) + beta * C when one k tile serves all of a thread's row
// tiles: set() once per k tile, then product() per row tile. For float32 with MKL, op(B) is packed
// once into MKL's internal layout (with alpha folded in), so the row-tile products skip repacking it,
// which is most of what separates a 256-row tile product from MKL's big-GEMM rate. The packed panel
// is sized for m rows (the full row tile of RowTiles); a shorter (ragged) row tile, and every other
// dtype, uses gemm(). Which of the two routes a tile takes depends on the shapes alone, never on how
// the rows are shared among threads: the routes may round differently, and the backward must
// recompute the forward's S bit for bit whatever the thread count in either pass.
// The buffer is left uninitialized: MKL reserves ~8 MB beyond the panel's data that it does not
// write, so those pages are never touched and never become resident.
template <typename A, typename Bt, typename C>
class ReusedB {
 public:
  ReusedB(bool tb, int64_t m, int64_t n_max, int64_t k_max) : tb_(tb), m_(m) {
    if constexpr (std::is_same<Bt, float>::value) {
      if (has_sgemm_pack()) {
        capacity_ = cblas_sgemm_pack_get_size(kCblasBMatrix, static_cast<int>(m), static_cast<int>(n_max),
                                              static_cast<int>(k_max));
        packed_.reset(new float[(capacity_ + sizeof(float) - 1) / sizeof(float)]);
      }
    }
  }

  void set(const Bt* b, int64_t ldb, int64_t n, int64_t k, C alpha) {
    b_ = b, ldb_ = ldb, n_ = n, k_ = k, alpha_ = alpha;
    is_packed_ = false;
    if constexpr (std::is_same<Bt, float>::value) {
      // A ragged last tile is smaller than the buffer's (n_max, k_max) panel; should MKL ever size it
      // larger, that tile takes the unpacked products.
      if (packed_ && cblas_sgemm_pack_get_size(kCblasBMatrix, static_cast<int>(m_), static_cast<int>(n),
                                               static_cast<int>(k)) <= capacity_) {
        is_packed_ = true;
        cblas_sgemm_pack(kCblasRowMajor, kCblasBMatrix, tb_ ? kCblasTrans : kCblasNoTrans, static_cast<int>(m_),
                         static_cast<int>(n), static_cast<int>(k), alpha, b, static_cast<int>(ldb), packed_.get());
      }
    }
  }

  void product(int64_t m, const A* a, int64_t lda, C beta, C* c, int64_t ldc) const {
    if constexpr (std::is_same<Bt, float>::value) {
      if (is_packed_ && m == m_) {
        cblas_sgemm_compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, static_cast<int>(m), static_cast<int>(n_),
                            static_cast<int>(k_), a, static_cast<int>(lda), packed_.get(), static_cast<int>(ldb_),
                            beta, c, static_cast<int>(ldc));
        return;
      }
    }
    gemm(false, tb_, m, n_, k_, alpha_, a, lda, b_, ldb_, beta, c, ldc);
  }

 private:
  bool tb_;
  int64_t m_;
  const Bt* b_ = nullptr;
  int64_t ldb_ = 0, n_ = 0, k_ = 0;
  C alpha_ = C(1);
  size_t capacity_ = 0;
  bool is_packed_ = false;
  std::unique_ptr<float[]> packed_;
};

// The input type, its accumulation type, and the type dS is handed to the dq / dk products in.
template <typename In>
struct Types {
  using acc = In;
  using ds = In;
};
template <>
struct Types<at::BFloat16> {
  using acc = float;
  using ds = at::BFloat16;
};

// A block as a kernel's threads read it: q [bq, d] and k [bk, d] (contiguous), the row tiles, the scale, and
// each row's positive column in the block (-1: in another block).
template <typename In, typename Acc>
struct BlockOperands {
  const In* q;
  const In* k;
  int64_t bq, bk, d;
  RowTiles tiles;
  Acc scale;
  const int64_t* pos;
};

// raw = q_i @ k_j.T, the tile product, by one route in both passes: the same ReusedB (packing
// decision, tile shapes, alpha = 1) for the same tiles, or for bfloat16 on the Brgemm route (brgemm set)
// common.h's BrgemmKeyTile, so the backward's raw is the forward's bit for bit. set_keys() once per key
// tile, product() per row tile. backward: the Brgemm key tile also packs the gradients' operands
// (brgemm_tile()).
template <typename In>
class RawTiles {
 public:
  using Acc = typename Types<In>::acc;
  RawTiles(int64_t m, int64_t tk, int64_t d, bool brgemm = false, bool backward = false)
      : d_(d), k_t_(/*tb=*/true, m, tk, d) {
    if constexpr (std::is_same<In, at::BFloat16>::value) {
      if (brgemm) brgemm_ = std::make_unique<BrgemmKeyTile>(m, tk, d, d, backward);
    }
  }
  void set_keys(const In* k_rows, int64_t nj) {
    if constexpr (std::is_same<In, at::BFloat16>::value) {
      if (brgemm_) return brgemm_->set(k_rows, nj);
    }
    k_t_.set(k_rows, d_, nj, d_, Acc(1));
  }
  void product(const In* q_rows, int64_t ni, Acc* raw, int64_t nj) const {
    if constexpr (std::is_same<In, at::BFloat16>::value) {
      if (brgemm_) return brgemm_->scores(q_rows, ni, raw);
    }
    k_t_.product(ni, q_rows, d_, Acc(0), raw, nj);
  }
  // The Brgemm route's key tile (null on every other route).
  BrgemmKeyTile* brgemm_tile() const { return brgemm_.get(); }

 private:
  int64_t d_;
  ReusedB<In, In, Acc> k_t_;
  std::unique_ptr<BrgemmKeyTile> brgemm_;
};

// S = raw * scale, each product rounded and stored. The forward (with its maxima) and the backward
// both form S by exactly this one rounded multiply: it is never folded into the GEMM's alpha and never
// fused into the later S - m, which an FMA would compute from the unrounded product.
template <typename Acc>
inline void scale_tile(const Acc* raw, Acc* s, int64_t n, Acc sc) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] = raw[t] * sc;
}

}  // namespace softmax
}  // namespace infcl
