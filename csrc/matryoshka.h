// The softmax loss over Matryoshka prefixes (math: infcl/matryoshka.py), fused: every prefix's loss out of one
// tiled pass forward (matryoshka_forward.cpp) and one backward (matryoshka_backward.cpp); the ops are in
// softmax_ops.cpp. A tile's raw product grows segment by segment, raw^k = raw^(k-1) + q_i[:, seg_k] @
// k_j[:, seg_k].T, and at each prefix's boundary S^k = raw^k * scale (((raw^k * a_i) * b_j) * scale where
// the prefix is renormalized) takes the plain loss's steps (softmax_stats.h forward, softmax_grads.h
// backward). The backward feeds segment s the sum over the prefixes holding it, W = sum_(k >= s) dS^k a^k b^k,
// so the products run over D once for raw, once for dq and once for dk, as the plain loss's do.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "softmax.h"
#include "softmax_stats.h"

namespace infcl {
namespace softmax {

// A call's prefixes in increasing dimension (0 < dims[0] < ... <= D) and whether each is renormalized;
// segment k is the feature columns [begin(k), dims[k]) that prefix k adds to prefix k - 1.
struct Prefixes {
  std::vector<int64_t> dims;
  std::vector<uint8_t> renormalize;
  int64_t count() const { return static_cast<int64_t>(dims.size()); }
  int64_t begin(int64_t k) const { return k ? dims[k - 1] : 0; }
  int64_t width(int64_t k) const { return dims[k] - begin(k); }
};

// The features' per-prefix factors ([2, K, n], the accumulation dtype, contiguous): row 0 a^k_i =
// 1 / max(|x_i[:m_k]|, eps) where prefix k is renormalized, else 1; row 1 the weight of the normalization's
// own gradient, (a^k_i)^2, 0 where the norm is below eps (F.normalize's clamp: no gradient through it) or
// the prefix is not renormalized.
constexpr int64_t FACTOR_ROWS = 2;
// The key tile of both passes (the backward's raw^k must be the forward's bits: the same tile shapes): half
// the plain loss's, since the backward holds K + 2 tiles per lane (every prefix's raw^k, S and W; 1.75 MiB at
// K = 5 and 256 rows) where the plain one holds two. Measured at B = 2048, D = 768, dims (768 .. 64), one
// thread of an AMD EPYC family 25 model 17 (loaded): 256 and 512 within noise of each other (1.13 - 1.28x one
// loss), 128 no faster; 256 halves the buffers.
constexpr int64_t MATRYOSHKA_TILE_K = TILE_K / 2;
// With the mask options, both passes take the masked kernel's key tiles (TILE_K): a guide's scores are then the
// very tiles guide_label_scores reads the thresholds off (softmax_ops.cpp), so a duplicate ties its threshold.
inline int64_t prefix_tile_k(const MaskArgs* masks) { return masks ? TILE_K : MATRYOSHKA_TILE_K; }
constexpr double NORM_EPS = 1e-12;  // F.normalize's default eps, as sentence-transformers' shrink (infcl/matryoshka.py)

// One key tile's feature segments as the B operand of per-segment products, each packed once per key tile
// (ReusedB). scores: raw [ni, nj] (+)= q_i[:, seg_k] @ k_j[:, seg_k].T; else the gradient's
// dq_i[:, seg_k] += alpha * W [ni, nj] @ k_j[:, seg_k]. The same shapes take the same route in both passes,
// so the backward's raw^k is the forward's bit for bit.
template <typename T>
class KeySegments {
 public:
  KeySegments(const Prefixes& p, bool scores, int64_t rows, int64_t tk, int64_t d) : p_(p), scores_(scores), d_(d) {
    parts_.reserve(p.count());
    for (int64_t k = 0; k < p.count(); ++k) {
      parts_.emplace_back(scores, rows, scores ? tk : p.width(k), scores ? p.width(k) : tk);
    }
  }
  void set(const T* k_rows, int64_t nj, T alpha) {
    for (int64_t k = 0; k < p_.count(); ++k) {
      const int64_t w = p_.width(k);
      parts_[k].set(k_rows + p_.begin(k), d_, scores_ ? nj : w, scores_ ? w : nj, alpha);
    }
  }
  // C [ni, .] = A @ op(B_k) + beta * C.
  void product(int64_t k, int64_t ni, const T* a, int64_t lda, T beta, T* c, int64_t ldc) const {
    parts_[k].product(ni, a, lda, beta, c, ldc);
  }

 private:
  const Prefixes& p_;
  bool scores_;
  int64_t d_;
  std::vector<ReusedB<T, T, T>> parts_;
};

// What both passes' threads read: the block (BlockOperands), the prefixes and the features' factors a^k
// ([K, Bq] / [K, Bk]: row 0 of the factors).
template <typename T>
struct PrefixOperands : BlockOperands<T, T> {
  const Prefixes& prefixes;
  const T* q_factor;
  const T* k_factor;
  // Prefix k's factors over the tile at (i0, j0).
  TileFactors<T> factors(int64_t k, int64_t i0, int64_t j0) const {
    return {q_factor + k * this->bq + i0, k_factor + k * this->bk + j0};
  }
};

// q [Bq, D], k [Bk, D] contiguous float32 or float64; q_factors [2, K, Bq], k_factors [2, K, Bk]. rows
// [K, 3, Bq] (max, log-sum relative to it, the positive's logit: 0 where it lies in another block), cols
// [K, 2, Bk] (symmetric; else unused). masks (null: the plain loss): the mask options, the same for every
// prefix (formed once per tile); rows [K, MASKED_ROWS, Bq] and cols [K, MASKED_ROWS, Bk], the masked
// forward's rows (softmax.h) per prefix.
void matryoshka_forward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                        bool symmetric, const Prefixes& prefixes, const at::Tensor& q_factors,
                        const at::Tensor& k_factors, const MaskArgs* masks, at::Tensor& rows, at::Tensor& cols);

// row_stats [2, K, Bq], g_row [K, Bq], col_stats [2, K, Bk] / g_col [K, Bk] (undefined: one direction);
// dq, dk contiguous, accumulated into; dscale [2] (double): the row and column parts of the scale's gradient.
// masks (null: the plain loss) with each side's positives per prefix: count [K, n] ("mean") or stats
// [2, K, n] ("sum").
void matryoshka_backward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                         const Prefixes& prefixes, const at::Tensor& q_factors, const at::Tensor& k_factors,
                         const at::Tensor& row_stats, const at::Tensor& g_row, const at::Tensor& col_stats,
                         const at::Tensor& g_col, const MaskArgs* masks, const PositiveInputs& row_pos,
                         const PositiveInputs& col_pos, at::Tensor& dq, at::Tensor& dk, at::Tensor& dscale);

}  // namespace softmax
}  // namespace infcl
