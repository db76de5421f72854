// infcl native CPU kernel for the sigmoid (SigLIP) loss: the two block operations of the sigmoid contract
// in infcl/contract.py, fused so that each logit tile comes from one BLAS call and is consumed while
// it is still in cache.
//
//   sigmoid_forward_block(q [Bq,D], k [Bk,D], scale, pos [Bq], bias, q_ids? [Bq], k_ids? [Bk]) -> rows [Bq]
//       rows[i] = sum_j softplus(t_ij),  t_ij = -z_ij * (scale * q_i.k_j + bias),  z = +1 at column pos[i], else -1
//       (with ids: z = +1 wherever q_ids[i] == k_ids[j], pos unread)
//   sigmoid_backward_block(q, k, scale, pos, bias, g_row [Bq], dq!, dk!, q_ids?, k_ids?) -> (dscale, dbias) [2]
//       dL_ij = -z_ij * g_i * sigmoid(t_ij);  dq += scale * dL @ k;  dk += scale * dL.T @ q
//
// GEMMs per block, each 2 * Bq * Bk * D flops: forward 1 (raw = q @ k.T), backward 3 (raw again, dq, dk).
//
// Parallel layout (common.h's): the Bq rows are cut into row tiles (RowTiles: fixed by Bq alone) and the
// tiles into `lanes` contiguous ranges, one per thread. A lane walks its tiles against TILE_K key columns,
// key tiles outer, so one key tile serves all of the lane's row tiles while it is in cache; every product
// is one single-threaded call on a tile (Products below). Rows belong to one tile, so the forward's row
// losses do not depend on the thread count; in the backward each lane keeps its own dk (lane 0 writes the
// caller's, except on the brgemm route, which keeps every lane's dk transposed) and its own parameter
// sums, merged in lane order at the end, so those depend on the thread count, never on scheduling:
// bit-identical run to run.
//
// Per entry, one exp: with e = exp(-|t|) in (0, 1],
//   softplus(t) = max(t, 0) + log1p(e)        sigmoid(t) = (t >= 0 ? 1 : e) / (1 + e)
// Neither overflows for any t (no log(sigmoid(x)), which is log(0) = -inf at x = -1e4 in float32), and
// log1p keeps a tiny loss term's relative precision. float32 uses common.h's exp and the branch-free
// log1p below, which the compiler vectorizes; float64 uses libm. The positive's column is handled apart
// from the vectorized runs of negatives on either side of it.
//
// dtypes: float32 and float64 natively (ATen's sgemm / dgemm). bfloat16 by common.h's bf16 GEMM route:
// bf16 x bf16 -> float32 products (MKL's on AMX CPUs, oneDNN's brgemm on AVX512-BF16 ones), the logits
// and everything after them in float32, dL handed to the dq / dk products rounded to bfloat16 (as torch's
// bfloat16 backward has it); on CPUs with neither (AVX2 only), float32 copies of q and k (exact), as for
// float16 everywhere. MKL's bf16 GEMM runs at its sgemm rate on CPUs without AMX, which is why AVX512-BF16
// CPUs take oneDNN's brgemm; the measured ratios are in docs/benchmarks.md.
// Extra memory: one tile (plus its bf16 dS and packed key tile) per lane, (lanes - 1) dk partials of
// [Bk, D] (brgemm: lanes partials of [D, Bk] and a bf16 q.T), the float32 copies for 16-bit inputs on
// the float32 route -- never O(Bq * Bk).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "common.h"

