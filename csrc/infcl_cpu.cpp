// infcl native CPU kernel: the two block operations of the softmax contrastive loss (the contract is
// infcl/backends/base.py), fused so each S tile is produced by one BLAS call and consumed while it is
// still in cache.
//
//   forward_block(q [Bq,D], k [Bk,D], scale, pos [Bq], symmetric) -> (rows [3,Bq], cols [2,Bk] or [2,0])
//   backward_block(q, k, scale, pos, row_stats [2,Bq], g_row [Bq], col_stats? [2,Bk], g_col? [Bk], dq!, dk!)
//       -> dscale [2] (row part, column part)
//   masked_forward_block(q, k, scale, pos, symmetric, multi_positive?, q_ids? [Bq], k_ids? [Bk],
//       guide_q? [Bq,D'], guide_k? [Bk,D'], row_threshold? [Bq], col_threshold? [Bk])
//       -> (rows [6,Bq], cols [6,Bk] or [6,0])
//   masked_backward_block(q, k, scale, pos, row_stats, g_row, col_stats?, g_col?, multi_positive?, q_ids?,
//       k_ids?, guide_q?, guide_k?, row_threshold?, col_threshold?, row_pos_count? [Bq], row_pos_stats? [2,Bq],
//       col_pos_count? [Bk], col_pos_stats? [2,Bk], dq!, dk!) -> dscale [2]
//   guide_label_scores(guide_q [Bq,D'], guide_k [Bk,D'], pos [Bq]) -> [Bq] G[i, pos[i]] off the masked
//       ops' own guide tiles (0 where pos[i] < 0): the guide thresholds' scores
//
// Stats are (running max m, r = log sum exp(S - m)); rows[2] is S at each row's positive column pos[i]
// (-1: elsewhere; then 0). The backward forms dS = g_row (P_row - Y) + g_col (P_col - Y) in the tile,
// P = exp((S - m) - r), the positive's entry as g expm1(.), and dscale as sums of per-entry dS * raw.
//
// The masked ops are the mask options of infcl/masks.py (ids, multi_positive None / "mean" / "sum", a
// guide with its thresholds): per tile, TileMasks forms each row's positives (the one-hot of pos, or the
// same-id columns) and, only for rows that have any, one byte per entry of the exclusions E (same id and
// not a positive, or a guide score G = guide_q @ guide_k.T above the row's threshold -- the column's, for
// the column direction -- and not a positive), the guide scores being one extra product per tile in the
// guide's dtype. The forward's stats skip E (an excluded logit is -inf in the tile, or, where rows and
// columns exclude differently, skipped by its mask byte) and its rows 2-5 are
// the positives' max, log-sum relative to it ("sum"), sum and count; the backward's dS is 0 on E and
// P - Y at the positives with Y = 1 / |P| ("mean") or softmax over P ("sum"), each in an expm1 form
// (positive_term). The plain ops are untouched by all this (their code paths test one null pointer per
// tile or row); with ids that never repeat, the masked ops give the plain ops' bits.
//
// Exactness rests on three things. (1) S = raw * scale is recomputed bit-identically: both passes take
// raw = q_i @ k_j.T from the same BLAS route on the same tiles (RawTiles) and round the one product
// raw * scale to memory (scale_tile), never folded into the GEMM or fused into a later subtraction;
// so S - m is exact where it matters (Sterbenz) and a confident row's P - 1 keeps its digits. (2) The
// forward keeps the entries equal to the max (each exactly exp(0) = 1) out of the sum of the others,
// so r = log1p((count - 1) + rest) has full relative precision and r >= 0: losses (m - pos) + r are
// never negative. (3) Nothing depends on the sign of the upstream gradient: negating g negates every
// output bit for bit.
//
// Parallel layout: S is cut into a grid of row tiles (RowTiles: fixed by Bq alone) times TILE_K key
// columns; every product is a single-threaded BLAS call on a cache-sized tile (MKL's packed sgemm or
// at::mm_out / addmm_ for float32 and float64; for bfloat16 common.h's bf16 GEMM route: MKL's bf16 x bf16
// -> fp32 GEMM on AMX CPUs, oneDNN's brgemm on AVX512-BF16 ones, float32 copies elsewhere), by a route
// fixed by the tile's shape (ReusedB) and the CPU, so S is the same bits whatever the thread count of
// either pass. The measured ratios are in docs/benchmarks.md.
// The forward cuts the row tiles into column groups (at most MAX_COLUMN_GROUPS, fixed by Bq) that the
// threads share; each group keeps its own running column stats, merged in group order at the end, and
// each row tile updates its own rows' stats: the forward's outputs do not depend on the thread count.
// The backward cuts the row tiles into `lanes` contiguous ranges (one per thread), each walking key
// tiles outer; dq rows belong to one lane, dk is kept per lane and merged in lane order at the end, so
// dk and dscale depend on the backward's own thread count (never on scheduling): bit-identical run to
// run, and to a run whose forward had another thread count.
//
// Extra memory: the tile buffers, MKL's packed copy of the current key tile per thread (float32; ~1.25x
// its data resident), O(groups * Bk) column partials (groups <= MAX_COLUMN_GROUPS) and
// (lanes - 1) dk partials of [Bk, D] (bfloat16 on the brgemm route: lanes partials of [D, Bk], an unscaled
// dq [Bq, D], q.T in bfloat16 and the packed key tile per thread; float32 copies of q and k for float16
// inputs and for bfloat16 off a bf16 GEMM route); the masked
// ops add per thread a tile of mask bytes (two with a guide and the columns), a tile of guide scores and
// the packed guide features of a key tile, and O(positive groups * Bk) partials of the columns' positives -- never
// O(Bq * Bk).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"

