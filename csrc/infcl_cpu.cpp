// infcl native CPU kernel: the two block operations of the contrastive loss (see
// infcl/backends/base.py for the contract), fused so each S tile is produced by one BLAS call and
// consumed while it is still in cache.
//
//   forward_block(q [Bq,D], k [Bk,D], scale, want_cols) -> (row_lse [Bq], col_lse [Bk] or [0])
//   backward_block(q, k, scale, row_lse, g_row, col_lse?, g_col?, dq!, dk!) -> dscale [2] (row, col)
//
// Parallel layout: the Bq rows are cut into `lanes` contiguous row ranges (one per thread). Each lane
// walks its rows in TILE_Q x TILE_K tiles of S = scale * q @ k.T, key tiles outer and row tiles inner,
// so one key tile serves all the lane's row tiles (float32 packs it once for MKL: see ReusedB); every
// product is a single-threaded BLAS call on a cache-sized tile (MKL's packed sgemm or at::mm_out /
// addmm_ for float32 and float64, MKL's bf16 x bf16 -> fp32 GEMM for bfloat16). Row results belong
// to one lane; column results (the column log-sum-exp partials in the forward, dk in the backward)
// are kept per lane and summed in lane order at the end. Partition and merge order depend only on the
// shapes and the thread count, never on scheduling, so results are bit-identical run to run.
//
// Extra memory: the tile buffers, MKL's packed copy of the current key tile per lane (float32; ~1.25x
// its data resident), O(lanes * Bk) column partials and (lanes - 1) dk partials of [Bk, D] (plus
// float32 copies of q and k for float16 inputs) -- never O(Bq * Bk).

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
#include <type_traits>
#include <vector>

