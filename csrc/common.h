// What the native kernels (softmax*.cpp: the softmax loss; infcl_siglip.cpp: the sigmoid loss; retrieval.cpp
// and topk.cpp: the ranks and the top-k) share: the tile sizes, the row-tile grid and its split over threads,
// the one BLAS thread guard, the tile GEMMs, the no-grad score walk, the bfloat16 GEMM routes, the one
// vectorizable exp, and the ops' accumulation dtype and gradient outputs. One copy of each, so every loss tiles, parallelizes, multiplies and rounds the same way.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

extern "C" {
// MKL's thread count for BLAS calls made by the calling thread (0: back to the global setting); weak:
// absent when torch's BLAS is not MKL. Returns the previous value.
int MKL_Set_Num_Threads_Local(int nthreads) __attribute__((weak));
// MKL's bf16 x bf16 -> fp32 GEMM, CBLAS LP64 signature; weak: absent when torch's BLAS is not MKL.
void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                            int ldc) __attribute__((weak));
}

namespace infcl {

// ---------------------------------------------------------------------------------------------
// Tiles.
//
// Tile of S: 256 query rows x 512 key columns of float32 = 512 KiB, which with its q and k panels stays
// inside one core's L2 (1 MiB on the AMD EPYC family 25 model 17, 2 MiB on Sapphire Rapids), while every
// product still has a reduction dimension (D, TILE_K or TILE_Q) long enough for BLAS's full rate. Measured
// at B=8192, D=512 on 2 cores (AMX Xeon, noisy VM): 512x512, 256x1024, 512x1024, 1024x1024 and
// 1024x2048 were no faster in float32 (all within the +-15% run-to-run noise) and 5-30% slower in
// bfloat16, whose small-tile MKL GEMMs are ~2x below its big-GEMM rate at every size tried.
constexpr int64_t TILE_Q = 256;
constexpr int64_t TILE_K = 512;
// Row tiles of a small block (see RowTiles): at least MIN_ROW_TILES of them, so that up to that many
// threads get work, each a multiple of ROW_TILE_ALIGN rows and never fewer: thinner products run far
// below BLAS's rate and cost more than the parallelism gains.
constexpr int64_t MIN_ROW_TILES = 8;
constexpr int64_t ROW_TILE_ALIGN = 32;

// The row tiles of a block: a grid fixed by Bq alone, never by the thread count, so that a forward and
// a backward multiply the same tiles by the same route whatever torch.get_num_threads() is in each pass
// (the backward then recomputes S bit for bit). Tiles are TILE_Q rows, or for a small block
// ceil(Bq / MIN_ROW_TILES) rounded up to ROW_TILE_ALIGN; only the last may be shorter.
struct RowTiles {
  int64_t rows, size, count;
  explicit RowTiles(int64_t bq)
      : rows(bq),
        size(std::clamp<int64_t>((bq + MIN_ROW_TILES * ROW_TILE_ALIGN - 1) / (MIN_ROW_TILES * ROW_TILE_ALIGN) *
                                     ROW_TILE_ALIGN,
                                 ROW_TILE_ALIGN, TILE_Q)),
        count((bq + size - 1) / size) {}
  int64_t begin(int64_t t) const { return t * size; }
  int64_t height(int64_t t) const { return std::min(size, rows - t * size); }
};

// Lanes: contiguous ranges of row tiles, at most one per thread. A lane's column results (dk partials,
// parameter sums) are merged in lane order, so they depend on the thread count, never on scheduling.
inline int64_t lane_count(const RowTiles& tiles) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles.count));
}

// First row tile of lane `lane` of `lanes`.
inline int64_t lane_start(const RowTiles& tiles, int64_t lanes, int64_t lane) { return tiles.count * lane / lanes; }

// ---------------------------------------------------------------------------------------------
// BLAS threads.
//
// Makes MKL run single-threaded on this thread for the guard's lifetime: every tile product runs inside
// a parallel region, one per thread. torch.set_num_threads() turns MKL's dynamic thread adjustment off,
// and MKL then partitions a product called from inside a parallel region for the full thread count,
// run by one thread: 7% slower forward (softmax, B=8192, D=512).
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