namespace infcl {
namespace {

// Tile sizes, the row-tile grid, the lanes, the BLAS thread guard and the vectorized exp (fast_exp) are
// common.h's, shared with infcl_siglip.cpp.

// Span (in natural-log units) within which one tile's row and column maxima must lie for the forward's
// one-exp path (kOneExp): exp(+-SPAN) and their products stay normal floats with room to spare, and a
// term that underflows there is below exp(EXP_LO + SPAN) = e^-47 of its row's or column's largest term.
constexpr float SHARED_REF_SPAN = 40.0f;
// The backward's version, on the log-sum-exps L = m + r of a tile's rows and columns: a flushed exp(x_row)
// hides exp(x_col) = exp(x_row) * exp(L_row - L_col) with |L_row - L_col| <= 2 * LSE_REF_SPAN, so what is
// lost stays below exp(EXP_LO + 2 * LSE_REF_SPAN) = e^-47 (of a column's total probability 1).
constexpr double LSE_REF_SPAN = 20.0;

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

// ---------------------------------------------------------------------------------------------
// GEMM on row-major 2-D tiles: common.h's gemm() (ATen for float32 / float64, MKL's
// cblas_gemm_bf16bf16f32 for bfloat16 on the Mkl route) or its BrgemmKeyTile (bfloat16 on the Brgemm
// route), plus MKL's packed sgemm for a reused key tile (ReusedB).
//
// Tried and dropped (B=8192, D=512, 2 cores), so nobody retries them blind:
// - MKL's packed-operand sgemm with every k panel packed up front: cblas_sgemm_pack_get_size asks
//   ~7.9 MB plus the panel's data for every panel, so ~140 MB at B=8192 and over 1 GB at B=65536.
//   (ReusedB packs one key tile per thread at a time instead, in an uninitialized buffer.)
// - oneDNN's float32 brgemm ukernel (at::native::cpublas::brgemm): 60-94 GFLOP/s on these tiles.
// - oneDNN's bf16 AMX brgemm ukernel (at::native::cpublas::brgemm). It needs arch_prctl(ARCH_REQ_XCOMP_PERM)
//   and a tile release after each group of calls, because MKL's bf16 GEMM shares the AMX state (SIGILL
//   otherwise); B must be VNNI-packed in blocks of <= 64 columns, in multiples of 16.
//   - S products only: 530-540 GFLOP/s against 375-385 for MKL's bf16 GEMM on S alone, but no
//     reliable end-to-end gain in interleaved runs.
//   - All three products, every packed operand reused (k tile per lane, q rows per call, dS per tile):
//     the same speed as MKL, 1.01-1.04x its time in 2 x 16 paired runs in one process at B=8192.
//   (Neither experiment was kept in the repository.)
// - at::mm bf16 x bf16 -> bf16 (oneDNN) for the S tiles: ~550 GFLOP/s, ~5% faster end to end, but it
//   rounds every S entry to bf16; not worth that.
// bf16 tile products here are bound by AMX throughput, which this VM's two vCPUs appear to share: one
// big bf16 GEMM ran at 240-1070 GFLOP/s on 1 thread and 500-1900 on 2 in the same hour.

extern "C" {
// MKL's packed-operand sgemm: op(B) packed once, then multiplied by many A tiles.
enum { kCblasPacked = 151, kCblasBMatrix = 162 };
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

bool has_sgemm_pack() {
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

// dS as handed to the dq / dk products: float32 / float64 as is; bfloat16 rounded to nearest even
// (sign-symmetric: -v rounds to -bf16(v)). dS already holds -Y, so nothing cancels against it later.
template <typename Acc>
inline void store_ds(Acc* ds, int64_t c, Acc v) {
  ds[c] = v;
}
inline void store_ds(at::BFloat16* ds, int64_t c, float v) {
  const uint16_t bits = to_bf16_bits(v);
  std::memcpy(ds + c, &bits, sizeof bits);
}

// The tile's column of row i's positive, or -1 when it lies outside columns [j0, j0 + nj).
inline int64_t positive_in_tile(const int64_t* pos, int64_t i, int64_t j0, int64_t nj) {
  const int64_t c = pos[i] - j0;
  return (c >= 0 && c < nj) ? c : -1;
}

// ---------------------------------------------------------------------------------------------
// Tile phases shared by the forward and the backward.

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

// ---------------------------------------------------------------------------------------------
// Masks (infcl/masks.py): which entries of a tile are its rows' positives P and which are left out of
// the rows' (and the columns') softmax, E. Formed per tile from O(B) data, never beyond the tile.

// multi_positive: None (the one-hot of pos), "mean" or "sum" (the same-id columns).
enum class Positives { Label, Mean, Sum };

// The masked ops' extra inputs, contiguous; null where the option is absent. The guide features and
// thresholds share one dtype, float or double (guide_f64), independent of q's.
struct MaskArgs {
  Positives positives = Positives::Label;
  const int64_t* q_ids = nullptr;  // [bq]
  const int64_t* k_ids = nullptr;  // [bk]
  const void* guide_q = nullptr;   // [bq, guide_dim]
  const void* guide_k = nullptr;   // [bk, guide_dim]
  const void* row_threshold = nullptr;  // [bq]: a guide score above it excludes the column from the row
  const void* col_threshold = nullptr;  // [bk] (symmetric): ... the row from the column
  int64_t guide_dim = 0;
  bool guide_f64 = false;
  bool has_guide() const { return guide_q != nullptr; }
};

// The simdlen of the loops that read mask bytes beside values of type T: the lanes of a 512-bit vector
// of T. Left to itself, GCC sizes such a loop's vectors by its smallest type, the byte, 64 entries at a
// time, which leaves up to 63 entries of every span to the scalar epilogue (and its scalar exps).
template <typename T>
constexpr int kLanes = 64 / sizeof(T);

// How many of ids[0, n) equal id (vectorized: the cheap test that most rows have no duplicate).
inline int64_t count_equal(const int64_t* ids, int64_t n, int64_t id) {
  int64_t count = 0;
#pragma omp simd reduction(+ : count)
  for (int64_t c = 0; c < n; ++c) count += ids[c] == id ? 1 : 0;
  return count;
}

// One tile's masks, rebuilt per tile by build() (one thread's buffers). Per row r: the positives, sorted
// column indices (the one-hot of pos, or the same-id columns); whether any entry of the row is excluded
// in either direction (any(r)); and only where it is, one byte per entry for the row direction's E and
// one for the column direction's (the same bytes unless a guide is given with the columns wanted).
// With a guide, the scores G = guide_q tile @ guide_k tile.T are one extra product per tile, in the
// guide's dtype, by RawTiles (float32: the key tile's guide features packed once per key tile by
// set_keys(), as for S), so the forward and the backward form them by the same route on the same tiles
// and both passes exclude the same entries.
class TileMasks {
 public:
  TileMasks(const MaskArgs& a, int64_t max_rows, int64_t tk, bool symmetric)
      : a_(a), split_(a.has_guide() && symmetric), excluded_(max_rows * tk),
        col_excluded_(split_ ? max_rows * tk : 0), any_(max_rows), starts_(max_rows + 1),
        scores_f32_(a.has_guide() && !a.guide_f64 ? max_rows * tk : 0),
        scores_f64_(a.has_guide() && a.guide_f64 ? max_rows * tk : 0) {
    if (a.has_guide() && a.guide_f64) guide_f64_ = std::make_unique<RawTiles<double>>(max_rows, tk, a.guide_dim);
    if (a.has_guide() && !a.guide_f64) guide_f32_ = std::make_unique<RawTiles<float>>(max_rows, tk, a.guide_dim);
  }

  // Key tile [j0, j0 + nj): its guide features, for every row tile's scores until the next call.
  void set_keys(int64_t j0, int64_t nj) {
    const int64_t at = j0 * a_.guide_dim;
    if (guide_f64_) guide_f64_->set_keys(static_cast<const double*>(a_.guide_k) + at, nj);
    if (guide_f32_) guide_f32_->set_keys(static_cast<const float*>(a_.guide_k) + at, nj);
  }

  // Rows [i0, i0 + ni) against the key tile of the last set_keys() ([j0, j0 + nj)).
  void build(const int64_t* pos, int64_t i0, int64_t ni, int64_t j0, int64_t nj) {
    nj_ = nj;
    const int64_t at = i0 * a_.guide_dim;
    if (guide_f64_) guide_f64_->product(static_cast<const double*>(a_.guide_q) + at, ni, scores_f64_.data(), nj);
    if (guide_f32_) guide_f32_->product(static_cast<const float*>(a_.guide_q) + at, ni, scores_f32_.data(), nj);
    if (a_.guide_f64) {
      build_rows<double>(pos, i0, ni, j0, nj, scores_f64_.data());
    } else {
      build_rows<float>(pos, i0, ni, j0, nj, scores_f32_.data());
    }
  }

  bool any(int64_t r) const { return any_[r] != 0; }
  const uint8_t* row_excluded(int64_t r) const { return excluded_.data() + r * nj_; }
  const uint8_t* col_excluded(int64_t r) const { return (split_ ? col_excluded_ : excluded_).data() + r * nj_; }
  const int64_t* positives_begin(int64_t r) const { return cols_.data() + starts_[r]; }
  const int64_t* positives_end(int64_t r) const { return cols_.data() + starts_[r + 1]; }
  Positives kind() const { return a_.positives; }

 private:
  template <typename G>
  void build_rows(const int64_t* pos, int64_t i0, int64_t ni, int64_t j0, int64_t nj, G* scores) {
    const bool label = a_.positives == Positives::Label;
    const int64_t* kid = a_.k_ids ? a_.k_ids + j0 : nullptr;
    const G* row_thr = static_cast<const G*>(a_.row_threshold);
    const G* col_thr = split_ ? static_cast<const G*>(a_.col_threshold) + j0 : nullptr;
    cols_.clear();
    for (int64_t r = 0; r < ni; ++r) {
      const int64_t i = i0 + r;
      starts_[r] = static_cast<int64_t>(cols_.size());
      const int64_t p = label ? positive_in_tile(pos, i, j0, nj) : -1;
      const int64_t qid = kid ? a_.q_ids[i] : 0;
      const int64_t n_same = kid ? count_equal(kid, nj, qid) : 0;
      if (p >= 0) cols_.push_back(p);
      if (!label && n_same > 0) {
        for (int64_t c = 0; c < nj; ++c) {
          if (kid[c] == qid) cols_.push_back(c);
        }
      }
      uint8_t* er = excluded_.data() + r * nj;
      uint8_t* ec = split_ ? col_excluded_.data() + r * nj : er;
      if (a_.has_guide()) {
        any_[r] = guide_row(scores + r * nj, row_thr[i], col_thr, kid, qid, label, p, nj, er, ec);
      } else if (label && n_same - (p >= 0 && kid[p] == qid ? 1 : 0) > 0) {
        // Same id, not the row's positive: the false negatives (ids exclude nothing under "mean"/"sum",
        // where every same-id column is a positive).
#pragma omp simd
        for (int64_t c = 0; c < nj; ++c) er[c] = kid[c] == qid ? 1 : 0;
        if (p >= 0) er[p] = 0;
        any_[r] = 1;
      } else {
        any_[r] = 0;
      }
    }
    starts_[ni] = static_cast<int64_t>(cols_.size());
  }

  // One row's exclusions with a guide: G above the row's threshold (the column's, for ec), or the same
  // id under multi_positive None; never a positive. Returns whether anything is excluded.
  template <typename G>
  uint8_t guide_row(const G* score, G thr, const G* col_thr, const int64_t* kid, int64_t qid, bool label, int64_t p,
                    int64_t nj, uint8_t* er, uint8_t* ec) {
    // One loop per (ids?, columns?), so that no test in the loop keeps it from vectorizing.
    int64_t count;
    if (kid) {
      count = col_thr ? guide_count<true, true>(score, thr, col_thr, kid, qid, label, nj, er, ec)
                      : guide_count<true, false>(score, thr, col_thr, kid, qid, label, nj, er, ec);
    } else {
      count = col_thr ? guide_count<false, true>(score, thr, col_thr, kid, qid, label, nj, er, ec)
                      : guide_count<false, false>(score, thr, col_thr, kid, qid, label, nj, er, ec);
    }
    if (p >= 0) {  // None: the row's positive is never excluded
      count -= er[p] + (col_thr ? ec[p] : 0);
      er[p] = 0;
      ec[p] = 0;
    }
    return count > 0 ? 1 : 0;
  }

  template <bool ids, bool cols, typename G>
  static int64_t guide_count(const G* score, G thr, const G* col_thr, const int64_t* kid, int64_t qid, bool label,
                             int64_t nj, uint8_t* er, uint8_t* ec) {
    int64_t count = 0;
    const uint8_t one_positive = label ? 1 : 0;
#pragma omp simd reduction(+ : count) simdlen(kLanes<G>)
    for (int64_t c = 0; c < nj; ++c) {
      uint8_t same = 0;
      if constexpr (ids) same = kid[c] == qid ? 1 : 0;
      // None: the same-id columns besides pos are false negatives; "mean"/"sum": they are the positives.
      const uint8_t false_negative = same & one_positive;
      const uint8_t negative = (same ^ 1) | one_positive;
      const uint8_t row = (static_cast<uint8_t>(score[c] > thr) | false_negative) & negative;
      er[c] = row;
      count += row;
      if constexpr (cols) {
        const uint8_t col = (static_cast<uint8_t>(score[c] > col_thr[c]) | false_negative) & negative;
        ec[c] = col;
        count += col;
      }
    }
    return count;
  }

  const MaskArgs& a_;
  bool split_;
  int64_t nj_ = 0;
  std::vector<uint8_t> excluded_, col_excluded_, any_;
  std::vector<int64_t> starts_, cols_;
  std::vector<float> scores_f32_;
  std::vector<double> scores_f64_;
  std::unique_ptr<RawTiles<float>> guide_f32_;
  std::unique_ptr<RawTiles<double>> guide_f64_;
};

// ---------------------------------------------------------------------------------------------
// Forward phases. A row's (or column's) running stats are its max m, the number of entries equal to it
// (top), and the sum of exp(S - m) over the others (rest), both in double; at the end
// r = log(top + rest) = log1p((top - 1) + rest). Keeping the exact 1s out of the sum of the small terms
// keeps a confident row's tiny r to full relative precision (1 + rest would round rest to the
// accumulator's ulp of 1), and r >= 0 by construction (top >= 1), so losses (m - pos) + r are >= 0.

template <typename Acc>
struct Running {
  Acc* max;
  double* top;
  double* rest;
  Running offset(int64_t t) const { return {max + t, top + t, rest + t}; }
};

// Running stats storage for n rows or columns (m = -inf, nothing counted: the empty set).
template <typename Acc>
struct RunningStore {
  std::vector<Acc> max;
  std::vector<double> top, rest;
  void reset(int64_t n) {
    max.assign(n, -std::numeric_limits<Acc>::infinity());
    top.assign(n, 0.0);
    rest.assign(n, 0.0);
  }
  Running<Acc> at(int64_t t) { return {max.data() + t, top.data() + t, rest.data() + t}; }
};

// S = raw * scale in place, with the tile's row maxima and column maxima (nj entries).
template <typename Acc>
void scale_with_maxima(Acc* s, int64_t ni, int64_t nj, Acc sc, Acc* row_max, Acc* col_max) {
  std::fill(col_max, col_max + nj, -std::numeric_limits<Acc>::infinity());
  for (int64_t r = 0; r < ni; ++r) {
    Acc* sr = s + r * nj;
    Acc m = -std::numeric_limits<Acc>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < nj; ++c) {
      const Acc v = sr[c] * sc;  // the product scale_tile forms
      sr[c] = v;
      m = m > v ? m : v;
      col_max[c] = col_max[c] > v ? col_max[c] : v;
    }
    row_max[r] = m;
  }
}

// Raise n running maxima to include a tile's maxima; where one grows, everything so far becomes `rest`,
// rescaled by exp(old - new).
template <typename Acc>
void raise_maxima(const Running<Acc>& run, const Acc* tile_max, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const Acc new_max = nan_max(run.max[t], tile_max[t]);
    if (new_max == run.max[t]) continue;
    run.rest[t] = (run.top[t] + run.rest[t]) * rescale_factor(run.max[t], new_max);
    run.top[t] = 0.0;
    run.max[t] = new_max;
  }
}

// One entry's term for a row's or column's running stats (max m): an entry equal to m counts in `top`;
// any other adds its exp e to `rest` (e = exp(s - m), or exp(s - M) on the one-exp path).
template <typename Acc>
inline void add_term(Acc s, Acc m, Acc e, Acc& top, Acc& rest) {
  const bool is_top = s == m;
  top += is_top ? Acc(1) : Acc(0);
  rest += is_top ? Acc(0) : e;
}

// Rows only: each row's terms against its running max.
template <typename Acc>
void add_row_terms(const Acc* s, int64_t ni, int64_t nj, const Running<Acc>& rows) {
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* sr = s + r * nj;
    const Acc m = rows.max[r];
    Acc top = 0, rest = 0;
#pragma omp simd reduction(+ : top, rest)
    for (int64_t c = 0; c < nj; ++c) add_term(sr[c], m, fast_exp(sr[c] - m), top, rest);
    rows.top[r] += top;
    rows.rest[r] += rest;
  }
}

// The one-exp path's reference (kOneExp): the tile max M, when every tile row and column maximum lies
// within SHARED_REF_SPAN of it (then exp(M - running max) <= exp(SHARED_REF_SPAN) rebases each row's and
// column's sum once); NaN otherwise.
template <typename Acc>
Acc shared_reference(const Acc* tile_row_max, int64_t ni, const Acc* tile_col_max, int64_t nj) {
  const Acc top = *std::max_element(tile_row_max, tile_row_max + ni);
  const Acc low = std::min(*std::min_element(tile_row_max, tile_row_max + ni),
                           *std::min_element(tile_col_max, tile_col_max + nj));
  const bool usable = std::isfinite(top) && low >= top - SHARED_REF_SPAN;
  return usable ? top : std::numeric_limits<Acc>::quiet_NaN();
}

// Rows and columns. Two exps per entry, each against its own running max (so each largest term is
// exp(0) = 1, counted in top); or, one_exp, e = exp(s - ref) for both, each sum rebased by
// exp(ref - running max) at the end. col_top / col_rest: nj scratch entries (a column's sums over the
// tile; counts up to TILE_Q are exact in float).
template <bool one_exp, typename Acc>
void add_row_col_terms(const Acc* s, int64_t ni, int64_t nj, const Running<Acc>& rows, const Running<Acc>& cols,
                       Acc ref, Acc* col_top, Acc* col_rest) {
  std::fill(col_top, col_top + nj, Acc(0));
  std::fill(col_rest, col_rest + nj, Acc(0));
  const Acc* col_max = cols.max;
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* sr = s + r * nj;
    const Acc m = rows.max[r];
    Acc top = 0, rest = 0;
#pragma omp simd reduction(+ : top, rest)
    for (int64_t c = 0; c < nj; ++c) {
      const Acc v = sr[c];
      if constexpr (one_exp) {
        const Acc e = fast_exp(v - ref);
        add_term(v, m, e, top, rest);
        add_term(v, col_max[c], e, col_top[c], col_rest[c]);
      } else {
        add_term(v, m, fast_exp(v - m), top, rest);
        add_term(v, col_max[c], fast_exp(v - col_max[c]), col_top[c], col_rest[c]);
      }
    }
    rows.top[r] += top;
    rows.rest[r] += one_exp ? rest * rescale_factor(ref, m) : rest;
  }
  for (int64_t c = 0; c < nj; ++c) {
    cols.top[c] += col_top[c];
    cols.rest[c] += one_exp ? col_rest[c] * rescale_factor(ref, col_max[c]) : col_rest[c];
  }
}