namespace infcl {
namespace {

// Tile of S: 256 query rows x 512 key columns of float32 = 512 KiB, which with its q and k panels
// stays inside one core's 2 MiB L2 on the machines we measured, while every product still has a
// reduction dimension (D, TILE_K or TILE_Q) long enough for BLAS to run at its full rate. Measured
// at B=8192, D=512 on 2 cores (AMX Xeon, noisy VM): 512x512, 256x1024, 512x1024, 1024x1024 and
// 1024x2048 were no faster in float32 (all within the +-15% run-to-run noise) and 5-30% slower in
// bfloat16, whose small-tile MKL GEMMs are ~2x below its big-GEMM rate at every size tried.
constexpr int64_t TILE_Q = 256;
constexpr int64_t TILE_K = 512;
// Span (in natural-log units) within which one tile's row / column maxima or log-sum-exps must lie for
// the one-exp-per-entry paths: exp(+-SPAN) and their products stay normal floats with room to spare,
// and a term that underflows there is below exp(EXP_LO + SPAN) = e^-47 of its row's or column's
// largest term -- far under float32 resolution even summed over 2^31 entries.
constexpr float SHARED_REF_SPAN = 40.0f;
// The backward's version: a flushed exp(s - lr) hides exp(s - lc) = exp(s - lr) * exp(lr - lc) with
// |lr - lc| <= 2 * LSE_REF_SPAN, so what is lost stays below exp(EXP_LO + 2 * LSE_REF_SPAN) = e^-47 (of a
// column's total probability 1).
constexpr float LSE_REF_SPAN = 20.0f;
// A lane gets at least this many rows: below it, splitting the rows over threads costs more in
// small, inefficient GEMMs than it gains.
constexpr int64_t MIN_ROWS_PER_LANE = 32;

// ---------------------------------------------------------------------------------------------
// Vectorizable exp. std::exp does not auto-vectorize without -ffast-math (which would also break
// NaN propagation), so this is the Cephes expf algorithm written branch-free: n = round(x / ln2),
// r = x - n ln2 (two-constant Cody-Waite), exp(r) by a degree-7 minimax polynomial, times 2^n.
// Max error about 1 ulp on the range we use (x <= 0 up to rounding). NaN in gives NaN out; results
// below FLT_MIN flush to 0 (their contribution to any sum here is below float32 resolution).
constexpr float LOG2E = 1.44269504088896341f;    // 1 / ln(2)
constexpr float LN2_HI = 0.693359375f;           // ln(2) split: hi part exact in 9 bits ...
constexpr float LN2_LO = -2.12194440e-4f;        // ... lo = ln(2) - hi
constexpr float EXP_HI = 88.7228391f;            // log(FLT_MAX): above it exp overflows to inf
constexpr float EXP_LO = -87.3365448f;           // log(FLT_MIN): below it we return 0
constexpr float ROUND_MAGIC = 12582912.0f;       // 1.5 * 2^23: adding it rounds to an integer

inline float pow2_int(int32_t n) {
  // 2^n for n in [-126, 127] by building the exponent field directly.
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float exp_f32(float x) {
  float xc = x >= EXP_LO ? x : EXP_LO;  // NaN compares false and is clamped here; restored below
  xc = xc <= EXP_HI ? xc : EXP_HI;
  const float n = (xc * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;
  float r = xc - n * LN2_HI;
  r = r - n * LN2_LO;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  // n can reach 128 at the top of the range: apply 2^n as two in-range factors.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1;
  float y = p * pow2_int(n1) * pow2_int(ni - n1);
  y = x < EXP_LO ? 0.0f : y;
  y = x > EXP_HI ? std::numeric_limits<float>::infinity() : y;
  return x != x ? x : y;
}

inline float fast_exp(float x) { return exp_f32(x); }
inline double fast_exp(double x) { return std::exp(x); }  // float64 is the exact path, not the fast one

template <typename T>
inline T nan_max(T a, T b) {
  // max that keeps a NaN from either side.
  return (a > b || a != a) ? a : b;
}

// exp(old - new) for rescaling a running sum when its running max grows; 1 when the max did not
// move (this also covers old == new == -inf, where the difference would be NaN).
template <typename T>
inline T rescale_factor(T old_max, T new_max) {
  return old_max == new_max ? T(1) : fast_exp(old_max - new_max);
}

// float -> bfloat16 bits, round to nearest even, written so it vectorizes; NaN stays NaN.
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
}

// ---------------------------------------------------------------------------------------------
// GEMM on row-major 2-D tiles: C[M,N] = alpha * op(A) @ op(B) + beta * C, op = transpose or not.
// float32 / float64 go through ATen (at::mm_out / addmm_, i.e. MKL or whatever BLAS torch uses);
// bfloat16 needs an fp32 output that at::mm cannot give on CPU, so it calls MKL's
// cblas_gemm_bf16bf16f32 when the torch build exports it (weak symbol: absent -> float32 path).
//
// Tried and dropped (2026-11-22, B=8192, D=512, 2 cores), so nobody retries them blind:
// - MKL's packed-operand sgemm with every k panel packed up front: cblas_sgemm_pack_get_size asks
//   ~7.9 MB plus the panel's data for every panel, so ~140 MB at B=8192 and over 1 GB at B=65536.
//   (ReusedB packs one key tile per lane at a time instead, in an uninitialized buffer.)
// - oneDNN's float32 brgemm ukernel (at::native::cpublas::brgemm): 60-94 GFLOP/s on these tiles.
// - oneDNN's bf16 AMX brgemm ukernel (at::native::cpublas::brgemm). It needs arch_prctl(ARCH_REQ_XCOMP_PERM)
//   and a tile release after each group of calls, because MKL's bf16 GEMM shares the AMX state (SIGILL
//   otherwise); B must be VNNI-packed in blocks of <= 64 columns, in multiples of 16.
//   - S products only: 530-540 GFLOP/s against 375-385 for MKL's bf16 GEMM on S alone, but no
//     reliable end-to-end gain in interleaved runs (branch exp/bf16-brgemm).
//   - All three products, every packed operand reused (k tile per lane, q rows per call, dS per tile;
//     branch exp/bf16-brgemm-all): the same speed as MKL, 1.01-1.04x its time in 2 x 16 paired runs in one
//     process at B=8192.
// - at::mm bf16 x bf16 -> bf16 (oneDNN) for the S tiles: ~550 GFLOP/s, ~5% faster end to end, but it
//   rounds every S entry to bf16; not worth that.
// bf16 tile products here are bound by AMX throughput, which this VM's two vCPUs appear to share: one
// big bf16 GEMM ran at 240-1070 GFLOP/s on 1 thread and 500-1900 on 2 in the same hour.

extern "C" {
// MKL's CBLAS enums and LP64 signature.
enum { kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112 };
void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                            int ldc) __attribute__((weak));
// MKL's thread count for BLAS calls made by the calling thread (0: back to the global setting).
int MKL_Set_Num_Threads_Local(int nthreads) __attribute__((weak));
// MKL's packed-operand sgemm: op(B) packed once, then multiplied by many A tiles.
enum { kCblasPacked = 151, kCblasBMatrix = 162 };
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

bool has_bf16_gemm() { return cblas_gemm_bf16bf16f32 != nullptr; }

template <typename T>
at::Tensor view2d(const T* data, int64_t rows, int64_t cols, int64_t ld, bool trans) {
  // A (rows x cols) row-major view with leading dimension ld, transposed if asked.
  auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  at::Tensor t = at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1}, opts);
  return trans ? t.t() : t;
}

template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  at::Tensor av = ta ? view2d(a, k, m, lda, true) : view2d(a, m, k, lda, false);
  at::Tensor bv = tb ? view2d(b, n, k, ldb, true) : view2d(b, k, n, ldb, false);
  at::Tensor cv = view2d(c, m, n, ldc, false);
  if (beta == T(0) && alpha == T(1)) {
    at::mm_out(cv, av, bv);
  } else {
    cv.addmm_(av, bv, beta, alpha);
  }
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a, int64_t lda,
          const at::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_gemm_bf16bf16f32(kCblasRowMajor, ta ? kCblasTrans : kCblasNoTrans, tb ? kCblasTrans : kCblasNoTrans,
                         static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha,
                         reinterpret_cast<const uint16_t*>(a), static_cast<int>(lda),
                         reinterpret_cast<const uint16_t*>(b), static_cast<int>(ldb), beta, c,
                         static_cast<int>(ldc));
}