namespace infcl {
namespace siglip {
namespace {

// Tile sizes, the row-tile grid, the lanes, the BLAS thread guard and the vectorized exp (fast_exp) are
// common.h's, shared with the softmax kernel (whose measured tile choice is not re-tuned for this loss).

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

// With ids, one row against columns [0, nj): every column with the row's id is a positive. The margin is
// selected per entry (t = -L there, L elsewhere), in one vectorized run with the same per-entry math.

// The row's loss with ids: sum_j softplus(t_ij), t = -L where k_ids[j] == id.
template <typename T>
T row_loss_ids(const T* raw, int64_t nj, int64_t id, const int64_t* k_ids, T scale, T bias) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = 0; c < nj; ++c) {
    const T l = raw[c] * scale + bias;
    acc += softplus(k_ids[c] == id ? -l : l);
  }
  return acc;
}

// The row's gradient with ids: dL = -z * g * sigmoid(t) over raw, and its parameter sums.
template <typename T>
void row_grad_ids(T* raw, int64_t nj, int64_t id, const int64_t* k_ids, T scale, T bias, T g, T& dscale, T& dbias) {
  T acc_s = 0, acc_b = 0;
#pragma omp simd reduction(+ : acc_s, acc_b)
  for (int64_t c = 0; c < nj; ++c) {
    const T x = raw[c];
    const T l = x * scale + bias;
    const bool positive = k_ids[c] == id;
    const T d = (positive ? -g : g) * sigmoid(positive ? -l : l);
    acc_s += d * x;
    acc_b += d;
    raw[c] = d;
  }
  dscale += acc_s;
  dbias += acc_b;
}

// The positives of a block: pos (ids null), or the ids (q_ids [Bq], k_ids [Bk]).
struct Positives {
  const int64_t* pos;
  const int64_t* q_ids;
  const int64_t* k_ids;
};

// Row i's loss over the tile's columns [j0, j0 + nj), raw its products.
template <typename T>
T tile_row_loss(const T* raw, int64_t nj, int64_t i, int64_t j0, const Positives& p, T scale, T bias) {
  if (p.q_ids != nullptr) return row_loss_ids(raw, nj, p.q_ids[i], p.k_ids + j0, scale, bias);
  return row_loss(raw, nj, p.pos[i] - j0, scale, bias);
}

// Row i's gradient over the tile's columns [j0, j0 + nj), in place of raw.
template <typename T>
void tile_row_grad(T* raw, int64_t nj, int64_t i, int64_t j0, const Positives& p, T scale, T bias, T g, T& dscale,
                   T& dbias) {
  if (p.q_ids != nullptr) return row_grad_ids(raw, nj, p.q_ids[i], p.k_ids + j0, scale, bias, g, dscale, dbias);
  row_grad(raw, nj, p.pos[i] - j0, scale, bias, g, dscale, dbias);
}

// ---------------------------------------------------------------------------------------------------
// Tile products. A lane owns one Products object: set_keys(j0, nj) once per key tile, then per row tile
//   scores(i0, ni) -> raw [ni, nj] = q[i0 : i0 + ni] @ k[j0 : j0 + nj].T, in the lane's buffer (Acc);
//   gradients(i0, ni, dk), raw now holding dL:  dq[i0 : i0 + ni] += scale * dL @ k[j0 : j0 + nj],
//     dk[j0 : j0 + nj] += scale * dL.T @ q[i0 : i0 + ni], dk being the lane's accumulator: [Bk, D], or
//     [D, Bk] (dk.T) on the brgemm route (backward_impl's transposed_dk).

// The block as the products read it.
template <typename In, typename Acc>
struct Operands {
  const In* q;  // [bq, ld] row-major, ld >= d (columns past d are 0)
  const In* k;  // [bk, ld]
  int64_t bk, d, ld;
  Acc scale;
  Acc* dq;          // [bq, d], backward only
  const In* q_t;    // brgemm backward only: q.T as [d, ld_t], 0 past column bq
  int64_t ld_t;
};

// float32 / float64 (and float32 copies of 16-bit inputs): common.h's gemm(), i.e. ATen's mm / addmm.
template <typename T>
class AtenProducts {
 public:
  using Acc = T;
  AtenProducts(const Operands<T, T>& o, int64_t rows, int64_t tk) : o_(o), raw_(rows * tk) {}
  void set_keys(int64_t j0, int64_t nj) { j0_ = j0, nj_ = nj; }
  T* scores(int64_t i0, int64_t ni) {
    gemm(false, true, ni, nj_, o_.d, T(1), o_.q + i0 * o_.ld, o_.ld, o_.k + j0_ * o_.ld, o_.ld, T(0), raw_.data(),
         nj_);
    return raw_.data();
  }
  void gradients(int64_t i0, int64_t ni, T* dk) {
    const T* dl = raw_.data();
    gemm(false, false, ni, o_.d, nj_, o_.scale, dl, nj_, o_.k + j0_ * o_.ld, o_.ld, T(1), o_.dq + i0 * o_.d, o_.d);
    gemm(true, false, nj_, o_.d, ni, o_.scale, dl, nj_, o_.q + i0 * o_.ld, o_.ld, T(1), dk + j0_ * o_.d, o_.d);
  }