// Masked forward: S = raw * scale in place (the product scale_with_maxima forms), and the maxima over
// the entries each direction keeps. Unless `split` (a guide with the columns wanted: the two directions
// exclude different entries, add_split_terms reads the mask bytes), the excluded entries are then set
// to -inf in S, for the plain loss's add_terms: a row with nothing excluded keeps S as it is, so with no
// exclusion at all every later step sees the plain loss's tile bit for bit. An excluded entry adds
// nothing: exp(-inf) = 0, and while a whole row (column) so far is excluded its max is -inf, its -inf
// entries count in `top`, and the first finite max rescales them by exp(-inf) = 0.
template <bool split, typename Acc>
void scale_mask_maxima(Acc* s, int64_t ni, int64_t nj, Acc sc, const TileMasks& masks, Acc* row_max, Acc* col_max) {
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  std::fill(col_max, col_max + nj, neg_inf);
  for (int64_t r = 0; r < ni; ++r) {
    Acc* sr = s + r * nj;
    Acc m = neg_inf;
    if (!masks.any(r)) {
#pragma omp simd reduction(max : m)
      for (int64_t c = 0; c < nj; ++c) {
        const Acc v = sr[c] * sc;
        sr[c] = v;
        m = m > v ? m : v;
        col_max[c] = col_max[c] > v ? col_max[c] : v;
      }
    } else {
      const uint8_t* er = masks.row_excluded(r);
      const uint8_t* ec = masks.col_excluded(r);
#pragma omp simd reduction(max : m) simdlen(kLanes<Acc>)
      for (int64_t c = 0; c < nj; ++c) {
        const Acc v = sr[c] * sc;
        const Acc vr = er[c] ? neg_inf : v;
        const Acc vc = ec[c] ? neg_inf : v;
        sr[c] = split ? v : vr;
        m = m > vr ? m : vr;
        col_max[c] = col_max[c] > vc ? col_max[c] : vc;
      }
    }
    row_max[r] = m;
  }
}

// An entry's term like add_term, where `kept`; nothing where the direction excludes it.
template <typename Acc>
inline void add_kept_term(bool kept, Acc s, Acc m, Acc e, Acc& top, Acc& rest) {
  const bool is_top = kept && s == m;
  top += is_top ? Acc(1) : Acc(0);
  rest += (kept && !is_top) ? e : Acc(0);
}

// add_row_col_terms for a tile whose rows and columns exclude different entries (a guide with the
// columns wanted): S as it is, each direction's mask bytes deciding which entries it counts; one exp per
// entry against ref when one_exp, else two. An excluded entry's exp may overflow; it is never added.
// Flattened like ds_masked_row, so that fast_exp is inlined into the vector loop.
template <bool one_exp, typename Acc>
__attribute__((flatten)) void add_split_terms(const Acc* s, int64_t ni, int64_t nj, const TileMasks& masks, const Running<Acc>& rows,
                     const Running<Acc>& cols, Acc ref, Acc* col_top, Acc* col_rest) {
  std::fill(col_top, col_top + nj, Acc(0));
  std::fill(col_rest, col_rest + nj, Acc(0));
  const Acc* col_max = cols.max;
  for (int64_t r = 0; r < ni; ++r) {
    const Acc* sr = s + r * nj;
    const uint8_t* er = masks.row_excluded(r);
    const uint8_t* ec = masks.col_excluded(r);
    // The bytes are only written for rows with an exclusion: the others read them through a zero mask
    // (a branch in the loop would keep it from vectorizing).
    const uint8_t live = masks.any(r) ? 0xFF : 0;
    const Acc m = rows.max[r];
    Acc top = 0, rest = 0;
#pragma omp simd reduction(+ : top, rest) simdlen(kLanes<Acc>)
    for (int64_t c = 0; c < nj; ++c) {
      const Acc v = sr[c];
      const bool row_kept = (er[c] & live) == 0;
      const bool col_kept = (ec[c] & live) == 0;
      if constexpr (one_exp) {
        const Acc e = fast_exp(v - ref);
        add_kept_term(row_kept, v, m, e, top, rest);
        add_kept_term(col_kept, v, col_max[c], e, col_top[c], col_rest[c]);
      } else {
        add_kept_term(row_kept, v, m, fast_exp(v - m), top, rest);
        add_kept_term(col_kept, v, col_max[c], fast_exp(v - col_max[c]), col_top[c], col_rest[c]);
      }
    }
    rows.top[r] += top;
    // A line with nothing kept so far (max -inf) has nothing to rebase (and exp(ref + inf) * 0 is NaN).
    rows.rest[r] += one_exp && rest != 0 ? rest * rescale_factor(ref, m) : rest;
  }
  for (int64_t c = 0; c < nj; ++c) {
    cols.top[c] += col_top[c];
    cols.rest[c] += one_exp && col_rest[c] != 0 ? col_rest[c] * rescale_factor(ref, col_max[c]) : col_rest[c];
  }
}

// shared_reference for add_split_terms: over the tile's rows and columns that keep an entry (an empty
// line, max -inf, adds nothing), and with the columns' maxima in the top too, since a column may keep an
// entry above every row's kept maximum.
template <typename Acc>
Acc shared_reference_kept(const Acc* tile_row_max, int64_t ni, const Acc* tile_col_max, int64_t nj) {
  constexpr Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  Acc top = neg_inf, low = std::numeric_limits<Acc>::infinity();
  for (const Acc* line : {tile_row_max, tile_col_max}) {
    for (int64_t t = 0, n = line == tile_row_max ? ni : nj; t < n; ++t) {
      if (line[t] == neg_inf) continue;
      top = nan_max(top, line[t]);
      low = std::min(low, line[t]);
    }
  }
  const bool usable = std::isfinite(top) && low >= top - SHARED_REF_SPAN;
  return usable ? top : std::numeric_limits<Acc>::quiet_NaN();
}

// The positives' running partials of n rows or columns (masked forward): their max, and for "sum" only
// their log-sum-exp as Running's (top, rest) about it; the sum of their logits (double) and their count.
// The symmetric forward keeps one per positive group and column ([positive groups, bk]), so every byte
// counts: 16 per entry ("mean" / one positive) or 32 ("sum"), beside the column stats' 20.
template <typename Acc>
struct PositiveStore {
  RunningStore<Acc> lse;  // top and rest empty unless "sum"
  std::vector<double> sum;
  std::vector<int32_t> count;  // a group's rows: far below 2^31
  void reset(int64_t n, bool lse_wanted) {
    lse.max.assign(n, -std::numeric_limits<Acc>::infinity());
    lse.top.assign(lse_wanted ? n : 0, 0.0);
    lse.rest.assign(lse_wanted ? n : 0, 0.0);
    sum.assign(n, 0.0);
    count.assign(n, 0);
  }
};

template <typename Acc>
struct PositiveRun {
  Running<Acc> lse;  // top, rest: null unless "sum"
  double* sum;
  int32_t* count;
  static PositiveRun at(PositiveStore<Acc>& store, int64_t t) {
    const bool lse_wanted = !store.lse.top.empty();
    return {{store.lse.max.data() + t, lse_wanted ? store.lse.top.data() + t : nullptr,
             lse_wanted ? store.lse.rest.data() + t : nullptr},
            store.sum.data() + t, store.count.data() + t};
  }
  // One positive logit v of line t. "sum": a new max rescales what is there (as raise_maxima), ties with
  // it count in top, the rest add exp(v - max) in double: positives are few, one exp each.
  void add(int64_t t, Acc v, bool lse_wanted) const {
    sum[t] += v;
    count[t] += 1;
    const Acc m = lse.max[t];
    if (!lse_wanted) {
      lse.max[t] = nan_max(m, v);
    } else if (v > m || v != v) {
      lse.rest[t] = (lse.top[t] + lse.rest[t]) * rescale_factor(m, v);
      lse.top[t] = 1.0;
      lse.max[t] = v;
    } else if (v == m) {
      lse.top[t] += 1.0;
    } else {
      lse.rest[t] += std::exp(static_cast<double>(v) - static_cast<double>(m));
    }
  }
};