// ---------------------------------------------------------------------------------------------
// GEMM on row-major 2-D tiles: C[M,N] = alpha * op(A) @ op(B) + beta * C, op = transpose or not.
// float32 / float64 go through ATen (at::mm_out / addmm_, i.e. MKL or whatever BLAS torch uses);
// bfloat16 needs an fp32 output that at::mm cannot give on CPU, so it calls MKL's
// cblas_gemm_bf16bf16f32 when the torch build exports it (weak symbol: absent -> float32 path).

// MKL's CBLAS enums.
enum { kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112 };

inline bool has_bf16_gemm() { return cblas_gemm_bf16bf16f32 != nullptr; }

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

inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a,
                 int64_t lda, const at::BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_gemm_bf16bf16f32(kCblasRowMajor, ta ? kCblasTrans : kCblasNoTrans, tb ? kCblasTrans : kCblasNoTrans,
                         static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha,
                         reinterpret_cast<const uint16_t*>(a), static_cast<int>(lda),
                         reinterpret_cast<const uint16_t*>(b), static_cast<int>(ldb), beta, c,
                         static_cast<int>(ldc));
}

// float -> bfloat16 bits, round to nearest even, written so it vectorizes; NaN stays NaN.
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
}

// ---------------------------------------------------------------------------------------------
// The no-grad walk over S = q @ k.T (retrieval.cpp: the ranks' two passes; topk.cpp: the top-k), and
// the integer inputs of its ops.

// A block's operands in the accumulation dtype, contiguous.
template <typename T>
struct ScoreOperands {
  const T* q;
  const T* k;
  int64_t bq, bk, d;
};

// Calls visit(lane, i0, ni, j0, nj, scores) for every tile of every lane (rows: RowTiles, one lane per
// thread; columns: TILE_K), key tiles outer; scores(i0, ni, j0, nj) inside visit gives the tile [ni, nj]
// (rows of nj) in the lane's buffer: one single-threaded gemm() on the same operands for the same tile in
// every pass and at every thread count, so a tile is the same bits wherever it is formed.
template <typename T, typename Visit>
void for_each_score_tile(const ScoreOperands<T>& o, const RowTiles& tiles, int64_t lanes, Visit visit) {
  at::parallel_for(0, lanes, 1, [&](int64_t first, int64_t last) {
    const SingleThreadedBlas one_thread;
    const int64_t tk = std::min(TILE_K, o.bk);
    std::vector<T> buffer(tiles.size * tk);
    auto scores = [&](int64_t i0, int64_t ni, int64_t j0, int64_t nj) {
      gemm(false, true, ni, nj, o.d, T(1), o.q + i0 * o.d, o.d, o.k + j0 * o.d, o.d, T(0), buffer.data(), nj);
      return buffer.data();
    };
    for (int64_t lane = first; lane < last; ++lane) {
      for (int64_t j0 = 0; j0 < o.bk; j0 += tk) {
        const int64_t nj = std::min(tk, o.bk - j0);
        for (int64_t t = lane_start(tiles, lanes, lane); t < lane_start(tiles, lanes, lane + 1); ++t) {
          visit(lane, tiles.begin(t), tiles.height(t), j0, nj, scores);
        }
      }
    }
  });
}

// An index or id tensor as contiguous int64 (a copy only where it is not).
inline at::Tensor as_longs(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

// An optional index or id tensor's int64 data (kept alive in `keep`), or nullptr when absent.
inline const int64_t* optional_longs(const std::optional<at::Tensor>& ids, at::Tensor& keep) {
  if (!ids.has_value()) return nullptr;
  keep = as_longs(*ids);
  return keep.data_ptr<int64_t>();
}

// q [Bq, D] and k [Bk, D]: CPU tensors of one float dtype and one D; `op` names the caller in the error.
inline void check_score_operands(const at::Tensor& q, const at::Tensor& k, const char* op) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), op, ": q and k must be CPU tensors");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.size(1) == k.size(1), op, ": q ", q.sizes(), " and k ", k.sizes(),
              " must be [B, D] with one D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && at::isFloatingType(q.scalar_type()), op,
              ": q and k must share one float dtype");
}