// Makes MKL run single-threaded in this lane for the guard's lifetime. torch.set_num_threads() turns
// MKL's dynamic thread adjustment off, and MKL then partitions a product called from inside a
// parallel region for the full thread count, run by one thread: 7% slower forward (B=8192, D=512).
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() : previous_(MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous_);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int previous_;
};

bool has_sgemm_pack() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
}

// The B operand of C[m, n] = A[m, kk] @ op(B) + beta * C when one k tile serves all of a lane's row
// tiles: set() once per k tile, then product() per row tile. For float32 with MKL, op(B) is packed
// once into MKL's internal layout (with alpha folded in), so the row-tile products skip repacking it,
// which is most of what separates a 256-row tile product from MKL's big-GEMM rate. The packed panel
// is sized for m = TILE_Q rows; a shorter (ragged) row tile, and every other dtype, uses gemm(). It is
// only packed when at least two full row tiles share it (lane_rows >= 2 m): one product gains nothing.
// The buffer is left uninitialized: MKL reserves ~8 MB beyond the panel's data that it does not
// write, so those pages are never touched and never become resident.
template <typename A, typename Bt, typename C>
class ReusedB {
 public:
  ReusedB(int64_t lane_rows, bool tb, int64_t m, int64_t n_max, int64_t k_max) : tb_(tb), m_(m) {
    if constexpr (std::is_same<Bt, float>::value) {
      if (lane_rows >= 2 * m && has_sgemm_pack()) {
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

// dS as handed to the dq / dk products. float32 / float64: itself, written over the raw tile in
// place. bfloat16: hi = bf16(v) goes to the dq / dk products, and v stays in the raw tile. Rounding
// dS to one bf16 costs up to 2^-9 * |dS| per entry; that is below torch's own bf16 error except where
// the entry nearly cancels against the positive logit's term (added later by the ring driver), i.e.
// where the probability is large. So entries with dS >= DS_LOW_PART_FRACTION * (g_row + g_col) also
// get their low part lo = v - hi added exactly in float32 (a rank-1 update of one dq row and one dk
// row each), which needs no second bf16 product over the whole tile.
// store_ds also raises need_low to v - thr (bfloat16 only): >= 0 once an entry reaches its threshold.
template <typename Acc>
inline void store_ds(Acc* dst, Acc* /*raw*/, int64_t i, Acc v, Acc /*thr*/, Acc& /*need_low*/) {
  dst[i] = v;
}
inline void store_ds(at::BFloat16* dst, float* raw, int64_t i, float v, float thr, float& need_low) {
  const uint16_t hi = to_bf16_bits(v);
  std::memcpy(dst + i, &hi, sizeof hi);
  raw[i] = v;
  const float over = v - thr;
  need_low = need_low > over ? need_low : over;
}
// At most 1 / DS_LOW_PART_FRACTION entries of a row (or column) can reach the threshold, as its
// probabilities sum to 1; below it the dropped low part is under 2^-17 of that row's gradient weight.
constexpr float DS_LOW_PART_FRACTION = 1.0f / 256;

inline float bf16_to_float(at::BFloat16 v) { return static_cast<float>(v); }

// y[0:n] += a * x[0:n] with x in bfloat16, y in float32.
inline void axpy(int64_t n, float a, const at::BFloat16* x, float* y) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) y[t] += a * bf16_to_float(x[t]);
}

// Rows [begin, end) of lane `lane` out of `lanes` equal contiguous ranges of n rows.
inline int64_t lane_start(int64_t n, int64_t lanes, int64_t lane) { return n * lane / lanes; }

int64_t lane_count(int64_t rows) {
  const int64_t by_size = std::max<int64_t>(1, rows / MIN_ROWS_PER_LANE);
  return std::min<int64_t>(at::get_num_threads(), by_size);
}

// ---------------------------------------------------------------------------------------------
// Forward: running (max, sum) per row of the lane's current row tile and per column of the lane's
// column partial; a tile is read twice from cache (max pass, exp pass), never written back to memory.

template <typename In>
void forward_impl(const at::Tensor& q, const at::Tensor& k, double scale_d, bool want_cols, at::Tensor& row_lse,
                  at::Tensor& col_lse) {
  using Acc = typename Types<In>::acc;
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  const In* qp = q.data_ptr<In>();
  const In* kp = k.data_ptr<In>();
  const Acc scale = static_cast<Acc>(scale_d);
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const int64_t lanes = lane_count(bq);
  // Column partials per lane: running max (Acc) and running sum (double, it sums Bq terms).
  std::vector<Acc> col_max(want_cols ? lanes * bk : 0, neg_inf);
  std::vector<double> col_sum(want_cols ? lanes * bk : 0, 0.0);
  Acc* out_row = row_lse.data_ptr<Acc>();

  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    const SingleThreadedBlas one_thread;
    const int64_t tq = TILE_Q, tk = std::min(TILE_K, bk);
    std::vector<Acc> s(tq * tk), tile_col_max(tk), tile_col_sum(tk);
    ReusedB<In, In, Acc> k_tile(bq / lanes, /*tb=*/true, tq, tk, d);  // scale * k_j.T
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      Acc* cmax = want_cols ? col_max.data() + lane * bk : nullptr;
      double* csum = want_cols ? col_sum.data() + lane * bk : nullptr;
      const int64_t r_begin = lane_start(bq, lanes, lane), r_end = lane_start(bq, lanes, lane + 1);
      // The lane's running row maxima and sums, over all its rows: the k tiles are the outer loop.
      std::vector<Acc> lane_row_max(r_end - r_begin, neg_inf);
      std::vector<double> lane_row_sum(r_end - r_begin, 0.0);
      for (int64_t j0 = 0; j0 < bk; j0 += tk) {
        const int64_t nj = std::min(tk, bk - j0);
        k_tile.set(kp + j0 * d, d, nj, d, scale);
        for (int64_t i0 = r_begin; i0 < r_end; i0 += tq) {
          const int64_t ni = std::min(tq, r_end - i0);
          Acc* row_max = lane_row_max.data() + (i0 - r_begin);
          double* row_sum = lane_row_sum.data() + (i0 - r_begin);
          k_tile.product(ni, qp + i0 * d, d, Acc(0), s.data(), nj);
          // Pass 1: tile row and column maxima (S is already scaled by the GEMM's alpha).
          std::fill(tile_col_max.begin(), tile_col_max.begin() + nj, neg_inf);
          Acc* tcm = tile_col_max.data();
          Acc tile_max = neg_inf, low_row = std::numeric_limits<Acc>::infinity();
          for (int64_t r = 0; r < ni; ++r) {
            const Acc* sr = s.data() + r * nj;
            Acc m = neg_inf;
#pragma omp simd reduction(max : m)
            for (int64_t c = 0; c < nj; ++c) {
              const Acc v = sr[c];
              m = m > v ? m : v;
              tcm[c] = tcm[c] > v ? tcm[c] : v;
            }
            tile_max = nan_max(tile_max, m);
            low_row = std::min(low_row, m);
            const Acc new_max = nan_max(row_max[r], m);
            row_sum[r] *= rescale_factor(row_max[r], new_max);
            row_max[r] = new_max;
          }
          Acc low_col = std::numeric_limits<Acc>::infinity();
          for (int64_t c = 0; c < nj; ++c) low_col = std::min(low_col, tcm[c]);
          if (want_cols) {
            for (int64_t c = 0; c < nj; ++c) {
              const Acc new_max = nan_max(cmax[j0 + c], tcm[c]);
              csum[j0 + c] *= rescale_factor(cmax[j0 + c], new_max);
              cmax[j0 + c] = new_max;
              tile_col_sum[c] = 0;
            }
          }
          Acc* tcs = tile_col_sum.data();
          // Pass 2, one exp per entry: when every tile row and column maximum is within SHARED_REF_SPAN
          // of the tile maximum M, e = exp(s - M) serves both the row and the column sums, each
          // rebased once per row / column by exp(M - running max) <= exp(SHARED_REF_SPAN) (no
          // overflow); every row's and column's own largest term is >= exp(-SHARED_REF_SPAN), a
          // normal float, so what flushes to 0 is below exp(EXP_LO + SHARED_REF_SPAN) of it. Any
          // other tile (inf, NaN, very spread logits) takes the two-exp path against the exact maxima.
          const bool shared_ref = want_cols && std::isfinite(tile_max) && low_row >= tile_max - SHARED_REF_SPAN &&
                                  low_col >= tile_max - SHARED_REF_SPAN;
          if (shared_ref) {
            for (int64_t r = 0; r < ni; ++r) {
              const Acc* sr = s.data() + r * nj;
              Acc acc = 0;
#pragma omp simd reduction(+ : acc)
              for (int64_t c = 0; c < nj; ++c) {
                const Acc e = fast_exp(sr[c] - tile_max);
                acc += e;
                tcs[c] += e;
              }
              row_sum[r] += static_cast<double>(acc) * fast_exp(tile_max - row_max[r]);
            }
            for (int64_t c = 0; c < nj; ++c) {
              csum[j0 + c] += static_cast<double>(tcs[c]) * fast_exp(tile_max - cmax[j0 + c]);
            }
            continue;
          }
          // Pass 2, two exps per entry: against the updated row and column maxima.
          const Acc* cm = want_cols ? cmax + j0 : nullptr;
          for (int64_t r = 0; r < ni; ++r) {
            const Acc* sr = s.data() + r * nj;
            const Acc rm = row_max[r];
            Acc acc = 0;
            if (want_cols) {
#pragma omp simd reduction(+ : acc)
              for (int64_t c = 0; c < nj; ++c) {
                acc += fast_exp(sr[c] - rm);
                tcs[c] += fast_exp(sr[c] - cm[c]);
              }
            } else {
#pragma omp simd reduction(+ : acc)
              for (int64_t c = 0; c < nj; ++c) acc += fast_exp(sr[c] - rm);
            }
            row_sum[r] += acc;
          }
          if (want_cols) {
            for (int64_t c = 0; c < nj; ++c) csum[j0 + c] += tcs[c];
          }
        }
      }
      for (int64_t r = 0; r < r_end - r_begin; ++r) {
        out_row[r_begin + r] = static_cast<Acc>(lane_row_max[r] + std::log(lane_row_sum[r]));
      }
    }
  });

  if (want_cols) {
    // Merge the lanes' column partials in lane order: lse = M + log(sum_p sum_p * exp(max_p - M)).
    Acc* out_col = col_lse.data_ptr<Acc>();
    at::parallel_for(0, bk, 1024, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        Acc m = neg_inf;
        for (int64_t p = 0; p < lanes; ++p) m = nan_max(m, col_max[p * bk + c]);
        double total = 0.0;
        for (int64_t p = 0; p < lanes; ++p) total += col_sum[p * bk + c] * rescale_factor(col_max[p * bk + c], m);
        out_col[c] = static_cast<Acc>(m + std::log(total));
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: per tile, raw = q_i @ k_j.T once; one fused pass forms
//   P_row = g_row * exp(scale*raw - row_lse),  P_col = g_col * exp(scale*raw - col_lse),
// adds P_row*raw and P_col*raw to the split scale gradient and stores dS = P_row + P_col over raw;
// then dq_i += scale * dS @ k_j and dk_j += scale * dS.T @ q_i.

// The low parts of one row's large bfloat16 dS entries (see store_ds): for each column c with
// dS = v[c] >= thr_r + DS_LOW_PART_FRACTION * g_col[c], lo = v - bf16(v) is added as
// dq_row += scale * lo * k[c] and dk[c] += scale * lo * q_row, in column order.
void add_low_parts(int64_t nj, const float* v, const at::BFloat16* hi, float thr_r, const float* g_col,
                   const at::BFloat16* q_row, const at::BFloat16* k_tile, int64_t d, float scale, float* dq_row,
                   float* dk_tile) {
  for (int64_t c = 0; c < nj; ++c) {
    const float thr = thr_r + (g_col ? DS_LOW_PART_FRACTION * g_col[c] : 0.0f);
    if (!(v[c] >= thr)) continue;
    const float lo = v[c] - bf16_to_float(hi[c]);
    if (lo == 0.0f) continue;
    axpy(d, scale * lo, k_tile + c * d, dq_row);
    axpy(d, scale * lo, q_row, dk_tile + c * d);
  }
}

template <typename In>
void backward_impl(const at::Tensor& q, const at::Tensor& k, double scale_d, const at::Tensor& row_lse,
                   const at::Tensor& g_row, const at::Tensor& col_lse, const at::Tensor& g_col, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dscale) {
  using Acc = typename Types<In>::acc;
  using DS = typename Types<In>::ds;
  const bool both = col_lse.defined();
  const int64_t bq = q.size(0), bk = k.size(0), d = q.size(1);
  const In* qp = q.data_ptr<In>();
  const In* kp = k.data_ptr<In>();
  const Acc scale = static_cast<Acc>(scale_d);
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  const Acc* lse_r = row_lse.data_ptr<Acc>();
  const Acc* g_r = g_row.data_ptr<Acc>();
  const Acc* lse_c = both ? col_lse.data_ptr<Acc>() : nullptr;
  const Acc* g_c = both ? g_col.data_ptr<Acc>() : nullptr;
  Acc* dqp = dq.data_ptr<Acc>();
  const int64_t lanes = lane_count(bq);
  // Lane 0 accumulates straight into dk; every other lane into its own [Bk, D] partial.
  at::Tensor dk_parts = lanes > 1 ? at::zeros({lanes - 1, bk, d}, dk.options()) : at::Tensor();
  std::vector<double> ds_row(lanes, 0.0), ds_col(lanes, 0.0);

  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    const SingleThreadedBlas one_thread;
    const int64_t tq = TILE_Q, tk = std::min(TILE_K, bk);
    std::vector<Acc> raw(tq * tk), col_factor(tk);
    // float32 / float64 overwrite raw with dS in place; bfloat16 writes bf16(dS) here.
    constexpr bool split = !std::is_same<DS, Acc>::value;
    std::vector<DS> ds_buf(split ? tq * tk : 0);
    // A local copy: read through the lambda's reference inside the simd loops, GCC cannot hoist it past
    // the dS stores and reloads it with a gather every iteration (measured: the loops ran ~3x slower).
    const Acc sc = scale;
    ReusedB<In, In, Acc> k_tile_t(bq / lanes, /*tb=*/true, tq, tk, d);  // k_j.T, for raw = q_i @ k_j.T
    ReusedB<DS, In, Acc> k_tile(bq / lanes, /*tb=*/false, tq, d, tk);   // scale * k_j, for dq_i += dS @ k_j
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      Acc* dkp = lane == 0 ? dk.data_ptr<Acc>() : dk_parts[lane - 1].data_ptr<Acc>();
      DS* ds = std::is_same<DS, Acc>::value ? reinterpret_cast<DS*>(raw.data()) : ds_buf.data();
      double lane_row = 0.0, lane_col = 0.0;
      const int64_t r_begin = lane_start(bq, lanes, lane), r_end = lane_start(bq, lanes, lane + 1);
      for (int64_t j0 = 0; j0 < bk; j0 += tk) {
        const int64_t nj = std::min(tk, bk - j0);
        k_tile_t.set(kp + j0 * d, d, nj, d, Acc(1));
        k_tile.set(kp + j0 * d, d, d, nj, scale);
        for (int64_t i0 = r_begin; i0 < r_end; i0 += tq) {
          const int64_t ni = std::min(tq, r_end - i0);
          k_tile_t.product(ni, qp + i0 * d, d, Acc(0), raw.data(), nj);
          Acc tile_row = 0, tile_col = 0;
          // One exp per entry when the tile's row and column log-sum-exps all lie within
          // LSE_REF_SPAN of L = max row lse: then exp(s - lc) = exp(s - lr) * exp(lr - L) * exp(L - lc),
          // the two factors per row / column in [e^-SPAN, e^SPAN]. Otherwise two exps per entry.
          bool shared_ref = both;
          Acc ref = neg_inf;
          if (both) {
            Acc low = std::numeric_limits<Acc>::infinity();
            for (int64_t r = 0; r < ni; ++r) {
              ref = nan_max(ref, lse_r[i0 + r]);
              low = std::min(low, lse_r[i0 + r]);
            }
            Acc lo_c = std::numeric_limits<Acc>::infinity(), hi_c = neg_inf;
            for (int64_t c = 0; c < nj; ++c) {
              lo_c = std::min(lo_c, lse_c[j0 + c]);
              hi_c = nan_max(hi_c, lse_c[j0 + c]);
            }
            shared_ref = std::isfinite(ref) && low >= ref - LSE_REF_SPAN && lo_c >= ref - LSE_REF_SPAN &&
                         hi_c <= ref + LSE_REF_SPAN;
            if (shared_ref) {
              for (int64_t c = 0; c < nj; ++c) col_factor[c] = g_c[j0 + c] * fast_exp(ref - lse_c[j0 + c]);
            }
          }
          for (int64_t r = 0; r < ni; ++r) {
            Acc* rr = raw.data() + r * nj;
            DS* dr = ds + r * nj;
            const Acc lr = lse_r[i0 + r], gr = g_r[i0 + r];
            Acc acc_r = 0, acc_c = 0;
            // Largest dS - DS_LOW_PART_FRACTION * (g_row + g_col) of the row (bfloat16 only).
            Acc need_low = neg_inf;
            const Acc thr_r = DS_LOW_PART_FRACTION * gr;
            const Acc* gcj = both ? g_c + j0 : nullptr;
            if (shared_ref) {
              const Acc row_factor = fast_exp(lr - ref);
              const Acc* cf = col_factor.data();
#pragma omp simd reduction(+ : acc_r, acc_c) reduction(max : need_low)
              for (int64_t c = 0; c < nj; ++c) {
                const Acc x = rr[c];
                const Acc e = fast_exp(x * sc - lr);
                const Acc pr = gr * e;
                const Acc pc = (e * row_factor) * cf[c];
                acc_r += pr * x;
                acc_c += pc * x;
                store_ds(dr, rr, c, pr + pc, thr_r + DS_LOW_PART_FRACTION * gcj[c], need_low);
              }
            } else if (both) {
              const Acc* lc = lse_c + j0;
              const Acc* gc = g_c + j0;
#pragma omp simd reduction(+ : acc_r, acc_c) reduction(max : need_low)
              for (int64_t c = 0; c < nj; ++c) {
                const Acc x = rr[c], sv = x * sc;
                const Acc pr = gr * fast_exp(sv - lr);
                const Acc pc = gc[c] * fast_exp(sv - lc[c]);
                acc_r += pr * x;
                acc_c += pc * x;
                store_ds(dr, rr, c, pr + pc, thr_r + DS_LOW_PART_FRACTION * gcj[c], need_low);
              }
            } else {
#pragma omp simd reduction(+ : acc_r) reduction(max : need_low)
              for (int64_t c = 0; c < nj; ++c) {
                const Acc x = rr[c];
                const Acc pr = gr * fast_exp(x * sc - lr);
                acc_r += pr * x;
                store_ds(dr, rr, c, pr, thr_r, need_low);
              }
            }
            tile_row += acc_r;
            tile_col += acc_c;
            if constexpr (split) {
              if (need_low >= 0) add_low_parts(nj, rr, dr, thr_r, gcj, qp + (i0 + r) * d, kp + j0 * d, d, scale,
                                               dqp + (i0 + r) * d, dkp + j0 * d);
            }
          }
          lane_row += tile_row;
          lane_col += tile_col;
          k_tile.product(ni, ds, nj, Acc(1), dqp + i0 * d, d);
          gemm(true, false, nj, d, ni, scale, ds, nj, qp + i0 * d, d, Acc(1), dkp + j0 * d, d);
        }
      }
      ds_row[lane] = lane_row;
      ds_col[lane] = lane_col;
    }
  });

  for (int64_t p = 1; p < lanes; ++p) dk.add_(dk_parts[p - 1]);
  double total_row = 0.0, total_col = 0.0;
  for (int64_t p = 0; p < lanes; ++p) {
    total_row += ds_row[p];
    total_col += ds_col[p];
  }
  dscale[0] = total_row;
  dscale[1] = total_col;
}