// rows[2] for the tile's rows whose positive lies in it: S itself, the very value the max was taken over.
template <typename Acc>
void take_positives(const Acc* s, int64_t ni, int64_t nj, const int64_t* pos, int64_t i0, int64_t j0, Acc* out) {
  for (int64_t r = 0; r < ni; ++r) {
    const int64_t c = positive_in_tile(pos, i0 + r, j0, nj);
    if (c >= 0) out[i0 + r] = s[r * nj + c];
  }
}

// r = log(top + rest) = log1p((top - 1) + rest); an empty set (m = -inf) keeps r = -inf; NaN stays NaN.
template <typename Acc>
inline Acc log_rel(Acc m, double top, double rest) {
  if (m == -std::numeric_limits<Acc>::infinity()) return m;
  return static_cast<Acc>(std::log1p((top - 1.0) + rest));
}

// One thread's forward work: its column groups' row tiles against one key tile at a time, each tile
// updating its rows' running stats and its group's running column partial.
template <typename In>
class ForwardWorker {
 public:
  using Acc = typename Types<In>::acc;

  // masks: null for the plain loss (tile()), else the masked loss's inputs (masked_tile()).
  ForwardWorker(const In* q, const In* k, int64_t bk, int64_t d, const RowTiles& tiles, Acc sc, const int64_t* pos,
                bool brgemm, const MaskArgs* masks = nullptr, bool symmetric = false)
      : q_(q), k_(k), d_(d), sc_(sc), pos_(pos), tiles_(tiles),
        raw_(tiles.size, std::min(TILE_K, bk), d, brgemm, /*backward=*/false),
        s_(tiles.size * std::min(TILE_K, bk)), tile_row_max_(tiles.size), tile_col_max_(TILE_K), col_top_(TILE_K),
        col_rest_(TILE_K) {
    if (masks) {
      masks_ = std::make_unique<TileMasks>(*masks, tiles.size, std::min(TILE_K, bk), symmetric);
      split_ = masks->has_guide() && symmetric;
    }
  }

  // Packs key tile [j0, j0 + nj) for this thread's products.
  void set_keys(int64_t j0, int64_t nj) {
    raw_.set_keys(k_ + j0 * d_, nj);
    if (masks_) masks_->set_keys(j0, nj);
  }

  // Row tile t against key tile [j0, j0 + nj): rows = the running stats of its rows; cols = its group's
  // running column stats of this key tile (max == nullptr: rows only); positives: [bq].
  void tile(int64_t t, const Running<Acc>& rows, int64_t j0, int64_t nj, const Running<Acc>& cols,
            Acc* positives) {
    const int64_t i0 = tiles_.begin(t), ni = tiles_.height(t);
    Acc* s = s_.data();
    raw_.product(q_ + i0 * d_, ni, s, nj);
    scale_with_maxima(s, ni, nj, sc_, tile_row_max_.data(), tile_col_max_.data());
    take_positives(s, ni, nj, pos_, i0, j0, positives);
    add_terms(s, ni, nj, rows, cols);
  }

  // The masked loss's tile: as tile(), over the entries not excluded, with the positives' partials of
  // its rows (row_pos, offset to the row tile) and of its group's columns (col_pos, offset to the key tile).
  void masked_tile(int64_t t, const Running<Acc>& rows, int64_t j0, int64_t nj, const Running<Acc>& cols,
                   const PositiveRun<Acc>& row_pos, const PositiveRun<Acc>& col_pos) {
    const int64_t i0 = tiles_.begin(t), ni = tiles_.height(t);
    Acc* s = s_.data();
    raw_.product(q_ + i0 * d_, ni, s, nj);
    masks_->build(pos_, i0, ni, j0, nj);
    const bool split = split_ && cols.max;
    if (split) {
      scale_mask_maxima<true>(s, ni, nj, sc_, *masks_, tile_row_max_.data(), tile_col_max_.data());
    } else {
      scale_mask_maxima<false>(s, ni, nj, sc_, *masks_, tile_row_max_.data(), tile_col_max_.data());
    }
    // A positive is never excluded: its logit in s is S itself.
    const bool lse_wanted = masks_->kind() == Positives::Sum;
    for (int64_t r = 0; r < ni; ++r) {
      for (const int64_t* c = masks_->positives_begin(r); c != masks_->positives_end(r); ++c) {
        const Acc v = s[r * nj + *c];
        row_pos.add(r, v, lse_wanted);
        if (cols.max) col_pos.add(*c, v, lse_wanted);
      }
    }
    if (!split) {
      add_terms(s, ni, nj, rows, cols);
      return;
    }
    raise_maxima(rows, tile_row_max_.data(), ni);
    raise_maxima(cols, tile_col_max_.data(), nj);
    const Acc ref =
        kOneExp<In> ? shared_reference_kept(tile_row_max_.data(), ni, tile_col_max_.data(), nj) : Acc(0);
    if (kOneExp<In> && !std::isnan(ref)) {
      add_split_terms<true>(s, ni, nj, *masks_, rows, cols, ref, col_top_.data(), col_rest_.data());
    } else {
      add_split_terms<false>(s, ni, nj, *masks_, rows, cols, ref, col_top_.data(), col_rest_.data());
    }
  }

 private:
  // The tile's terms for its rows' running stats (and, cols.max set, its columns'), after its maxima.
  void add_terms(const Acc* s, int64_t ni, int64_t nj, const Running<Acc>& rows, const Running<Acc>& cols) {
    raise_maxima(rows, tile_row_max_.data(), ni);
    if (!cols.max) {
      add_row_terms(s, ni, nj, rows);
      return;
    }
    raise_maxima(cols, tile_col_max_.data(), nj);
    const Acc ref = kOneExp<In> ? shared_reference(tile_row_max_.data(), ni, tile_col_max_.data(), nj) : Acc(0);
    if (kOneExp<In> && !std::isnan(ref)) {
      add_row_col_terms<true>(s, ni, nj, rows, cols, ref, col_top_.data(), col_rest_.data());
    } else {
      add_row_col_terms<false>(s, ni, nj, rows, cols, ref, col_top_.data(), col_rest_.data());
    }
  }

  const In* q_;
  const In* k_;
  int64_t d_;
  Acc sc_;
  const int64_t* pos_;
  RowTiles tiles_;
  RawTiles<In> raw_;
  std::vector<Acc> s_, tile_row_max_, tile_col_max_, col_top_, col_rest_;
  std::unique_ptr<TileMasks> masks_;
  bool split_ = false;  // rows and columns exclude different entries (a guide with the columns wanted)
};

// The positives' rows of a masked result ([4, n] at out: max, log-sum relative to it ("sum" only, else
// -inf: the empty set's), sum, count) from `groups` partials ([groups, n], merged in group order like
// merge_column_partials; rows have one).
template <typename Acc>
void merge_positive_partials(PositiveStore<Acc>& parts, int64_t groups, int64_t n, bool lse_wanted, Acc* out) {
  at::parallel_for(0, n, 1024, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      Acc m = -std::numeric_limits<Acc>::infinity();
      for (int64_t p = 0; p < groups; ++p) m = nan_max(m, parts.lse.max[p * n + c]);
      double top = 0.0, rest = 0.0, sum = 0.0, count = 0.0;
      for (int64_t p = 0; p < groups; ++p) {
        const int64_t at = p * n + c;
        sum += parts.sum[at];
        count += parts.count[at];
        if (!lse_wanted) continue;
        if (parts.lse.max[at] == m) {
          top += parts.lse.top[at];
          rest += parts.lse.rest[at];
        } else {
          rest += (parts.lse.top[at] + parts.lse.rest[at]) * rescale_factor(parts.lse.max[at], m);
        }
      }
      out[c] = m;
      out[n + c] = lse_wanted ? log_rel(m, top, rest) : -std::numeric_limits<Acc>::infinity();
      out[2 * n + c] = static_cast<Acc>(sum);
      out[3 * n + c] = static_cast<Acc>(count);
    }
  });
}

// Column stats from the groups' partials ([groups, bk]), merged in group order: M = max_p m_p; the
// partials at M add their top and rest, the others' top + rest joins rest, times exp(m_p - M).
template <typename Acc>
void merge_column_partials(RunningStore<Acc>& parts, int64_t groups, int64_t bk, Acc* out) {
  at::parallel_for(0, bk, 1024, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      Acc m = -std::numeric_limits<Acc>::infinity();
      for (int64_t p = 0; p < groups; ++p) m = nan_max(m, parts.max[p * bk + c]);
      double top = 0.0, rest = 0.0;
      for (int64_t p = 0; p < groups; ++p) {
        const int64_t at = p * bk + c;
        if (parts.max[at] == m) {
          top += parts.top[at];
          rest += parts.rest[at];
        } else {
          rest += (parts.top[at] + parts.rest[at]) * rescale_factor(parts.max[at], m);
        }
      }
      out[c] = m;
      out[bk + c] = log_rel(m, top, rest);
    }
  });
}

// Column groups: contiguous ranges of row tiles, each with its own running column stats over all of Bk,
// merged in group order at the end. Fixed by the row tiles alone (never by the thread count), so the
// forward's outputs do not depend on it; threads take whole groups, key tiles outer, so one packed key
// tile serves all of a thread's row tiles. At most MAX_COLUMN_GROUPS (partials: 20 bytes per group per
// column), which also caps the forward's threads.
constexpr int64_t MAX_COLUMN_GROUPS = 64;
// The masked symmetric forward's columns also need their positives' partials (16 or 32 bytes an entry
// beside the stats' 20): those are kept per positive group, a run of `span` consecutive column groups
// (at most MAX_POSITIVE_GROUPS of them), and the threads then take whole positive groups, so each one's
// partial is updated in one fixed order (key tiles, then its groups and row tiles in turn) whatever the
// thread count. That caps the masked symmetric forward at MAX_POSITIVE_GROUPS threads and keeps its
// extra memory within 2x of the plain loss's. The column stats stay per column group, so with all ids
// distinct (one positive per column: its partial is exact in any grouping) the loss is the plain one's bits.
constexpr int64_t MAX_POSITIVE_GROUPS = 16;

inline int64_t group_start(int64_t tiles, int64_t groups, int64_t g) { return tiles * g / groups; }