// ---------------------------------------------------------------------------------------------
// bfloat16 x bfloat16 -> float32 tile products: which route a CPU takes.
//
// - Mkl: MKL's cblas_gemm_bf16bf16f32 (gemm() above), where the CPU has AMX-BF16: MKL runs it on the
//   AMX tiles (oneDNN's AMX brgemm was no faster there end to end, and shares the AMX state with MKL:
//   docs/benchmarks.md, "Native CPU kernel: tried and dropped").
// - Brgemm: oneDNN's bf16 batch-reduce GEMM microkernel (at::native::cpublas::brgemm, vdpbf16ps), where
//   the CPU has AVX512-BF16 but no AMX. MKL's bf16 GEMM runs there at its sgemm rate; 256 x 512 x 512
//   tile products on one thread of an AMD EPYC family 25 model 17: MKL bf16 ~60 GFLOP/s, MKL sgemm 60-70,
//   brgemm 160-170. Its B operand is taken in VNNI pairs (pack_row_pairs, pack_transposed_pairs).
// - None: neither (AVX2 only, AVX-512 without BF16, MKL's bf16 GEMM absent, oneDNN turned off): the
//   kernel computes on float32 copies of its inputs, which are exact.
// INFCL_BF16_GEMM = mkl | brgemm | float32 forces a route (the tests run every route the CPU can take; a
// route it cannot take is an error); unset or "auto" picks as above.
enum class Bf16Gemm { Mkl, Brgemm, None };

// The x86 features the routes depend on, from CPUID (leaf 7: Intel SDM vol. 2A; torch's own detection API
// has changed across the versions infcl supports), AVX-512 only where the OS saves its state (XCR0).
struct CpuFeatures {
  bool avx512_bf16 = false;
  bool amx = false;  // AMX-TILE or AMX-BF16
};

constexpr unsigned CPUID_OSXSAVE = 1u << 27;         // leaf 1, ECX: XGETBV usable
constexpr unsigned CPUID_AVX512F = 1u << 16;         // leaf 7 subleaf 0, EBX
constexpr unsigned CPUID_AMX_BF16 = 1u << 22;        // leaf 7 subleaf 0, EDX
constexpr unsigned CPUID_AMX_TILE = 1u << 24;        // leaf 7 subleaf 0, EDX
constexpr unsigned CPUID_AVX512_BF16 = 1u << 5;      // leaf 7 subleaf 1, EAX
constexpr unsigned XCR0_AVX512_STATE = 0xE6u;        // XMM, YMM, opmask, ZMM_Hi256, Hi16_ZMM state enabled

inline CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & CPUID_OSXSAVE)) return f;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_avx512 = (xcr0_lo & XCR0_AVX512_STATE) == XCR0_AVX512_STATE;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const unsigned max_subleaf = a;
  const bool avx512f = os_avx512 && (b & CPUID_AVX512F);
  f.amx = (d & (CPUID_AMX_BF16 | CPUID_AMX_TILE)) != 0;
  if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512_bf16 = avx512f && (a & CPUID_AVX512_BF16);
#endif
  return f;
}

inline const CpuFeatures& this_cpu() {
  static const CpuFeatures features = cpu_features();
  return features;
}

