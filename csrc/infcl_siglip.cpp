// infcl native CPU kernel for the sigmoid (SigLIP) loss: the two block operations of the sigmoid contract
// in infcl/backends/base.py, fused so that each logit tile comes from one BLAS call and is consumed while
// it is still in cache.
//
//   sigmoid_forward_block(q [Bq,D], k [Bk,D], pos [Bq], scale, bias) -> rows [Bq]
//       rows[i] = sum_j softplus(t_ij),  t_ij = -z_ij * (scale * q_i.k_j + bias),  z = +1 at column pos[i], else -1
//   sigmoid_backward_block(q, k, pos, scale, bias, g_row [Bq], dq!, dk!) -> (dscale, dbias) [2]
//       dL_ij = -z_ij * g_i * sigmoid(t_ij);  dq += scale * dL @ k;  dk += scale * dL.T @ q
//
// GEMMs per block, each 2 * Bq * Bk * D flops: forward 1 (raw = q @ k.T), backward 3 (raw again, dq, dk).
//
// Parallel layout (common.h's): the Bq rows are cut into row tiles (RowTiles: fixed by Bq alone) and the
// tiles into `lanes` contiguous ranges, one per thread. A lane walks its tiles against TILE_K key columns,
// key tiles outer, so one key tile serves all of the lane's row tiles while it is in cache; every product
// is one single-threaded ATen call (MKL sgemm / dgemm) on a tile. Rows belong to one tile, so the
// forward's row losses do not depend on the thread count; in the backward each lane keeps its own dk
// (lane 0 writes the caller's) and its own parameter sums, merged in lane order at the end, so those
// depend on the thread count, never on scheduling: bit-identical run to run.
//
// Per entry, one exp: with e = exp(-|t|) in (0, 1],
//   softplus(t) = max(t, 0) + log1p(e)        sigmoid(t) = (t >= 0 ? 1 : e) / (1 + e)
// Neither overflows for any t (no log(sigmoid(x)), which is log(0) = -inf at x = -1e4 in float32), and
// log1p keeps a tiny loss term's relative precision. float32 uses common.h's exp and the branch-free
// log1p below, which the compiler vectorizes; float64 uses libm. The positive's column is handled apart
// from the vectorized runs of negatives on either side of it.
//
// dtypes: float32 and float64 natively; bfloat16 and float16 on float32 copies of q and k (exact). Tried
// and dropped: MKL's bf16 x bf16 -> fp32 GEMM (cblas_gemm_bf16bf16f32, which csrc/infcl_cpu.cpp uses on
// AMX machines) for all three products. Correct, but on the AMD EPYC this was measured on (avx512_bf16,
// no AMX) it runs 256 x 512 x 512 tile products at the sgemm rate (43 vs 40 GFLOP/s on one thread,
// interleaved), so it gains nothing here; oneDNN's bf16 matmul, which the vanilla loss gets through
// at::mm (~4x that rate), has no float32 output on CPU in ATen.
// Extra memory: one tile per lane, (lanes - 1) dk partials of [Bk, D], the float32 copies for 16-bit
// inputs -- never O(Bq * Bk).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace infcl {
namespace siglip {
namespace {

// Tile sizes, the row-tile grid, the lanes, the BLAS thread guard and the vectorized exp (fast_exp) are
// common.h's, shared with infcl_cpu.cpp (whose measured tile choice is not re-tuned for this loss).

// log(1 + u) for u in [0, 1] as 2 atanh(s), s = u / (2 + u) in [0, 1/3]: an odd series in s whose terms
// shrink at least 9x each (truncated after s^15: < 2e-9 relative). s is formed without cancellation, so
// a tiny u keeps its digits (log1p(u) ~ u), which is what a confidently right logit's loss term is.
inline float log1p_unit(float u) {
  const float s = u / (2.0f + u);
  const float w = s * s;
  float p = 1.0f / 15;
  p = p * w + 1.0f / 13;
  p = p * w + 1.0f / 11;
  p = p * w + 1.0f / 9;
  p = p * w + 1.0f / 7;
  p = p * w + 1.0f / 5;
  p = p * w + 1.0f / 3;
  p = p * w + 1.0f;
  return 2.0f * s * p;
}

// float64 is the exact path: libm.
inline double log1p_unit(double u) { return std::log1p(u); }

// The per-entry loss softplus(t) = -log sigmoid(-t) and its derivative sigmoid(t), stable for every t.
template <typename T>
inline T softplus(T t) {
  return std::max(t, T(0)) + log1p_unit(fast_exp(-std::abs(t)));
}

template <typename T>
inline T sigmoid(T t) {
  const T e = fast_exp(-std::abs(t));
  return (t >= T(0) ? T(1) : e) / (T(1) + e);
}

// ---------------------------------------------------------------------------------------------------
// One row of a logit tile. `raw` holds q_i.k_j for the tile's nj columns; the row's positive is column
// p of the tile when 0 <= p < nj. Columns [0, p) and (p, nj) are negatives (t = L), run vectorized; the
// arguments are plain values so that the stores into `raw` cannot alias them (the loops stay vectorized).

// sum of softplus(L) over the negatives in columns [c0, c1).
template <typename T>
T negatives_loss(const T* raw, int64_t c0, int64_t c1, T scale, T bias) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = c0; c < c1; ++c) acc += softplus(raw[c] * scale + bias);
  return acc;
}

