// The softmax (InfoNCE / CLIP) loss's native kernel, split by phase: softmax_gemm.h (tile products),
// softmax_masks.h (mask options), softmax_forward.cpp, softmax_backward.cpp, softmax_ops.cpp (the ops:
// checks, layout, registration). This header is what the phases share; the design is docs/kernels.md's
// "Native CPU kernel".

#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <type_traits>

#include "softmax_masks.h"

namespace infcl {
namespace softmax {

// The one-exp-per-entry shortcuts of the symmetric loss, float32 and bfloat16. The forward takes
// e = exp(S - M) against the tile max M for both the row and the column sums (add_row_col_terms), the
// backward P_col = exp(x_col) as exp(x_row) * exp(L_row - L_col) (SharedRef), each only where the tile's
// maxima or log-sum-exps lie within a span (SHARED_REF_SPAN, LSE_REF_SPAN) that bounds the cost: the
// rounding of the shared argument, up to ~2^-24 * (that spread) relative to a term or a probability --
// the order of what vanilla float32 itself puts into S - lse (|S| * 2^-24), and far below bfloat16's
// 2^-9. The exact parts stay exact: the forward's entries equal to their max are counted, never summed,
// and the backward forms the positive's entry from its own x_row and x_col. Measured (AMD Zen 3, one
// thread, D = 16 where the elementwise passes dominate): two exps per entry made float32's fwd + bwd
// 12-15% slower. float64, the reference dtype, takes two exps per entry, each against its own stats.
template <typename In>
constexpr bool kOneExp = !std::is_same<In, double>::value;

template <typename T>
inline T nan_max(T a, T b) {
  // max that keeps a NaN from either side.
  return (a > b || a != a) ? a : b;
}

// exp(old - new) for rescaling a running sum (double) when its running max grows, in double (once per
// row or column per tile); exactly 1 when the max did not move (this also covers old == new == -inf,
// where the difference would be NaN), so a sum's largest term stays exactly 1.
template <typename T>
inline double rescale_factor(T old_max, T new_max) {
  return old_max == new_max ? 1.0 : std::exp(static_cast<double>(old_max) - static_cast<double>(new_max));
}

// The per-block entry points, called by softmax_ops.cpp with the inputs checked and laid out as the kernel
// reads them (contiguous; float32, float64, or bfloat16 on a bf16 GEMM route); brgemm: bfloat16 on the
// Brgemm route. masks: null for the plain loss.

// Rows of the masked forward's results (infcl/masks.py): MASKED_ROWS, the stats over the entries kept (2),
// then the positives' max, log-sum relative to it, sum and count; with kept sums (label smoothing's uniform
// part) KEPT_ROWS, then the sum of the kept logits and their number.
constexpr int64_t MASKED_ROWS = 6;
constexpr int64_t KEPT_SUM_ROW = 6;
constexpr int64_t KEPT_ROWS = 8;

// rows [3, bq] and cols [2, bk] (plain) or [MASKED_ROWS, n] (masked; masks null: the plain loss), [KEPT_ROWS, n]
// with kept_sums (masked only); cols [., 0] unless symmetric.
void forward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
             const MaskArgs* masks, bool kept_sums, bool brgemm, at::Tensor& rows, at::Tensor& cols);

// The masked backward's positives of one side: the global count for "mean" ([n]), the stats for "sum"
// ([2, n]: max, log-sum relative to it); undefined where not needed.
struct PositiveInputs {
  at::Tensor count, stats;
};

// dq, dk: contiguous, accumulated into; dscale [2] (double): the row and column parts of the scale's
// gradient. col_stats / g_col undefined for one direction. row_uniform [bq] / col_uniform [bk] (masked only,
// contiguous, accumulation dtype; undefined: none): label smoothing's uniform weights, subtracted from dS on
// every entry the row (column) keeps; col_uniform defined with row_uniform when col_stats is.
void backward(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
              const at::Tensor& row_stats, const at::Tensor& g_row, const at::Tensor& col_stats,
              const at::Tensor& g_col, at::Tensor& dq, at::Tensor& dk, at::Tensor& dscale, bool brgemm,
              const MaskArgs* masks, const PositiveInputs& row_pos, const PositiveInputs& col_pos,
              const at::Tensor& row_uniform, const at::Tensor& col_uniform);

}  // namespace softmax
}  // namespace infcl