// Whether this torch's brgemm takes VNNI bf16 here: probed once on a 2 x 16 x 2 product (it throws where
// the oneDNN microkernel is not built in or is limited below AVX-512, e.g. by ONEDNN_MAX_CPU_ISA). Never
// on AMX CPUs: there oneDNN runs it on the AMX tiles, whose state the caller would have to request and
// release around MKL's own AMX use (docs/benchmarks.md, "Native CPU kernel: tried and dropped"), and MKL's
// route is as fast.
inline bool brgemm_bf16_works() {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
  if (!this_cpu().avx512_bf16 || this_cpu().amx || !at::globalContext().userEnabledMkldnn()) return false;
  static const bool works = [] {
    try {
      const at::BFloat16 a[4] = {1.0f, 2.0f, 3.0f, 4.0f};  // A [2, 2]
      at::BFloat16 b[2 * 16 * 2];                            // B [2, 16] in pairs: B[0, n] = 1, B[1, n] = n
      for (int n = 0; n < 16; ++n) b[2 * n] = 1.0f, b[2 * n + 1] = static_cast<float>(n);
      float c[2 * 16];
      at::native::cpublas::brgemm(2, 16, 2, 2, 16, 16, false, a, b, c, /*is_vnni=*/true);
      for (int n = 0; n < 16; ++n) {
        if (c[n] != 1.0f + 2.0f * n || c[16 + n] != 3.0f + 4.0f * n) return false;
      }
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works;
#else
  return false;  // this torch's CPUBlas has no bf16 brgemm
#endif
}

inline bool mkl_bf16_available() { return has_bf16_gemm(); }

inline Bf16Gemm bf16_gemm_route() {
  const char* env = std::getenv("INFCL_BF16_GEMM");
  const std::string forced = env ? env : "auto";
  if (forced == "mkl") {
    TORCH_CHECK(mkl_bf16_available(), "INFCL_BF16_GEMM=mkl: this torch's BLAS has no cblas_gemm_bf16bf16f32");
    return Bf16Gemm::Mkl;
  }
  if (forced == "brgemm") {
    TORCH_CHECK(brgemm_bf16_works(),
                "INFCL_BF16_GEMM=brgemm: needs AVX512-BF16 without AMX, oneDNN on, and its brgemm microkernel");
    return Bf16Gemm::Brgemm;
  }
  if (forced == "float32") return Bf16Gemm::None;
  TORCH_CHECK(forced == "auto", "INFCL_BF16_GEMM must be auto, mkl, brgemm or float32, got '", forced, "'");
  if (this_cpu().amx && mkl_bf16_available()) return Bf16Gemm::Mkl;
  if (brgemm_bf16_works()) return Bf16Gemm::Brgemm;
  return Bf16Gemm::None;
}

// VNNI pairs, the layout of brgemm's B operand: B [K, N] as ceil(K / 2) rows of N 32-bit words, word
// (p, n) holding B[2p, n] in its low half and B[2p + 1, n] in its high half (0 past the last row).
// From B row-major (rows of ld elements): rows 2p and 2p + 1 interleaved.
inline void pack_row_pairs(const at::BFloat16* b, int64_t ld, int64_t k, int64_t n, uint32_t* out) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(b);
  for (int64_t p = 0; p < (k + 1) / 2; ++p) {
    const uint16_t* lo = bits + 2 * p * ld;
    const uint16_t* hi = 2 * p + 1 < k ? lo + ld : nullptr;
    uint32_t* o = out + p * n;
    if (hi) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = uint32_t(lo[c]) | (uint32_t(hi[c]) << 16);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) o[c] = lo[c];
    }
  }
}

// From B = A.T, A row-major [N, K] (rows of ld elements, K even): word (p, n) is
// A's 32-bit word at (n, 2p), a transpose of 32-bit words.
inline void pack_transposed_pairs(const at::BFloat16* a, int64_t ld, int64_t n, int64_t k, uint32_t* out) {
  for (int64_t r = 0; r < n; ++r) {
    const at::BFloat16* row = a + r * ld;
    for (int64_t p = 0; p < k / 2; ++p) std::memcpy(out + p * n + r, row + 2 * p, sizeof(uint32_t));
  }
}

// C [m, n] = A [m, k] @ B (+ C when accumulate) in float32; A row-major bfloat16 (rows of lda elements,
// k even: pad with a zero column), B in VNNI pairs (rows of ldb words).
inline void brgemm_bf16(int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda, const uint32_t* b,
                        int64_t ldb, bool accumulate, float* c, int64_t ldc) {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, reinterpret_cast<const at::BFloat16*>(b), c,
                              /*is_vnni=*/true);
#else
  TORCH_CHECK(false, "infcl: brgemm_bf16 called where brgemm_bf16_works() is false");
#endif
}

inline int64_t round_up_even(int64_t n) { return n + (n & 1); }

// One key tile's bf16 products on the Brgemm route, shared by both kernels: set() packs k_j [nj, D] (rows
// of ld elements, D even: the inputs carry a zero column when it is odd) into VNNI pairs once per key
// tile, then per row tile
//   scores:   raw [ni, nj] = q_i @ k_j.T                  (B: k_j.T in pairs)
//   add_dq:   dq [ni, D] += dS [ni, nj] @ k_j             (B: k_j's row pairs; backward only)
//   add_dk_t: dk_t [D, nj] += q_i.T @ dS                  (A: q.T, B: dS's row pairs; backward only)
// with no alpha (brgemm has none: the caller folds its scale in elsewhere). dk is kept transposed so that
// no operand needs a transpose per tile. Every product runs over an even depth: dS carries a zero column
// when nj is odd (rows of ld_ds = round_up_even(nj) elements), q.T a zero column past an odd Bq, and the
// pairs a zero high half past an odd row count. The results depend on the shapes alone, never on the
// thread that runs them.
class BrgemmKeyTile {
 public:
  // rows: the largest row tile; tk: the largest key tile; backward: pack the gradients' operands too.
  BrgemmKeyTile(int64_t rows, int64_t tk, int64_t ld, int64_t d, bool backward)
      : ld_(ld), d_(d), k_t_pairs_(ld / 2 * tk), k_pairs_(backward ? round_up_even(tk) / 2 * d : 0),
        ds_pairs_(backward ? round_up_even(rows) / 2 * tk : 0) {}