// The row's loss: sum_j softplus(t_ij).
template <typename T>
T row_loss(const T* raw, int64_t nj, int64_t p, T scale, T bias) {
  if (p < 0 || p >= nj) return negatives_loss(raw, 0, nj, scale, bias);
  return negatives_loss(raw, 0, p, scale, bias) + softplus(-(raw[p] * scale + bias)) +
         negatives_loss(raw, p + 1, nj, scale, bias);
}

// Columns [c0, c1) of negatives: raw becomes dL = g * sigmoid(L); adds sum(dL * raw) and sum(dL).
template <typename T>
void negatives_grad(T* raw, int64_t c0, int64_t c1, T scale, T bias, T g, T& dscale, T& dbias) {
  T acc_s = 0, acc_b = 0;
#pragma omp simd reduction(+ : acc_s, acc_b)
  for (int64_t c = c0; c < c1; ++c) {
    const T x = raw[c];
    const T d = g * sigmoid(x * scale + bias);
    acc_s += d * x;
    acc_b += d;
    raw[c] = d;
  }
  dscale += acc_s;
  dbias += acc_b;
}

// The row's gradient: dL over raw (the positive's -g * sigmoid(-L), never g * (sigmoid(L) - 1)) and its
// parameter sums.
template <typename T>
void row_grad(T* raw, int64_t nj, int64_t p, T scale, T bias, T g, T& dscale, T& dbias) {
  if (p < 0 || p >= nj) return negatives_grad(raw, 0, nj, scale, bias, g, dscale, dbias);
  negatives_grad(raw, 0, p, scale, bias, g, dscale, dbias);
  negatives_grad(raw, p + 1, nj, scale, bias, g, dscale, dbias);
  const T x = raw[p];
  const T d = -g * sigmoid(-(x * scale + bias));
  dscale += d * x;
  dbias += d;
  raw[p] = d;
}

// ---------------------------------------------------------------------------------------------------
// Tile products through ATen on row-major tiles (leading dimension = the row length).