 private:
  Operands<T, T> o_;
  std::vector<T> raw_;
  int64_t j0_ = 0, nj_ = 0;
};

// bfloat16 inputs, float32 results, by common.h's route (Mkl or Brgemm). dL is handed to the gradient
// products as bfloat16, scale folded in: dS = bf16(scale * dL), round to nearest even, as torch's own
// bfloat16 backward has it (sign-symmetric; the parameter sums take dL in float32 before that).
// Brgemm's products are common.h's BrgemmKeyTile (dk kept transposed); dS has rows of round_up_even(nj),
// a zero column when nj is odd, on both routes.
class Bf16Products {
 public:
  using Acc = float;
  Bf16Products(Bf16Gemm route, const Operands<at::BFloat16, float>& o, int64_t rows, int64_t tk, bool backward)
      : o_(o), raw_(rows * tk), ds_(backward ? rows * round_up_even(tk) : 0) {
    if (route == Bf16Gemm::Brgemm) brgemm_ = std::make_unique<BrgemmKeyTile>(rows, tk, o.ld, o.d, backward);
  }

  void set_keys(int64_t j0, int64_t nj) {
    j0_ = j0, nj_ = nj;
    if (brgemm_) brgemm_->set(o_.k + j0 * o_.ld, nj);
  }

  float* scores(int64_t i0, int64_t ni) {
    float* raw = raw_.data();
    if (brgemm_) {
      brgemm_->scores(o_.q + i0 * o_.ld, ni, raw);
    } else {
      gemm(false, true, ni, nj_, o_.d, 1.0f, o_.q + i0 * o_.ld, o_.ld, o_.k + j0_ * o_.ld, o_.ld, 0.0f, raw, nj_);
    }
    return raw;
  }

  void gradients(int64_t i0, int64_t ni, float* dk) {
    const int64_t ld_ds = round_up_even(nj_);
    for (int64_t r = 0; r < ni; ++r) {
      const float* dl = raw_.data() + r * nj_;
      uint16_t* out = ds_.data() + r * ld_ds;
      const float sc = o_.scale;
#pragma omp simd
      for (int64_t c = 0; c < nj_; ++c) out[c] = to_bf16_bits(sc * dl[c]);
      if (ld_ds != nj_) out[nj_] = 0;
    }
    const at::BFloat16* ds = reinterpret_cast<const at::BFloat16*>(ds_.data());
    float* dq = o_.dq + i0 * o_.d;
    if (brgemm_) {
      brgemm_->add_dq(ds, ld_ds, ni, dq, o_.d);
      brgemm_->add_dk_t(o_.q_t + i0, o_.ld_t, ds, ld_ds, ni, dk + j0_, o_.bk);
    } else {
      gemm(false, false, ni, o_.d, nj_, 1.0f, ds, ld_ds, o_.k + j0_ * o_.ld, o_.ld, 1.0f, dq, o_.d);
      gemm(true, false, nj_, o_.d, ni, 1.0f, ds, ld_ds, o_.q + i0 * o_.ld, o_.ld, 1.0f, dk + j0_ * o_.d, o_.d);
    }
  }