// masks: null for the plain loss (rows [3, bq], cols [2, bk]); else the masked loss's (rows [6, bq],
// cols [6, bk]: the stats over the entries kept, then the positives' rows, see merge_positive_partials).
template <typename In>
void forward_impl(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
                  const MaskArgs* masks, bool brgemm, at::Tensor& rows, at::Tensor& cols) {
  using Acc = typename Types<In>::acc;
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  const RowTiles tiles(bq);
  const int64_t groups = std::max<int64_t>(1, std::min(tiles.count, MAX_COLUMN_GROUPS));
  const int64_t tk = std::min(TILE_K, bk);
  RunningStore<Acc> row_run, col_parts;  // col_parts: [groups, bk]
  row_run.reset(bq);
  col_parts.reset(symmetric ? groups * bk : 0);
  // Column groups per positive group: 1 unless the masked symmetric forward keeps the columns' positives.
  const int64_t span = masks && symmetric ? (groups + MAX_POSITIVE_GROUPS - 1) / MAX_POSITIVE_GROUPS : 1;
  const int64_t positive_groups = (groups + span - 1) / span;
  PositiveStore<Acc> row_pos, col_pos_parts;  // the masked loss's; col_pos_parts: [positive_groups, bk]
  if (masks) {
    const bool lse_wanted = masks->positives == Positives::Sum;
    row_pos.reset(bq, lse_wanted);
    col_pos_parts.reset(symmetric ? positive_groups * bk : 0, lse_wanted);
  }
  rows.zero_();  // rows[2] stays 0 where the positive lies in another block
  Acc* out = rows.data_ptr<Acc>();
  at::parallel_for(0, positive_groups, 1, [&](int64_t p_begin, int64_t p_end) {
    const int64_t g_begin = p_begin * span, g_end = std::min(groups, p_end * span);
    const SingleThreadedBlas one_thread;
    ForwardWorker<In> work(q.data_ptr<In>(), k.data_ptr<In>(), bk, d, tiles, static_cast<Acc>(scale),
                           pos.data_ptr<int64_t>(), brgemm, masks, symmetric);
    for (int64_t j0 = 0; j0 < bk; j0 += tk) {
      const int64_t nj = std::min(tk, bk - j0);
      work.set_keys(j0, nj);
      for (int64_t g = g_begin; g < g_end; ++g) {
        const Running<Acc> part = symmetric ? col_parts.at(g * bk + j0) : Running<Acc>{nullptr, nullptr, nullptr};
        for (int64_t t = group_start(tiles.count, groups, g); t < group_start(tiles.count, groups, g + 1); ++t) {
          if (!masks) {
            work.tile(t, row_run.at(tiles.begin(t)), j0, nj, part, out + 2 * bq);
            continue;
          }
          const PositiveRun<Acc> col_pos = symmetric ? PositiveRun<Acc>::at(col_pos_parts, g / span * bk + j0)
                                                     : PositiveRun<Acc>{{nullptr, nullptr, nullptr}, nullptr, nullptr};
          work.masked_tile(t, row_run.at(tiles.begin(t)), j0, nj, part, PositiveRun<Acc>::at(row_pos, tiles.begin(t)),
                           col_pos);
        }
      }
    }
  });
  for (int64_t i = 0; i < bq; ++i) {
    out[i] = row_run.max[i];
    out[bq + i] = log_rel(row_run.max[i], row_run.top[i], row_run.rest[i]);
  }
  if (symmetric) merge_column_partials(col_parts, groups, bk, cols.data_ptr<Acc>());
  if (masks) {
    const bool lse_wanted = masks->positives == Positives::Sum;
    merge_positive_partials(row_pos, 1, bq, lse_wanted, out + 2 * bq);
    if (symmetric) merge_positive_partials(col_pos_parts, positive_groups, bk, lse_wanted, cols.data_ptr<Acc>() + 2 * bk);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward phases. Per tile: raw once, S = raw * scale (scale_tile), then per row the dS pass over the
// columns on either side of the row's positive (ds_span), the positive itself (ds_positive), then
// dq_i += scale * dS @ k_j and dk_j += scale * dS.T @ q_i.

// What the dS pass reads per row, with the symmetric loss's per-column stats (offset to the tile).
template <typename Acc>
struct RowGrad {
  Acc m, rel, g;
};
template <typename Acc>
struct ColGrads {
  const Acc* m = nullptr;
  const Acc* rel = nullptr;
  const Acc* g = nullptr;
  // kOneExp only: per column g * exp(ref - L_col), and per row exp(L_row - ref) (see SharedRef).
  const Acc* factor = nullptr;
};

// Which terms a tile's dS has: the row's only, both directions with two exps per entry, or both with
// the one-exp shortcut (kOneExp).
enum class Terms { Rows, Both, BothShared };

// The column direction's P (times its upstream gradient) at entry c of a row: its own exp with both
// directions' stats (Both), or the row's exp e rescaled by the row and column factors (the shared-stats path).
template <Terms terms, typename Acc>
inline Acc col_term(const Acc* s, int64_t c, Acc e, Acc row_factor, const ColGrads<Acc>& col) {
  if constexpr (terms == Terms::Both) {
    return col.g[c] * fast_exp((s[c] - col.m[c]) - col.rel[c]);
  } else {
    return (e * row_factor) * col.factor[c];
  }
}

// dS over columns [c0, c1) of one row (none of them its positive): g_row * P_row (+ g_col * P_col),
// P = exp((S - m) - r), with the row's and column's parts of the scale gradient, sum dS_part * raw.
template <Terms terms, typename Acc, typename DS>
inline void ds_span(int64_t c0, int64_t c1, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                    Acc row_factor, const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
  const Acc m = row.m, rel = row.rel, g = row.g;
#pragma omp simd reduction(+ : acc_row, acc_col)
  for (int64_t c = c0; c < c1; ++c) {
    const Acc x = raw[c];
    const Acc e = fast_exp((s[c] - m) - rel);
    const Acc pr = g * e;
    Acc v = pr;
    acc_row += pr * x;
    if constexpr (terms != Terms::Rows) {
      const Acc pc = col_term<terms>(s, c, e, row_factor, col);
      acc_col += pc * x;
      v += pc;
    }
    store_ds(ds, c, v);
  }
}

// dS at the row's positive column c: g * (P - 1) = g * expm1((S - m) - r) for each direction, so a
// confident row's tiny 1 - P keeps its digits (exp(x) - 1 would round it away).
template <Terms terms, typename Acc, typename DS>
inline void ds_positive(int64_t c, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                        const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
  const Acc x = raw[c];
  const Acc pr = row.g * std::expm1((s[c] - row.m) - row.rel);
  Acc v = pr;
  acc_row += pr * x;
  if constexpr (terms != Terms::Rows) {
    const Acc pc = col.g[c] * std::expm1((s[c] - col.m[c]) - col.rel[c]);
    acc_col += pc * x;
    v += pc;
  }
  store_ds(ds, c, v);
}

// One row of a tile: the spans left and right of its positive, and the positive (if in the tile).
template <Terms terms, typename Acc, typename DS>
inline void ds_row(int64_t nj, int64_t pos, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                   Acc row_factor, const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
  ds_span<terms>(0, pos >= 0 ? pos : nj, raw, s, ds, row, row_factor, col, acc_row, acc_col);
  if (pos < 0) return;
  ds_positive<terms>(pos, raw, s, ds, row, col, acc_row, acc_col);
  ds_span<terms>(pos + 1, nj, raw, s, ds, row, row_factor, col, acc_row, acc_col);
}

// Masked backward: dS over columns [c0, c1) of one row with exclusions (none of them a positive), as
// ds_span with each direction's term 0 where that direction excludes the entry (er / ec: one byte per
// column of the tile). The shared path's row exp is taken before the row's mask, as the columns need it.
template <Terms terms, typename Acc, typename DS>
inline void ds_span_masked(int64_t c0, int64_t c1, const Acc* raw, const Acc* s, DS* ds, const RowGrad<Acc>& row,
                           Acc row_factor, const ColGrads<Acc>& col, const uint8_t* er, const uint8_t* ec,
                           Acc& acc_row, Acc& acc_col) {
  const Acc m = row.m, rel = row.rel, g = row.g;
#pragma omp simd reduction(+ : acc_row, acc_col) simdlen(kLanes<Acc>)
  for (int64_t c = c0; c < c1; ++c) {
    const Acc x = raw[c];
    const Acc e = fast_exp((s[c] - m) - rel);
    const Acc pr = er[c] ? Acc(0) : g * e;
    Acc v = pr;
    acc_row += pr * x;
    if constexpr (terms != Terms::Rows) {
      const Acc pc = ec[c] ? Acc(0) : col_term<terms>(s, c, e, row_factor, col);
      acc_col += pc * x;
      v += pc;
    }
    store_ds(ds, c, v);
  }
}

// What a row's (or column's) positives look like to the masked backward: their global count ("mean")
// or stats ("sum": max, log-sum relative to it), offset to the tile's lines; unused for Label.
template <typename Acc>
struct PositiveGrads {
  const Acc* count = nullptr;
  const Acc* max = nullptr;
  const Acc* rel = nullptr;
  PositiveGrads offset(int64_t t) const {
    return {count ? count + t : nullptr, max ? max + t : nullptr, rel ? rel + t : nullptr};
  }
};

// P - Y at a positive of a line with stats (m, rel), never a difference of two rounded probabilities:
// Label: expm1(x), x = (S - m) - rel (p - 1); "mean": expm1(x + log c) / c (p - 1/c); "sum": y * expm1(d),
// y = exp((S - pm) - pr) the positive's share of its positives and d = (pm - m) + (pr - rel) <= 0 the log
// of their share of the softmax. With one positive (c = 1; pm = S, pr = 0) each is Label's bit for bit.
template <typename Acc>
inline Acc positive_term(Positives kind, Acc s, Acc m, Acc rel, const PositiveGrads<Acc>& y, int64_t t) {
  const Acc x = (s - m) - rel;
  switch (kind) {
    case Positives::Mean:
      return std::expm1(x + std::log(y.count[t])) / y.count[t];
    case Positives::Sum:
      return std::exp((s - y.max[t]) - y.rel[t]) * std::expm1((y.max[t] - m) + (y.rel[t] - rel));
    default:
      return std::expm1(x);
  }
}

// One row of a masked tile: the spans between its positives (sorted; masked only if the row has an
// exclusion) and each positive, in column order. Flattened: with the plain and the masked rows in one
// caller, GCC stopped inlining fast_exp into these loops, whose scalar calls then cost ~13% of a pass.
template <Terms terms, typename Acc, typename DS>
__attribute__((flatten)) inline void ds_masked_row(int64_t nj, const TileMasks& masks, int64_t r, const Acc* raw, const Acc* s, DS* ds,
                          const RowGrad<Acc>& row, Acc row_factor, const ColGrads<Acc>& col,
                          const PositiveGrads<Acc>& row_pos, const PositiveGrads<Acc>& col_pos, Acc& acc_row,
                          Acc& acc_col) {
  const bool any = masks.any(r);
  const uint8_t* er = masks.row_excluded(r);
  const uint8_t* ec = masks.col_excluded(r);
  auto span = [&](int64_t c0, int64_t c1) {
    if (any) {
      ds_span_masked<terms>(c0, c1, raw, s, ds, row, row_factor, col, er, ec, acc_row, acc_col);
    } else {
      ds_span<terms>(c0, c1, raw, s, ds, row, row_factor, col, acc_row, acc_col);
    }
  };
  int64_t next = 0;
  for (const int64_t* p = masks.positives_begin(r); p != masks.positives_end(r); ++p) {
    const int64_t c = *p;
    span(next, c);
    const Acc x = raw[c];
    const Acc pr = row.g * positive_term(masks.kind(), s[c], row.m, row.rel, row_pos, r);
    Acc v = pr;
    acc_row += pr * x;
    if constexpr (terms != Terms::Rows) {
      const Acc pc = col.g[c] * positive_term(masks.kind(), s[c], col.m[c], col.rel[c], col_pos, c);
      acc_col += pc * x;
      v += pc;
    }
    store_ds(ds, c, v);
    next = c + 1;
  }
  span(next, nj);
}

// The one-exp shortcut's reference for one tile (kOneExp, symmetric): ref = the largest row
// log-sum-exp L = m + r of the tile. Usable when every row's L and every column's L lies within
// LSE_REF_SPAN of it; then exp(x_col) = exp(x_row) * exp(L_row - ref) * exp(ref - L_col), each factor
// computed in double from the stats (so only x_row's rounding is shared) and within e^+-SPAN.
template <typename Acc>
class SharedRef {
 public:
  explicit SharedRef(int64_t tk) : col_factor_(tk) {}

  // Sets the column factors g_col * exp(ref - L_col) and returns true when the tile qualifies.
  bool prepare(const Acc* row_m, const Acc* row_rel, int64_t ni, const ColGrads<Acc>& col, int64_t nj) {
    double ref = -std::numeric_limits<double>::infinity(), low = std::numeric_limits<double>::infinity();
    for (int64_t r = 0; r < ni; ++r) {
      const double l = static_cast<double>(row_m[r]) + row_rel[r];
      ref = std::max(ref, l);
      low = std::min(low, l);
    }
    for (int64_t c = 0; c < nj; ++c) {
      const double l = static_cast<double>(col.m[c]) + col.rel[c];
      low = std::min(low, l);
      if (!(l <= ref + LSE_REF_SPAN)) return false;
    }
    if (!std::isfinite(ref) || !(low >= ref - LSE_REF_SPAN)) return false;
    ref_ = ref;
    for (int64_t c = 0; c < nj; ++c) {
      col_factor_[c] = static_cast<Acc>(col.g[c] * std::exp(ref - (static_cast<double>(col.m[c]) + col.rel[c])));
    }
    return true;
  }
  Acc row_factor(Acc m, Acc rel) const { return static_cast<Acc>(std::exp((static_cast<double>(m) + rel) - ref_)); }
  const Acc* col_factors() const { return col_factor_.data(); }

 private:
  double ref_ = 0.0;
  std::vector<Acc> col_factor_;
};

// One lane's backward: dq of its rows, dk (lane 0) or a dk partial, and its two dscale sums.
template <typename In>
class BackwardLane {
 public:
  using Acc = typename Types<In>::acc;
  using DS = typename Types<In>::ds;

  struct Args {
    const In* q;
    const In* k;
    int64_t bq, bk, d;
    RowTiles tiles;
    Acc scale;
    const int64_t* pos;
    const Acc* row_stats;  // [2, bq]
    const Acc* g_row;
    const Acc* col_stats;  // [2, bk] or nullptr (one direction)
    const Acc* g_col;
    Acc* dq;
    // The masked loss (null: the plain loss), with the rows' and columns' global positives.
    const MaskArgs* masks = nullptr;
    PositiveGrads<Acc> row_pos{}, col_pos{};
    // bfloat16 on the Brgemm route: dq above and each lane's dk are accumulated without the scale (brgemm
    // has no alpha; backward_impl applies it once at the end), dk transposed ([d, bk]); q_t is q.T
    // ([d, ld_t], zero past column bq).
    bool brgemm = false;
    const In* q_t = nullptr;
    int64_t ld_t = 0;
  };

  explicit BackwardLane(const Args& a)
      : a_(a), tk_(std::min(TILE_K, a.bk)), raw_tiles_(a.tiles.size, tk_, a.d, a.brgemm, /*backward=*/true),
        k_tile_(/*tb=*/false, a.tiles.size, a.d, tk_), raw_(a.tiles.size * tk_), s_(a.tiles.size * tk_),
        ds_buf_(std::is_same<DS, Acc>::value ? 0 : a.tiles.size * round_up_even(tk_)), shared_(tk_) {
    if (a.masks) masks_ = std::make_unique<TileMasks>(*a.masks, a.tiles.size, tk_, a.col_stats != nullptr);
  }

  // Row tiles [t_begin, t_end), accumulating into dk ([bk, d]); returns (row part, column part) of dscale.
  std::pair<double, double> run(int64_t t_begin, int64_t t_end, Acc* dk) {
    double lane_row = 0.0, lane_col = 0.0;
    for (int64_t j0 = 0; j0 < a_.bk; j0 += tk_) {
      const int64_t nj = std::min(tk_, a_.bk - j0);
      raw_tiles_.set_keys(a_.k + j0 * a_.d, nj);
      if (masks_) masks_->set_keys(j0, nj);
      k_tile_.set(a_.k + j0 * a_.d, a_.d, a_.d, nj, a_.scale);  // scale * k_j, for dq_i += dS @ k_j
      for (int64_t t = t_begin; t < t_end; ++t) {
        const auto parts = tile(a_.tiles.begin(t), a_.tiles.height(t), j0, nj, dk);
        lane_row += parts.first;
        lane_col += parts.second;
      }
    }
    return {lane_row, lane_col};
  }

 private:
  std::pair<double, double> tile(int64_t i0, int64_t ni, int64_t j0, int64_t nj, Acc* dk) {
    Acc* raw = raw_.data();
    Acc* s = s_.data();
    // float32 / float64 write dS over raw (each entry is read before it is written); bfloat16 to ds_buf_,
    // in rows of an even length (brgemm multiplies over an even depth), zero past column nj.
    DS* ds = ds_buf_.empty() ? reinterpret_cast<DS*>(raw) : ds_buf_.data();
    const int64_t ld_ds = ds_buf_.empty() ? nj : round_up_even(nj);
    raw_tiles_.product(a_.q + i0 * a_.d, ni, raw, nj);
    scale_tile(raw, s, ni * nj, a_.scale);
    ColGrads<Acc> col;
    if (a_.col_stats) col = {a_.col_stats + j0, a_.col_stats + a_.bk + j0, a_.g_col + j0};
    const bool shared =
        kOneExp<In> && a_.col_stats && shared_.prepare(a_.row_stats + i0, a_.row_stats + a_.bq + i0, ni, col, nj);
    if (shared) col.factor = shared_.col_factors();
    if (masks_) masks_->build(a_.pos, i0, ni, j0, nj);
    double tile_row = 0.0, tile_col = 0.0;
    for (int64_t r = 0; r < ni; ++r) {
      const int64_t i = i0 + r;
      const RowGrad<Acc> row{a_.row_stats[i], a_.row_stats[a_.bq + i], a_.g_row[i]};
      Acc acc_row = 0, acc_col = 0;
      const Acc* raw_r = raw + r * nj;
      const Acc* s_r = s + r * nj;
      DS* ds_r = ds + r * ld_ds;
      if (ld_ds != nj) ds_r[nj] = DS(0);
      if (!a_.col_stats) {
        row_terms<Terms::Rows>(r, i, j0, nj, raw_r, s_r, ds_r, row, Acc(0), col, acc_row, acc_col);
      } else if (shared) {
        row_terms<Terms::BothShared>(r, i, j0, nj, raw_r, s_r, ds_r, row, shared_.row_factor(row.m, row.rel), col,
                                     acc_row, acc_col);
      } else {
        row_terms<Terms::Both>(r, i, j0, nj, raw_r, s_r, ds_r, row, Acc(0), col, acc_row, acc_col);
      }
      tile_row += acc_row;
      tile_col += acc_col;
    }
    if constexpr (std::is_same<In, at::BFloat16>::value) {
      if (BrgemmKeyTile* b = raw_tiles_.brgemm_tile()) {
        b->add_dq(ds, ld_ds, ni, a_.dq + i0 * a_.d, a_.d);
        b->add_dk_t(a_.q_t + i0, a_.ld_t, ds, ld_ds, ni, dk + j0, a_.bk);
        return {tile_row, tile_col};
      }
    }
    k_tile_.product(ni, ds, ld_ds, Acc(1), a_.dq + i0 * a_.d, a_.d);
    gemm(true, false, nj, a_.d, ni, a_.scale, ds, ld_ds, a_.q + i0 * a_.d, a_.d, Acc(1), dk + j0 * a_.d, a_.d);
    return {tile_row, tile_col};
  }

  // Row r (global row i) of the tile at key column j0: the plain loss's dS row, or the masked one. A masked
  // row that is the plain loss's (plain_positive) takes ds_row at the plain loss's own call site, so that
  // the compiler cannot lay out its reductions differently: distinct ids give the plain loss bit for bit.
  template <Terms terms>
  void row_terms(int64_t r, int64_t i, int64_t j0, int64_t nj, const Acc* raw_r, const Acc* s_r, DS* ds_r,
                 const RowGrad<Acc>& row, Acc row_factor, const ColGrads<Acc>& col, Acc& acc_row, Acc& acc_col) {
    const int64_t p = masks_ ? plain_positive(r, i, j0, s_r) : positive_in_tile(a_.pos, i, j0, nj);
    if (p == kNotPlain) {
      ds_masked_row<terms>(nj, *masks_, r, raw_r, s_r, ds_r, row, row_factor, col, a_.row_pos.offset(i - r),
                           a_.col_pos.offset(j0), acc_row, acc_col);
      return;
    }
    ds_row<terms>(nj, p, raw_r, s_r, ds_r, row, row_factor, col, acc_row, acc_col);
  }

  // The tile column of masked row r's positive (-1: none in the tile) when the row is the plain loss's:
  // nothing excluded, at most one positive here, and its P - Y Label's (positive_term: "mean" with one
  // positive in all, "sum" with pm = S and pr = 0), in the column direction too; else kNotPlain.
  static constexpr int64_t kNotPlain = -2;
  int64_t plain_positive(int64_t r, int64_t i, int64_t j0, const Acc* s_r) const {
    const int64_t* first = masks_->positives_begin(r);
    const int64_t* last = masks_->positives_end(r);
    if (masks_->any(r) || last - first > 1) return kNotPlain;
    if (first == last) return -1;
    const int64_t c = *first;
    const bool cols = a_.col_stats != nullptr;
    auto lone = [&](const PositiveGrads<Acc>& y, int64_t t) {
      return masks_->kind() == Positives::Mean ? y.count[t] == Acc(1) : (y.max[t] == s_r[c] && y.rel[t] == Acc(0));
    };
    if (masks_->kind() == Positives::Label || (lone(a_.row_pos, i) && (!cols || lone(a_.col_pos, j0 + c)))) return c;
    return kNotPlain;
  }

  Args a_;
  int64_t tk_;
  RawTiles<In> raw_tiles_;
  ReusedB<DS, In, Acc> k_tile_;
  std::vector<Acc> raw_, s_;
  std::vector<DS> ds_buf_;
  SharedRef<Acc> shared_;
  std::unique_ptr<TileMasks> masks_;
};

// The masked backward's positives of one side, from the contiguous accumulation-dtype tensors given
// (a count for Label / "mean", stats [2, n] for "sum"; undefined where not needed).
template <typename Acc>
PositiveGrads<Acc> positive_grads(const at::Tensor& count, const at::Tensor& stats) {
  PositiveGrads<Acc> out;
  if (count.defined()) out.count = count.data_ptr<Acc>();
  if (stats.defined()) {
    out.max = stats.data_ptr<Acc>();
    out.rel = out.max + stats.size(1);
  }
  return out;
}

// masks: null for the plain loss; else the masked loss's inputs, with each side's positives
// (row_pos_* [bq], col_pos_* [bk]: see positive_grads).
template <typename In>
void backward_impl(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                   const at::Tensor& row_stats, const at::Tensor& g_row, const at::Tensor& col_stats,
                   const at::Tensor& g_col, at::Tensor& dq, at::Tensor& dk, at::Tensor& dscale, bool brgemm,
                   const MaskArgs* masks = nullptr, const at::Tensor& row_pos_count = {},
                   const at::Tensor& row_pos_stats = {}, const at::Tensor& col_pos_count = {},
                   const at::Tensor& col_pos_stats = {}) {
  using Acc = typename Types<In>::acc;
  const bool both = col_stats.defined();
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  const RowTiles tiles(bq);
  const int64_t lanes = lane_count(tiles);
  typename BackwardLane<In>::Args args{q.data_ptr<In>(), k.data_ptr<In>(), bq, bk, d, tiles,
                                       static_cast<Acc>(scale), pos.data_ptr<int64_t>(),
                                       row_stats.data_ptr<Acc>(), g_row.data_ptr<Acc>(),
                                       both ? col_stats.data_ptr<Acc>() : nullptr,
                                       both ? g_col.data_ptr<Acc>() : nullptr, dq.data_ptr<Acc>()};
  args.masks = masks;
  args.row_pos = positive_grads<Acc>(row_pos_count, row_pos_stats);
  args.col_pos = positive_grads<Acc>(col_pos_count, col_pos_stats);
  // Lane 0 accumulates straight into dk; every other lane into its own [Bk, D] partial. Brgemm: every
  // lane into its own [D, Bk] partial and dq into dq_unscaled, q's row length d (even) possibly one past
  // the caller's D, the scale applied once when they join dq and dk.
  at::Tensor dq_unscaled, q_t, dk_parts;
  if (brgemm) {
    dq_unscaled = at::zeros({bq, d}, dq.options());
    q_t = transposed_pairs_operand(q);
    args.dq = dq_unscaled.data_ptr<Acc>();
    args.brgemm = true;
    args.q_t = q_t.data_ptr<In>();
    args.ld_t = q_t.size(1);
    dk_parts = at::zeros({lanes, d, bk}, dk.options());
  } else if (lanes > 1) {
    dk_parts = at::zeros({lanes - 1, bk, d}, dk.options());
  }
  std::vector<std::pair<double, double>> parts(lanes);
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    const SingleThreadedBlas one_thread;
    BackwardLane<In> work(args);
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      Acc* dkp = brgemm ? dk_parts[lane].data_ptr<Acc>()
                        : (lane == 0 ? dk.data_ptr<Acc>() : dk_parts[lane - 1].data_ptr<Acc>());
      parts[lane] = work.run(lane_start(tiles, lanes, lane), lane_start(tiles, lanes, lane + 1), dkp);
    }
  });
  if (brgemm) {
    for (int64_t p = 1; p < lanes; ++p) dk_parts[0].add_(dk_parts[p]);
    dq.add_(dq_unscaled.narrow(1, 0, dq.size(1)), scale);
    dk.add_(dk_parts[0].narrow(0, 0, dk.size(1)).t(), scale);
  } else {
    for (int64_t p = 1; p < lanes; ++p) dk.add_(dk_parts[p - 1]);
  }
  double total_row = 0.0, total_col = 0.0;
  for (const auto& part : parts) {
    total_row += part.first;
    total_col += part.second;
  }
  dscale[0] = total_row;
  dscale[1] = total_col;
}