template <typename T>
at::Tensor tile(const T* data, int64_t rows, int64_t cols) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// Calls visit(lane, i0, ni, j0, nj, raw) for every tile of every lane of this thread (RowTiles, lanes:
// common.h), key tiles outer, after raw [ni, nj] = q[i0 : i0 + ni] @ k[j0 : j0 + nj].T has been computed
// into the lane's buffer.
template <typename T, typename Visit>
void for_each_tile(const T* q, const T* k, int64_t bk, int64_t d, const RowTiles& tiles, int64_t lanes,
                   Visit visit) {
  at::parallel_for(0, lanes, 1, [&](int64_t first, int64_t last) {
    const SingleThreadedBlas one_thread;
    const int64_t tk = std::min(TILE_K, bk);
    std::vector<T> buf(tiles.size * tk);
    for (int64_t lane = first; lane < last; ++lane) {
      for (int64_t j0 = 0; j0 < bk; j0 += tk) {
        const int64_t nj = std::min(tk, bk - j0);
        const at::Tensor k_tile = tile(k + j0 * d, nj, d);
        for (int64_t t = lane_start(tiles, lanes, lane); t < lane_start(tiles, lanes, lane + 1); ++t) {
          const int64_t i0 = tiles.begin(t), ni = tiles.height(t);
          at::Tensor raw = tile(buf.data(), ni, nj);
          at::mm_out(raw, tile(q + i0 * d, ni, d), k_tile.t());
          visit(lane, i0, ni, j0, nj, buf.data());
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const int64_t* pos, T scale, T bias, T* out) {
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  // Row sums in double: a row adds Bk positive terms, tile by tile.
  std::vector<double> sums(bq, 0.0);
  const RowTiles tiles(bq);
  for_each_tile<T>(q.data_ptr<T>(), k.data_ptr<T>(), bk, d, tiles, lane_count(tiles),
                   [&](int64_t, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const T* raw) {
                     for (int64_t r = 0; r < ni; ++r) {
                       sums[i0 + r] += row_loss(raw + r * nj, nj, pos[i0 + r] - j0, scale, bias);
                     }
                   });
  for (int64_t i = 0; i < bq; ++i) out[i] = static_cast<T>(sums[i]);
}

template <typename T>
void backward_impl(const at::Tensor& q, const at::Tensor& k, const int64_t* pos, T scale, T bias, const T* g,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dparams) {
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const RowTiles tiles(bq);
  const int64_t lanes = lane_count(tiles);
  // Lane 0 accumulates into the caller's dk, every other lane into its own partial.
  at::Tensor dk_parts = lanes > 1 ? at::zeros({lanes - 1, bk, d}, dk.options()) : at::Tensor();
  at::Tensor lane_params = at::zeros({lanes, 2}, at::kDouble);  // (dscale, dbias) per lane
  double* per_lane = lane_params.data_ptr<double>();
  for_each_tile<T>(qp, kp, bk, d, tiles, lanes, [&](int64_t lane, int64_t i0, int64_t ni, int64_t j0, int64_t nj, T* raw) {
    T dscale = 0, dbias = 0;
    for (int64_t r = 0; r < ni; ++r) {
      row_grad(raw + r * nj, nj, pos[i0 + r] - j0, scale, bias, g[i0 + r], dscale, dbias);
    }
    per_lane[2 * lane] += dscale;
    per_lane[2 * lane + 1] += dbias;
    const at::Tensor ds = tile(raw, ni, nj);
    dq.narrow(0, i0, ni).addmm_(ds, tile(kp + j0 * d, nj, d), 1, scale);
    at::Tensor dk_lane = lane == 0 ? dk : dk_parts[lane - 1];
    dk_lane.narrow(0, j0, nj).addmm_(ds.t(), tile(qp + i0 * d, ni, d), 1, scale);
  });
  // Merged in lane order, whichever thread ran which lane.
  for (int64_t p = 1; p < lanes; ++p) dk.add_(dk_parts[p - 1]);
  dparams.copy_(lane_params.sum(0));
}

// ---------------------------------------------------------------------------------------------------
// Op entry points: check, bring the inputs into the layout the kernels read (contiguous; 16-bit floats as
// float32), dispatch on dtype.

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& pos) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "infcl native sigmoid: q and k must be CPU tensors");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.size(1) == k.size(1), "infcl native sigmoid: q ", q.sizes(),
              " and k ", k.sizes(), " must be [B, D] with one D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "infcl native sigmoid: q and k dtypes differ");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "infcl native sigmoid: unsupported dtype ", q.scalar_type());
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == q.size(0), "infcl native sigmoid: pos must be [", q.size(0),
              "], got ", pos.sizes());
}

at::ScalarType acc_type(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor prepared(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

at::Tensor sigmoid_forward_block(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& pos_in,
                                 double scale, double bias) {
  check_inputs(q_in, k_in, pos_in);
  const auto acc = acc_type(q_in);
  const at::Tensor q = prepared(q_in, acc), k = prepared(k_in, acc), pos = prepared(pos_in, at::kLong);
  at::Tensor rows = at::empty({q.size(0)}, q.options());
  if (acc == at::kDouble) {
    forward_impl<double>(q, k, pos.data_ptr<int64_t>(), scale, bias, rows.data_ptr<double>());
  } else {
    forward_impl<float>(q, k, pos.data_ptr<int64_t>(), static_cast<float>(scale), static_cast<float>(bias),
                        rows.data_ptr<float>());
  }
  return rows;
}

at::Tensor sigmoid_backward_block(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& pos_in,
                                  double scale, double bias, const at::Tensor& g_row, at::Tensor& dq, at::Tensor& dk) {
  check_inputs(q_in, k_in, pos_in);
  const auto acc = acc_type(q_in);
  TORCH_CHECK(g_row.dim() == 1 && g_row.size(0) == q_in.size(0), "infcl native sigmoid: g_row must be [",
              q_in.size(0), "], got ", g_row.sizes());
  TORCH_CHECK(dq.scalar_type() == acc && dk.scalar_type() == acc, "infcl native sigmoid: dq and dk must be ", acc);
  TORCH_CHECK(dq.sizes() == q_in.sizes() && dk.sizes() == k_in.sizes(), "infcl native sigmoid: dq ", dq.sizes(),
              " / dk ", dk.sizes(), " must match q ", q_in.sizes(), " / k ", k_in.sizes());
  const at::Tensor q = prepared(q_in, acc), k = prepared(k_in, acc), pos = prepared(pos_in, at::kLong);
  const at::Tensor g = prepared(g_row, acc);
  // Accumulate into contiguous buffers; copy back only when the caller's dq / dk are strided.
  at::Tensor dq_c = dq.is_contiguous() ? dq : dq.contiguous();
  at::Tensor dk_c = dk.is_contiguous() ? dk : dk.contiguous();
  at::Tensor dparams = at::zeros({2}, at::TensorOptions().dtype(at::kDouble));
  if (acc == at::kDouble) {
    backward_impl<double>(q, k, pos.data_ptr<int64_t>(), scale, bias, g.data_ptr<double>(), dq_c, dk_c, dparams);
  } else {
    backward_impl<float>(q, k, pos.data_ptr<int64_t>(), static_cast<float>(scale), static_cast<float>(bias),
                         g.data_ptr<float>(), dq_c, dk_c, dparams);
  }
  if (!dq.is_same(dq_c)) dq.copy_(dq_c);
  if (!dk.is_same(dk_c)) dk.copy_(dk_c);
  return dparams.to(acc);
}

}  // namespace
}  // namespace siglip

// The namespace `infcl` is defined by csrc/infcl_cpu.cpp's TORCH_LIBRARY; this file adds its ops to it.
TORCH_LIBRARY_FRAGMENT(infcl, m) {
  m.def("sigmoid_forward_block(Tensor q, Tensor k, Tensor pos, float scale, float bias) -> Tensor");
  m.def(
      "sigmoid_backward_block(Tensor q, Tensor k, Tensor pos, float scale, float bias, Tensor g_row, "
      "Tensor(a!) dq, Tensor(b!) dk) -> Tensor");
}

TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("sigmoid_forward_block", &siglip::sigmoid_forward_block);
  m.impl("sigmoid_backward_block", &siglip::sigmoid_backward_block);
}

}  // namespace infcl