// ---------------------------------------------------------------------------------------------
// Op entry points: validate, bring inputs into the layout the kernels read (contiguous; float16 as
// float32, bfloat16 as float32 when MKL's bf16 GEMM is missing), dispatch on dtype.

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

// The dtype the kernel runs on for inputs of dtype t.
at::ScalarType kernel_type(at::ScalarType t) {
  if (t == at::kHalf) return at::kFloat;  // fp16 dS would underflow; float32 copies are exact
  if (t == at::kBFloat16 && !has_bf16_gemm()) return at::kFloat;
  return t;
}

at::Tensor prepared(const at::Tensor& t) { return t.to(kernel_type(t.scalar_type())).contiguous(); }

at::Tensor vector_arg(const at::Tensor& t, int64_t n, at::ScalarType acc, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "infcl native: ", name, " must have shape [", n, "], got ",
              t.sizes());
  return t.to(acc).contiguous();
}

std::tuple<at::Tensor, at::Tensor> forward_block(const at::Tensor& q_in, const at::Tensor& k_in, double scale,
                                                 bool want_cols) {
  check_features(q_in, k_in);
  const auto acc = acc_type(q_in.scalar_type());
  at::Tensor q = prepared(q_in), k = prepared(k_in);
  at::Tensor row_lse = at::empty({q.size(0)}, q_in.options().dtype(acc));
  at::Tensor col_lse = at::empty({want_cols ? k.size(0) : 0}, q_in.options().dtype(acc));
  switch (q.scalar_type()) {
    case at::kFloat: forward_impl<float>(q, k, scale, want_cols, row_lse, col_lse); break;
    case at::kDouble: forward_impl<double>(q, k, scale, want_cols, row_lse, col_lse); break;
    case at::kBFloat16: forward_impl<at::BFloat16>(q, k, scale, want_cols, row_lse, col_lse); break;
    default: TORCH_CHECK(false, "infcl native: unreachable dtype");
  }
  return {row_lse, col_lse};
}