// ---------------------------------------------------------------------------------------------
// Op entry points: validate, bring inputs into the layout the kernels read (prepared()), dispatch on dtype.

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

void check_features(const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "infcl native: q and k must be CPU tensors");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2, "infcl native: q and k must be 2-d, got ", q.sizes(), " and ",
              k.sizes());
  TORCH_CHECK(q.size(1) == k.size(1), "infcl native: q ", q.sizes(), " and k ", k.sizes(), " differ in D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "infcl native: q and k dtypes differ");
  const auto t = q.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf,
              "infcl native: unsupported dtype ", t);
}

// pos: [Bq] int64, each a column of the block or -1.
at::Tensor positions(const at::Tensor& pos, int64_t bq, int64_t bk) {
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == bq && pos.scalar_type() == at::kLong,
              "infcl native: pos must be int64 of shape [", bq, "], got ", pos.scalar_type(), " ", pos.sizes());
  at::Tensor p = pos.contiguous();
  if (bq > 0) {
    TORCH_CHECK(p.min().item<int64_t>() >= -1 && p.max().item<int64_t>() < bk,
                "infcl native: pos must lie in [-1, ", bk, ")");
  }
  return p;
}

// t as the kernel reads it: contiguous; bfloat16 as is on a bf16 GEMM route (common.h's bf16_route), in
// rows of bf16_row_length; float16 (fp16 dS would underflow) and bfloat16 off a route as float32 copies,
// which are exact.
at::Tensor prepared(const at::Tensor& t, Bf16Gemm route) {
  if (route != Bf16Gemm::None) return with_row_length(t, bf16_row_length(route, t.size(1)));
  const auto type = t.scalar_type();
  return t.to(type == at::kHalf || type == at::kBFloat16 ? at::kFloat : type).contiguous();
}