  void set(const at::BFloat16* k_j, int64_t nj) {
    nj_ = nj;
    pack_transposed_pairs(k_j, ld_, nj, ld_, k_t_pairs_.data());
    if (!k_pairs_.empty()) pack_row_pairs(k_j, ld_, nj, d_, k_pairs_.data());
  }

  // q_i: [ni, ld] rows; raw: [ni, nj], rows of nj.
  void scores(const at::BFloat16* q_i, int64_t ni, float* raw) const {
    brgemm_bf16(ni, nj_, ld_, q_i, ld_, k_t_pairs_.data(), nj_, false, raw, nj_);
  }

  // ds: [ni, nj] rows of ld_ds (zero at column nj when nj is odd); dq: rows of ldq.
  void add_dq(const at::BFloat16* ds, int64_t ld_ds, int64_t ni, float* dq, int64_t ldq) const {
    brgemm_bf16(ni, d_, ld_ds, ds, ld_ds, k_pairs_.data(), d_, true, dq, ldq);
  }

  // q_t_i: q.T at the row tile's first column (rows of ld_t, zero past Bq); dk_t: dk.T at the key tile's
  // first column, rows of ld_dk_t. Packs dS's row pairs.
  void add_dk_t(const at::BFloat16* q_t_i, int64_t ld_t, const at::BFloat16* ds, int64_t ld_ds, int64_t ni,
                float* dk_t, int64_t ld_dk_t) {
    pack_row_pairs(ds, ld_ds, ni, nj_, ds_pairs_.data());
    brgemm_bf16(d_, nj_, round_up_even(ni), q_t_i, ld_t, ds_pairs_.data(), nj_, true, dk_t, ld_dk_t);
  }

 private:
  int64_t ld_, d_, nj_ = 0;
  std::vector<uint32_t> k_t_pairs_, k_pairs_, ds_pairs_;
};

// The bf16 GEMM route for inputs like q (bf16_gemm_route), or None: compute on float32 copies.
inline Bf16Gemm bf16_route(const at::Tensor& q) {
  if (q.scalar_type() != at::kBFloat16 || q.size(1) == 0) return Bf16Gemm::None;
  return bf16_gemm_route();
}

// The row length bf16 operands get on `route`: brgemm multiplies over an even depth.
inline int64_t bf16_row_length(Bf16Gemm route, int64_t d) {
  return route == Bf16Gemm::Brgemm ? round_up_even(d) : d;
}

// t [b, d] as a contiguous [b, ld] (ld >= d), zero past column d.
inline at::Tensor with_row_length(const at::Tensor& t, int64_t ld) {
  if (t.size(1) == ld) return t.contiguous();
  at::Tensor out = at::zeros({t.size(0), ld}, t.options());
  out.narrow(1, 0, t.size(1)).copy_(t);
  return out;
}

// q.T as [ld, round_up_even(bq)] (q: [bq, ld]), zero past column bq: add_dk_t's A operand.
inline at::Tensor transposed_pairs_operand(const at::Tensor& q) {
  at::Tensor q_t = at::zeros({q.size(1), round_up_even(q.size(0))}, q.options());
  q_t.narrow(1, 0, q.size(0)).copy_(q.t());
  return q_t;
}