 private:
  Operands<at::BFloat16, float> o_;
  std::vector<float> raw_;
  std::vector<uint16_t> ds_;
  std::unique_ptr<BrgemmKeyTile> brgemm_;  // null: MKL
  int64_t j0_ = 0, nj_ = 0;
};

// Calls visit(products, lane, i0, ni, j0, nj, raw) for every tile of every lane of this thread (RowTiles,
// lanes: common.h), key tiles outer, raw [ni, nj] = q[i0 : i0 + ni] @ k[j0 : j0 + nj].T. make(tk) builds
// a lane's products for key tiles of tk columns.
template <typename Make, typename Visit>
void for_each_tile(int64_t bk, const RowTiles& tiles, int64_t lanes, Make make, Visit visit) {
  at::parallel_for(0, lanes, 1, [&](int64_t first, int64_t last) {
    const SingleThreadedBlas one_thread;
    const int64_t tk = std::min(TILE_K, bk);
    auto products = make(tk);
    for (int64_t lane = first; lane < last; ++lane) {
      for (int64_t j0 = 0; j0 < bk; j0 += tk) {
        const int64_t nj = std::min(tk, bk - j0);
        products.set_keys(j0, nj);
        for (int64_t t = lane_start(tiles, lanes, lane); t < lane_start(tiles, lanes, lane + 1); ++t) {
          const int64_t i0 = tiles.begin(t), ni = tiles.height(t);
          visit(products, lane, i0, ni, j0, nj, products.scores(i0, ni));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------

// rows[i] = sum_j softplus(t_ij); make(tk) builds a lane's products.
template <typename Acc, typename Make>
void forward_impl(int64_t bq, int64_t bk, const Positives& pos, Acc scale, Acc bias, Make make, Acc* out) {
  // Row sums in double: a row adds Bk positive terms, tile by tile.
  std::vector<double> sums(bq, 0.0);
  const RowTiles tiles(bq);
  for_each_tile(bk, tiles, lane_count(tiles), make,
                [&](auto&, int64_t, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const Acc* raw) {
                  for (int64_t r = 0; r < ni; ++r) {
                    sums[i0 + r] += tile_row_loss(raw + r * nj, nj, i0 + r, j0, pos, scale, bias);
                  }
                });
  for (int64_t i = 0; i < bq; ++i) out[i] = static_cast<Acc>(sums[i]);
}

// dq (contiguous, accumulated: the products hold it), dk (contiguous, accumulated), dparams = (dscale,
// dbias); make(tk) builds a lane's products, which take dk transposed when transposed_dk.
template <typename Acc, typename Make>
void backward_impl(int64_t bq, int64_t bk, int64_t d, const Positives& pos, Acc scale, Acc bias, const Acc* g,
                   bool transposed_dk, Make make, at::Tensor& dk, at::Tensor& dparams) {
  const RowTiles tiles(bq);
  const int64_t lanes = lane_count(tiles);
  // The lanes' dk accumulators: lane 0 the caller's dk and every other lane its own [Bk, D] partial; or,
  // transposed, every lane its own [D, Bk].
  const int64_t own = transposed_dk ? lanes : lanes - 1;
  at::Tensor parts;
  if (own > 0) parts = transposed_dk ? at::zeros({own, d, bk}, dk.options()) : at::zeros({own, bk, d}, dk.options());
  Acc* dk_base = dk.data_ptr<Acc>();
  Acc* parts_base = own > 0 ? parts.data_ptr<Acc>() : nullptr;
  auto lane_dk = [&](int64_t lane) {
    if (transposed_dk) return parts_base + lane * d * bk;
    return lane == 0 ? dk_base : parts_base + (lane - 1) * bk * d;
  };
  at::Tensor lane_params = at::zeros({lanes, 2}, at::kDouble);  // (dscale, dbias) per lane
  double* per_lane = lane_params.data_ptr<double>();
  for_each_tile(bk, tiles, lanes, make,
                [&](auto& products, int64_t lane, int64_t i0, int64_t ni, int64_t j0, int64_t nj, Acc* raw) {
                  Acc dscale = 0, dbias = 0;
                  for (int64_t r = 0; r < ni; ++r) {
                    tile_row_grad(raw + r * nj, nj, i0 + r, j0, pos, scale, bias, g[i0 + r], dscale, dbias);
                  }
                  per_lane[2 * lane] += dscale;
                  per_lane[2 * lane + 1] += dbias;
                  products.gradients(i0, ni, lane_dk(lane));
                });
  // Merged in lane order, whichever thread ran which lane.
  if (transposed_dk) {
    for (int64_t p = 1; p < lanes; ++p) parts[0].add_(parts[p]);
    dk.add_(parts[0].t());
  } else {
    for (int64_t p = 0; p < own; ++p) dk.add_(parts[p]);
  }
  dparams.copy_(lane_params.sum(0));
}

// ---------------------------------------------------------------------------------------------------
// Op entry points: check, bring the inputs into the layout the kernels read (contiguous; bfloat16 as is
// on a bf16 GEMM route, else as float32 like float16), dispatch on dtype.

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& pos) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "infcl native sigmoid: q and k must be CPU tensors");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.size(1) == k.size(1), "infcl native sigmoid: q ", q.sizes(),
              " and k ", k.sizes(), " must be [B, D] with one D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "infcl native sigmoid: q and k dtypes differ");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "infcl native sigmoid: unsupported dtype ", q.scalar_type());
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == q.size(0), "infcl native sigmoid: pos must be [", q.size(0),
              "], got ", pos.sizes());
}

at::Tensor prepared(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

// The block's positives as the kernels read them: pos, or (both given) the ids, int64 and contiguous (an
// id view is copied, O(B)). `held` keeps the prepared tensors alive.
Positives positives(const at::Tensor& q, const at::Tensor& k, const at::Tensor& pos,
                    const std::optional<at::Tensor>& q_ids, const std::optional<at::Tensor>& k_ids,
                    std::vector<at::Tensor>& held) {
  TORCH_CHECK(q_ids.has_value() == k_ids.has_value(), "infcl native sigmoid: pass q_ids and k_ids, or neither");
  held.push_back(prepared(pos, at::kLong));
  if (!q_ids.has_value()) return {held[0].data_ptr<int64_t>(), nullptr, nullptr};
  TORCH_CHECK(q_ids->dim() == 1 && q_ids->size(0) == q.size(0) && k_ids->dim() == 1 && k_ids->size(0) == k.size(0),
              "infcl native sigmoid: q_ids ", q_ids->sizes(), " and k_ids ", k_ids->sizes(), " must be [", q.size(0),
              "] and [", k.size(0), "]");
  held.push_back(prepared(*q_ids, at::kLong));
  held.push_back(prepared(*k_ids, at::kLong));
  return {held[0].data_ptr<int64_t>(), held[1].data_ptr<int64_t>(), held[2].data_ptr<int64_t>()};
}

at::Tensor sigmoid_forward_block(const at::Tensor& q_in, const at::Tensor& k_in, double scale,
                                 const at::Tensor& pos_in, double bias, const std::optional<at::Tensor>& q_ids,
                                 const std::optional<at::Tensor>& k_ids) {
  check_inputs(q_in, k_in, pos_in);
  const auto acc = accumulation_type(q_in.scalar_type());
  std::vector<at::Tensor> held;
  const Positives pp = positives(q_in, k_in, pos_in, q_ids, k_ids, held);
  const int64_t bq = q_in.size(0), bk = k_in.size(0), d = q_in.size(1);
  at::Tensor rows = at::empty({bq}, q_in.options().dtype(acc));
  const Bf16Gemm route = bf16_route(q_in);
  if (route != Bf16Gemm::None) {
    const int64_t ld = bf16_row_length(route, d);
    const at::Tensor q = with_row_length(q_in, ld), k = with_row_length(k_in, ld);
    const Operands<at::BFloat16, float> o{q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), bk, d, ld,
                                          static_cast<float>(scale), nullptr, nullptr, 0};
    forward_impl<float>(bq, bk, pp, static_cast<float>(scale), static_cast<float>(bias),
                        [&](int64_t tk) { return Bf16Products(route, o, RowTiles(bq).size, tk, false); },
                        rows.data_ptr<float>());
    return rows;
  }
  const at::Tensor q = prepared(q_in, acc), k = prepared(k_in, acc);
  if (acc == at::kDouble) {
    const Operands<double, double> o{q.data_ptr<double>(), k.data_ptr<double>(), bk, d, d, scale, nullptr, nullptr, 0};
    forward_impl<double>(bq, bk, pp, scale, bias,
                         [&](int64_t tk) { return AtenProducts<double>(o, RowTiles(bq).size, tk); },
                         rows.data_ptr<double>());
  } else {
    const Operands<float, float> o{q.data_ptr<float>(), k.data_ptr<float>(), bk, d, d, static_cast<float>(scale),
                                   nullptr, nullptr, 0};
    forward_impl<float>(bq, bk, pp, static_cast<float>(scale), static_cast<float>(bias),
                        [&](int64_t tk) { return AtenProducts<float>(o, RowTiles(bq).size, tk); },
                        rows.data_ptr<float>());
  }
  return rows;
}

at::Tensor sigmoid_backward_block(const at::Tensor& q_in, const at::Tensor& k_in, double scale,
                                  const at::Tensor& pos_in, double bias, const at::Tensor& g_row, at::Tensor& dq,
                                  at::Tensor& dk, const std::optional<at::Tensor>& q_ids,
                                  const std::optional<at::Tensor>& k_ids) {
  check_inputs(q_in, k_in, pos_in);
  const auto acc = accumulation_type(q_in.scalar_type());
  TORCH_CHECK(g_row.dim() == 1 && g_row.size(0) == q_in.size(0), "infcl native sigmoid: g_row must be [",
              q_in.size(0), "], got ", g_row.sizes());
  std::vector<at::Tensor> held;
  const Positives pp = positives(q_in, k_in, pos_in, q_ids, k_ids, held);
  const at::Tensor g = prepared(g_row, acc);
  const int64_t bq = q_in.size(0), bk = k_in.size(0), d = q_in.size(1);
  ContiguousGrads grads(dq, dk, q_in, k_in, acc, "infcl native sigmoid");
  at::Tensor& dq_c = grads.dq;
  at::Tensor& dk_c = grads.dk;
  at::Tensor dparams = at::zeros({2}, at::TensorOptions().dtype(at::kDouble));
  const Bf16Gemm route = bf16_route(q_in);
  if (route != Bf16Gemm::None) {
    const int64_t ld = bf16_row_length(route, d);
    const at::Tensor q = with_row_length(q_in, ld), k = with_row_length(k_in, ld);
    // brgemm: q.T [d, even(bq)], zero past column bq
    const at::Tensor q_t = route == Bf16Gemm::Brgemm ? transposed_pairs_operand(q_in) : at::Tensor();
    const Operands<at::BFloat16, float> o{q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), bk, d, ld,
                                          static_cast<float>(scale), dq_c.data_ptr<float>(),
                                          q_t.defined() ? q_t.data_ptr<at::BFloat16>() : nullptr,
                                          q_t.defined() ? q_t.size(1) : 0};
    backward_impl<float>(bq, bk, d, pp, static_cast<float>(scale), static_cast<float>(bias), g.data_ptr<float>(),
                         route == Bf16Gemm::Brgemm,
                         [&](int64_t tk) { return Bf16Products(route, o, RowTiles(bq).size, tk, true); }, dk_c,
                         dparams);
  } else if (acc == at::kDouble) {
    const at::Tensor q = prepared(q_in, acc), k = prepared(k_in, acc);
    const Operands<double, double> o{q.data_ptr<double>(), k.data_ptr<double>(), bk, d, d, scale,
                                     dq_c.data_ptr<double>(), nullptr, 0};
    backward_impl<double>(bq, bk, d, pp, scale, bias, g.data_ptr<double>(), false,
                          [&](int64_t tk) { return AtenProducts<double>(o, RowTiles(bq).size, tk); }, dk_c, dparams);
  } else {
    const at::Tensor q = prepared(q_in, acc), k = prepared(k_in, acc);
    const Operands<float, float> o{q.data_ptr<float>(), k.data_ptr<float>(), bk, d, d, static_cast<float>(scale),
                                   dq_c.data_ptr<float>(), nullptr, 0};
    backward_impl<float>(bq, bk, d, pp, static_cast<float>(scale), static_cast<float>(bias), g.data_ptr<float>(),
                         false, [&](int64_t tk) { return AtenProducts<float>(o, RowTiles(bq).size, tk); }, dk_c,
                         dparams);
  }
  grads.write_back();
  return dparams.to(acc);
}

}  // namespace

// The op schemas: csrc/library.cpp.
TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("sigmoid_forward_block", &sigmoid_forward_block).impl("sigmoid_backward_block", &sigmoid_backward_block);
}

}  // namespace siglip

}  // namespace infcl