at::Tensor stats_arg(const at::Tensor& t, std::vector<int64_t> shape, at::ScalarType acc, const char* name) {
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "infcl native: ", name, " must have shape ",
              at::IntArrayRef(shape), ", got ", t.sizes());
  return t.to(acc).contiguous();
}

// Rows of the masked ops' forward results (infcl.masks: MASKED_ROWS): the stats over the entries kept (2),
// then the positives' max, log-sum relative to it, sum and count.
constexpr int64_t MASKED_ROWS = 6;

// The masked ops' extra inputs, checked and made contiguous; `args` points into the tensors held here.
struct MaskInputs {
  at::Tensor q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold;
  MaskArgs args;
};

Positives positives_of(const std::optional<c10::string_view>& multi_positive) {
  if (!multi_positive.has_value()) return Positives::Label;
  if (*multi_positive == "mean") return Positives::Mean;
  if (*multi_positive == "sum") return Positives::Sum;
  TORCH_CHECK(false, "infcl native: multi_positive must be None, 'mean' or 'sum', got '", std::string(*multi_positive),
              "'");
}

at::Tensor ids_arg(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kLong, "infcl native: ",
              name, " must be a CPU int64 tensor of shape [", n, "], got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

// symmetric: the column direction is wanted, so a guide needs the columns' thresholds too.
std::unique_ptr<MaskInputs> mask_inputs(int64_t bq, int64_t bk, bool symmetric,
                                        const std::optional<c10::string_view>& multi_positive,
                                        const std::optional<at::Tensor>& q_ids, const std::optional<at::Tensor>& k_ids,
                                        const std::optional<at::Tensor>& guide_q,
                                        const std::optional<at::Tensor>& guide_k,
                                        const std::optional<at::Tensor>& row_threshold,
                                        const std::optional<at::Tensor>& col_threshold) {
  auto m = std::make_unique<MaskInputs>();
  m->args.positives = positives_of(multi_positive);
  TORCH_CHECK(q_ids.has_value() == k_ids.has_value(), "infcl native: q_ids and k_ids go together");
  TORCH_CHECK(m->args.positives == Positives::Label || q_ids.has_value(),
              "infcl native: multi_positive needs q_ids and k_ids");
  if (q_ids.has_value()) {
    m->q_ids = ids_arg(*q_ids, bq, "q_ids");
    m->k_ids = ids_arg(*k_ids, bk, "k_ids");
    m->args.q_ids = m->q_ids.data_ptr<int64_t>();
    m->args.k_ids = m->k_ids.data_ptr<int64_t>();
  }
  TORCH_CHECK(guide_q.has_value() == guide_k.has_value(), "infcl native: guide_q and guide_k go together");
  if (!guide_q.has_value()) return m;
  const auto gt = guide_q->scalar_type();
  TORCH_CHECK((gt == at::kFloat || gt == at::kDouble) && guide_k->scalar_type() == gt,
              "infcl native: guide_q and guide_k must be both float32 or both float64, got ", gt, " and ",
              guide_k->scalar_type());
  TORCH_CHECK(guide_q->device().is_cpu() && guide_k->device().is_cpu() && guide_q->dim() == 2 &&
                  guide_k->dim() == 2 && guide_q->size(0) == bq && guide_k->size(0) == bk &&
                  guide_q->size(1) == guide_k->size(1),
              "infcl native: guide_q ", guide_q->sizes(), " and guide_k ", guide_k->sizes(), " must be CPU [", bq,
              ", D'] and [", bk, ", D']");
  TORCH_CHECK(row_threshold.has_value(), "infcl native: a guide needs row_threshold");
  TORCH_CHECK(!symmetric || col_threshold.has_value(), "infcl native: a symmetric guide needs col_threshold");
  m->guide_q = guide_q->contiguous();
  m->guide_k = guide_k->contiguous();
  // The thresholds are compared in the guide's dtype, as the scores are formed.
  m->row_threshold = stats_arg(*row_threshold, {bq}, gt, "row_threshold");
  if (symmetric) m->col_threshold = stats_arg(*col_threshold, {bk}, gt, "col_threshold");
  m->args.guide_q = m->guide_q.data_ptr();
  m->args.guide_k = m->guide_k.data_ptr();
  m->args.row_threshold = m->row_threshold.data_ptr();
  m->args.col_threshold = symmetric ? m->col_threshold.data_ptr() : nullptr;
  m->args.guide_dim = m->guide_q.size(1);
  m->args.guide_f64 = gt == at::kDouble;
  return m;
}

// Both forward ops: the plain loss (masks null) or the masked one.
std::tuple<at::Tensor, at::Tensor> run_forward(const at::Tensor& q_in, const at::Tensor& k_in, double scale,
                                               const at::Tensor& pos_in, bool symmetric, const MaskArgs* masks) {
  check_features(q_in, k_in);
  const auto acc = acc_type(q_in.scalar_type());
  const Bf16Gemm route = bf16_route(q_in);
  at::Tensor q = prepared(q_in, route), k = prepared(k_in, route);
  at::Tensor pos = positions(pos_in, q.size(0), k.size(0));
  const bool brgemm = route == Bf16Gemm::Brgemm;
  at::Tensor rows = at::empty({masks ? MASKED_ROWS : 3, q.size(0)}, q_in.options().dtype(acc));
  at::Tensor cols = at::empty({masks ? MASKED_ROWS : 2, symmetric ? k.size(0) : 0}, q_in.options().dtype(acc));
  switch (q.scalar_type()) {
    case at::kFloat: forward_impl<float>(q, k, scale, pos, symmetric, masks, brgemm, rows, cols); break;
    case at::kDouble: forward_impl<double>(q, k, scale, pos, symmetric, masks, brgemm, rows, cols); break;
    case at::kBFloat16: forward_impl<at::BFloat16>(q, k, scale, pos, symmetric, masks, brgemm, rows, cols); break;
    default: TORCH_CHECK(false, "infcl native: unreachable dtype");
  }
  return {rows, cols};
}

std::tuple<at::Tensor, at::Tensor> forward_block(const at::Tensor& q, const at::Tensor& k, double scale,
                                                 const at::Tensor& pos, bool symmetric) {
  return run_forward(q, k, scale, pos, symmetric, nullptr);
}

std::tuple<at::Tensor, at::Tensor> masked_forward_block(
    const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, bool symmetric,
    const std::optional<c10::string_view> multi_positive, const std::optional<at::Tensor>& q_ids,
    const std::optional<at::Tensor>& k_ids, const std::optional<at::Tensor>& guide_q,
    const std::optional<at::Tensor>& guide_k, const std::optional<at::Tensor>& row_threshold,
    const std::optional<at::Tensor>& col_threshold) {
  const auto masks = mask_inputs(q.size(0), k.size(0), symmetric, multi_positive, q_ids, k_ids, guide_q, guide_k,
                                 row_threshold, col_threshold);
  return run_forward(q, k, scale, pos, symmetric, &masks->args);
}

// The masked backward's positives of one side: the global count for "mean" ([n]), the stats for "sum" ([2, n]).
struct PositiveInputs {
  at::Tensor count, stats;
};

PositiveInputs positive_inputs(Positives kind, const std::optional<at::Tensor>& count,
                               const std::optional<at::Tensor>& stats, int64_t n, at::ScalarType acc,
                               const char* count_name, const char* stats_name) {
  PositiveInputs out;
  if (kind == Positives::Mean) {
    TORCH_CHECK(count.has_value(), "infcl native: multi_positive='mean' needs ", count_name);
    out.count = stats_arg(*count, {n}, acc, count_name);
  } else if (kind == Positives::Sum) {
    TORCH_CHECK(stats.has_value(), "infcl native: multi_positive='sum' needs ", stats_name);
    out.stats = stats_arg(*stats, {2, n}, acc, stats_name);
  }
  return out;
}

// Both backward ops: the plain loss (masks null) or the masked one (with each side's positives).
at::Tensor run_backward(const at::Tensor& q_in, const at::Tensor& k_in, double scale, const at::Tensor& pos_in,
                        const at::Tensor& row_stats, const at::Tensor& g_row,
                        const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
                        at::Tensor& dq, at::Tensor& dk, const MaskArgs* masks, const PositiveInputs& row_pos,
                        const PositiveInputs& col_pos) {
  check_features(q_in, k_in);
  const auto acc = acc_type(q_in.scalar_type());
  const int64_t bq = q_in.size(0), bk = k_in.size(0);
  TORCH_CHECK(col_stats.has_value() == g_col.has_value(), "infcl native: col_stats and g_col go together");
  TORCH_CHECK(dq.scalar_type() == acc && dk.scalar_type() == acc, "infcl native: dq and dk must be ", acc);
  TORCH_CHECK(dq.sizes() == q_in.sizes() && dk.sizes() == k_in.sizes(), "infcl native: dq ", dq.sizes(),
              " / dk ", dk.sizes(), " must match q ", q_in.sizes(), " / k ", k_in.sizes());
  const Bf16Gemm route = bf16_route(q_in);
  const bool brgemm = route == Bf16Gemm::Brgemm;
  at::Tensor q = prepared(q_in, route), k = prepared(k_in, route);
  at::Tensor pos = positions(pos_in, bq, bk);
  at::Tensor rs = stats_arg(row_stats, {2, bq}, acc, "row_stats"), gr = stats_arg(g_row, {bq}, acc, "g_row");
  at::Tensor cs, gc;
  if (col_stats.has_value()) {
    cs = stats_arg(*col_stats, {2, bk}, acc, "col_stats");
    gc = stats_arg(*g_col, {bk}, acc, "g_col");
  }
  // Accumulate into contiguous buffers; copy back only when the caller's dq / dk are strided.
  at::Tensor dq_c = dq.is_contiguous() ? dq : dq.contiguous();
  at::Tensor dk_c = dk.is_contiguous() ? dk : dk.contiguous();
  at::Tensor dscale = at::zeros({2}, at::TensorOptions().dtype(at::kDouble));
  switch (q.scalar_type()) {
#define INFCL_BACKWARD(T)                                                                                           \
  backward_impl<T>(q, k, scale, pos, rs, gr, cs, gc, dq_c, dk_c, dscale, brgemm, masks, row_pos.count,           \
                   row_pos.stats, col_pos.count, col_pos.stats)
    case at::kFloat: INFCL_BACKWARD(float); break;
    case at::kDouble: INFCL_BACKWARD(double); break;
    case at::kBFloat16: INFCL_BACKWARD(at::BFloat16); break;
#undef INFCL_BACKWARD
    default: TORCH_CHECK(false, "infcl native: unreachable dtype");
  }
  if (!dq.is_same(dq_c)) dq.copy_(dq_c);
  if (!dk.is_same(dk_c)) dk.copy_(dk_c);
  return dscale.to(acc);
}

at::Tensor backward_block(const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos,
                          const at::Tensor& row_stats, const at::Tensor& g_row,
                          const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
                          at::Tensor& dq, at::Tensor& dk) {
  return run_backward(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk, nullptr, {}, {});
}

at::Tensor masked_backward_block(
    const at::Tensor& q, const at::Tensor& k, double scale, const at::Tensor& pos, const at::Tensor& row_stats,
    const at::Tensor& g_row, const std::optional<at::Tensor>& col_stats, const std::optional<at::Tensor>& g_col,
    const std::optional<c10::string_view> multi_positive, const std::optional<at::Tensor>& q_ids,
    const std::optional<at::Tensor>& k_ids, const std::optional<at::Tensor>& guide_q,
    const std::optional<at::Tensor>& guide_k, const std::optional<at::Tensor>& row_threshold,
    const std::optional<at::Tensor>& col_threshold, const std::optional<at::Tensor>& row_pos_count,
    const std::optional<at::Tensor>& row_pos_stats, const std::optional<at::Tensor>& col_pos_count,
    const std::optional<at::Tensor>& col_pos_stats, at::Tensor& dq, at::Tensor& dk) {
  const bool symmetric = col_stats.has_value();
  const int64_t bq = q.size(0), bk = k.size(0);
  const auto masks = mask_inputs(bq, bk, symmetric, multi_positive, q_ids, k_ids, guide_q, guide_k, row_threshold,
                                 col_threshold);
  const auto acc = acc_type(q.scalar_type());
  const auto kind = masks->args.positives;
  const PositiveInputs row_pos =
      positive_inputs(kind, row_pos_count, row_pos_stats, bq, acc, "row_pos_count", "row_pos_stats");
  const PositiveInputs col_pos = symmetric ? positive_inputs(kind, col_pos_count, col_pos_stats, bk, acc,
                                                             "col_pos_count", "col_pos_stats")
                                           : PositiveInputs{};
  return run_backward(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk, &masks->args, row_pos, col_pos);
}

// G[i, pos[i]] (0 where pos[i] < 0), each read off the very guide tile TileMasks forms for row i's tile
// and pos[i]'s key tile (the same RowTiles grid, TILE_K key tiles and RawTiles route), so that a guide
// threshold and the scores compared with it come from the same arithmetic: a column duplicating the
// labelled one ties it exactly. Only the tiles holding a positive are multiplied.
template <typename G>
void guide_label_scores_impl(const G* gq, const G* gk, const int64_t* pos, int64_t bq, int64_t bk, int64_t dg, G* out) {
  const RowTiles tiles(bq);
  const int64_t tk = std::min(TILE_K, bk);
  std::fill(out, out + bq, G(0));
  at::parallel_for(0, tiles.count, 1, [&](int64_t t_begin, int64_t t_end) {
    const SingleThreadedBlas one_thread;
    RawTiles<G> raw(tiles.size, tk, dg);
    std::vector<G> scores(tiles.size * tk);
    for (int64_t j0 = 0; j0 < bk; j0 += tk) {
      const int64_t nj = std::min(tk, bk - j0);
      bool packed = false;
      for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t i0 = tiles.begin(t), ni = tiles.height(t);
        bool any = false;
        for (int64_t i = i0; i < i0 + ni; ++i) any = any || (pos[i] >= j0 && pos[i] < j0 + nj);
        if (!any) continue;
        if (!packed) raw.set_keys(gk + j0 * dg, nj), packed = true;
        raw.product(gq + i0 * dg, ni, scores.data(), nj);
        for (int64_t i = i0; i < i0 + ni; ++i) {
          if (pos[i] >= j0 && pos[i] < j0 + nj) out[i] = scores[(i - i0) * nj + (pos[i] - j0)];
        }
      }
    }
  });
}