// ---------------------------------------------------------------------------------------------
// exp.
//
// std::exp does not vectorize without -ffast-math (which would also drop NaN propagation), so float32
// uses exp_f32, written without a branch or a select for `#pragma omp simd` loops: x clamped to
// [EXP_LO, EXP_CLAMP_HI]; n = round(x / ln 2) by adding and subtracting 1.5 * 2^23 (under GCC's default
// -ftrapping-math neither std::floor / nearbyint nor a float -> int conversion vectorize as well);
// r = x - n ln 2 in [-ln2/2, ln2/2], exact thanks to the two-part ln 2; e^r by its Taylor polynomial to
// r^7 (truncation < 6e-9 relative); times 2^n = 2 * 2^(n - 1), written into the exponent field from the
// rounding's own bits.
// Accuracy against float64 exp, every float in [-86.98, 0]: max 0.94 ulp, 0.45% of results not correctly
// rounded (0.94 ulp over [0, 88.72] too). This is infcl_siglip.cpp's former polynomial and ln 2 split;
// the softmax kernel's former Cephes minimax polynomial with a 9-bit ln 2 split measured 1.02 ulp, 0.80%.
// Range: below -125.5 ln 2 (about -86.99) n - 1 is -127 and 2^(n - 1) is exactly +0, so the result is 0
// (the true value is under 1.7e-38, ~1.4 FLT_MIN: a term that adds nothing to any sum here, and a row
// whose negatives all lie that far below its maximum gets a loss of exactly 0); above log(FLT_MAX) the
// result overflows to +inf; NaN passes through both clamps and stays NaN. float64, the reference dtype,
// takes libm's exp.
constexpr float LOG2_E = 1.44269504088896341f;        // 1 / ln(2)
constexpr float LN2_HI = 0.693145751953125f;          // ln(2) to 16 bits: n * LN2_HI is exact for |n| < 2^8
constexpr float LN2_LO = 1.42860682030941723212e-6f;  // ln(2) - LN2_HI
constexpr float EXP_LO = -87.3365448f;                // log(FLT_MIN) = -126 ln 2: clamped here, n = -126 gives 0
constexpr float EXP_CLAMP_HI = 89.0f;                 // above log(FLT_MAX) = 88.72, n = 128: overflows to +inf
// 1.5 * 2^23: adding it to a float y (|y| < 2^22) rounds y to the nearest integer n and leaves n in the low
// mantissa bits.
constexpr float ROUND_TO_INT = 12582912.0f;

inline float exp_f32(float x) {
  // std::min / std::max return their first argument when it is NaN.
  const float xc = std::max(std::min(x, EXP_CLAMP_HI), EXP_LO);
  const float shifted = xc * LOG2_E + ROUND_TO_INT;
  const float n = shifted - ROUND_TO_INT;
  const float r = (xc - n * LN2_HI) - n * LN2_LO;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // The biased exponent of 2^(n - 1), n - 1 + 127 in [0, 254]; the shift drops ROUND_TO_INT's own bits.
  uint32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits + 126u) << 23;
  float half_two_n;
  std::memcpy(&half_two_n, &bits, sizeof half_two_n);
  return (p + p) * half_two_n;
}

inline float fast_exp(float x) { return exp_f32(x); }
inline double fast_exp(double x) { return std::exp(x); }

// ---------------------------------------------------------------------------------------------
// Op entry points.

// The dtype a kernel accumulates in and returns its statistics in: float64 for float64 inputs, else float32.
inline at::ScalarType accumulation_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// A backward op's dq and dk as its kernel accumulates into them: checked against q and k (dtype acc, the same
// shapes; `op` names the op in the error), and contiguous: the caller's tensors where they are, else copies
// that write_back() copies into the caller's.
class ContiguousGrads {
 public:
  ContiguousGrads(at::Tensor& dq, at::Tensor& dk, const at::Tensor& q, const at::Tensor& k, at::ScalarType acc,
                  const char* op)
      : dq_out_(dq), dk_out_(dk) {
    TORCH_CHECK(dq.scalar_type() == acc && dk.scalar_type() == acc, op, ": dq and dk must be ", acc);
    TORCH_CHECK(dq.sizes() == q.sizes() && dk.sizes() == k.sizes(), op, ": dq ", dq.sizes(), " / dk ", dk.sizes(),
                " must match q ", q.sizes(), " / k ", k.sizes());
    this->dq = dq.is_contiguous() ? dq : dq.contiguous();
    this->dk = dk.is_contiguous() ? dk : dk.contiguous();
  }
  void write_back() {
    if (!dq_out_.is_same(dq)) dq_out_.copy_(dq);
    if (!dk_out_.is_same(dk)) dk_out_.copy_(dk);
  }
  at::Tensor dq, dk;

 private:
  at::Tensor& dq_out_;
  at::Tensor& dk_out_;
};

}  // namespace infcl