at::Tensor backward_block(const at::Tensor& q_in, const at::Tensor& k_in, double scale, const at::Tensor& row_lse,
                          const at::Tensor& g_row, const std::optional<at::Tensor>& col_lse,
                          const std::optional<at::Tensor>& g_col, at::Tensor& dq, at::Tensor& dk) {
  check_features(q_in, k_in);
  const auto acc = acc_type(q_in.scalar_type());
  const int64_t bq = q_in.size(0), bk = k_in.size(0);
  TORCH_CHECK(col_lse.has_value() == g_col.has_value(), "infcl native: col_lse and g_col go together");
  TORCH_CHECK(dq.scalar_type() == acc && dk.scalar_type() == acc, "infcl native: dq and dk must be ", acc);
  TORCH_CHECK(dq.sizes() == q_in.sizes() && dk.sizes() == k_in.sizes(), "infcl native: dq ", dq.sizes(),
              " / dk ", dk.sizes(), " must match q ", q_in.sizes(), " / k ", k_in.sizes());
  at::Tensor q = prepared(q_in), k = prepared(k_in);
  at::Tensor lr = vector_arg(row_lse, bq, acc, "row_lse"), gr = vector_arg(g_row, bq, acc, "g_row");
  at::Tensor lc, gc;
  if (col_lse.has_value()) {
    lc = vector_arg(*col_lse, bk, acc, "col_lse");
    gc = vector_arg(*g_col, bk, acc, "g_col");
  }
  // Accumulate into contiguous buffers; copy back only when the caller's dq / dk are strided.
  at::Tensor dq_c = dq.is_contiguous() ? dq : dq.contiguous();
  at::Tensor dk_c = dk.is_contiguous() ? dk : dk.contiguous();
  at::Tensor dscale = at::zeros({2}, at::TensorOptions().dtype(at::kDouble));
  switch (q.scalar_type()) {
    case at::kFloat: backward_impl<float>(q, k, scale, lr, gr, lc, gc, dq_c, dk_c, dscale); break;
    case at::kDouble: backward_impl<double>(q, k, scale, lr, gr, lc, gc, dq_c, dk_c, dscale); break;
    case at::kBFloat16: backward_impl<at::BFloat16>(q, k, scale, lr, gr, lc, gc, dq_c, dk_c, dscale); break;
    default: TORCH_CHECK(false, "infcl native: unreachable dtype");
  }
  if (!dq.is_same(dq_c)) dq.copy_(dq_c);
  if (!dk.is_same(dk_c)) dk.copy_(dk_c);
  return dscale.to(acc);
}

bool bf16_gemm_available() { return has_bf16_gemm(); }

}  // namespace

TORCH_LIBRARY(infcl, m) {
  m.def("forward_block(Tensor q, Tensor k, float scale, bool want_cols) -> (Tensor, Tensor)");
  m.def(
      "backward_block(Tensor q, Tensor k, float scale, Tensor row_lse, Tensor g_row, Tensor? col_lse, "
      "Tensor? g_col, Tensor(a!) dq, Tensor(b!) dk) -> Tensor");
  m.def("bf16_gemm_available() -> bool", &bf16_gemm_available);
}

TORCH_LIBRARY_IMPL(infcl, CPU, m) {
  m.impl("forward_block", &forward_block);
  m.impl("backward_block", &backward_block);
}

}  // namespace infcl