at::Tensor guide_label_scores(const at::Tensor& guide_q, const at::Tensor& guide_k, const at::Tensor& pos_in) {
  const auto gt = guide_q.scalar_type();
  TORCH_CHECK((gt == at::kFloat || gt == at::kDouble) && guide_k.scalar_type() == gt && guide_q.dim() == 2 &&
                  guide_k.dim() == 2 && guide_q.size(1) == guide_k.size(1) && guide_q.device().is_cpu() &&
                  guide_k.device().is_cpu(),
              "infcl native: guide_q ", guide_q.sizes(), " and guide_k ", guide_k.sizes(),
              " must be CPU [Bq, D'] and [Bk, D'], both float32 or both float64");
  const int64_t bq = guide_q.size(0), bk = guide_k.size(0), dg = guide_q.size(1);
  const at::Tensor pos = ids_arg(pos_in, bq, "pos");
  const at::Tensor gq = guide_q.contiguous(), gk = guide_k.contiguous();
  at::Tensor out = at::empty({bq}, guide_q.options());
  if (gt == at::kDouble) {
    guide_label_scores_impl<double>(gq.data_ptr<double>(), gk.data_ptr<double>(), pos.data_ptr<int64_t>(), bq, bk, dg,
                                    out.data_ptr<double>());
  } else {
    guide_label_scores_impl<float>(gq.data_ptr<float>(), gk.data_ptr<float>(), pos.data_ptr<int64_t>(), bq, bk, dg,
                                   out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(infcl, m) {
  m.def("forward_block(Tensor q, Tensor k, float scale, Tensor pos, bool symmetric) -> (Tensor, Tensor)");
  m.def(
      "backward_block(Tensor q, Tensor k, float scale, Tensor pos, Tensor row_stats, Tensor g_row, "
      "Tensor? col_stats, Tensor? g_col, Tensor(a!) dq, Tensor(b!) dk) -> Tensor");
  m.def(
      "masked_forward_block(Tensor q, Tensor k, float scale, Tensor pos, bool symmetric, str? multi_positive, "
      "Tensor? q_ids, Tensor? k_ids, Tensor? guide_q, Tensor? guide_k, Tensor? row_threshold, "
      "Tensor? col_threshold) -> (Tensor, Tensor)");
  m.def(
      "masked_backward_block(Tensor q, Tensor k, float scale, Tensor pos, Tensor row_stats, Tensor g_row, "
      "Tensor? col_stats, Tensor? g_col, str? multi_positive, Tensor? q_ids, Tensor? k_ids, Tensor? guide_q, "
      "Tensor? guide_k, Tensor? row_threshold, Tensor? col_threshold, Tensor? row_pos_count, "
      "Tensor? row_pos_stats, Tensor? col_pos_count, Tensor? col_pos_stats, Tensor(a!) dq, Tensor(b!) dk) -> Tensor");
  m.def("guide_label_scores(Tensor guide_q, Tensor guide_k, Tensor pos) -> Tensor");
}

TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("forward_block", &forward_block);
  m.impl("backward_block", &backward_block);
  m.impl("masked_forward_block", &masked_forward_block);
  m.impl("masked_backward_block", &masked_backward_block);
  m.impl("guide_label_scores", &guide_label_scores);
}

}  // namespace infcl
