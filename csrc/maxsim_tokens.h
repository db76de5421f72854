// The MaxSim kernel's token products (maxsim.cpp): the packed operands and the one register block that forms
// every (query token, document token) score.
//
// Every score is one chain of fused multiply-adds over the features in order, f = 0 .. D - 1, starting from 0,
// formed by token_block() below and nothing else: every query token sits in a full row block (zero rows pad
// the last) and every document token in a full column block (zero columns pad the last), so the one code path
// runs for every position. Exact copies of a token therefore score the same bits wherever they sit in a tile,
// in any tile, in either pass, and the lowest-index rule for equal maxima holds on every CPU (a BLAS GEMM may
// sum an edge column in another order than an inner one). It is also what makes the backward's recomputed
// scores the forward's bit for bit whatever the tiles or the thread count.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace infcl {
namespace maxsim {

// The register block: ROW_BLOCK query tokens x COL_VECTORS vectors of document tokens, one accumulator each,
// plus the COL_VECTORS loaded operands and one broadcast, within the register file: AVX-512 has 32 vector
// registers (8 x 2 accumulators), AVX2 16 (6 x 2), SSE 16 of half the width (4 x 2).
#if defined(__AVX512F__)
constexpr int SIMD_BYTES = 64;
constexpr int64_t ROW_BLOCK = 8;
#elif defined(__AVX__)
constexpr int SIMD_BYTES = 32;
constexpr int64_t ROW_BLOCK = 6;
#else
constexpr int SIMD_BYTES = 16;
constexpr int64_t ROW_BLOCK = 4;
#endif
constexpr int64_t COL_VECTORS = 2;
// Document tokens' products held per row block before their maxima are taken (the strip): a column chunk of
// the packed documents of about this many bytes stays in a core's L2 (1 MiB on the AMD EPYC family 25 model
// 17) while every row block of a query group passes over it.
constexpr int64_t CHUNK_BYTES = 256 * 1024;

template <typename T>
struct Simd;
template <>
struct Simd<float> {
  typedef float vec __attribute__((vector_size(SIMD_BYTES)));
};
template <>
struct Simd<double> {
  typedef double vec __attribute__((vector_size(SIMD_BYTES)));
};

template <typename T>
constexpr int64_t LANES = SIMD_BYTES / sizeof(T);
// Document tokens per packed column block.
template <typename T>
constexpr int64_t COL_BLOCK = COL_VECTORS * LANES<T>;

// c [ROW_BLOCK, COL_BLOCK] (rows of ldc) = a [ROW_BLOCK, d] (rows of d) @ b, b one packed column block
// ([d][COL_BLOCK]: feature f of the block's tokens at b + f * COL_BLOCK). Each entry: acc = 0, then
// acc = fma(a[r, f], b[f, c], acc) for f = 0 .. d - 1 (`a * b + acc` on vectors is contracted to an FMA).
template <typename T>
inline void token_block(const T* __restrict a, const T* __restrict b, int64_t d, T* __restrict c, int64_t ldc) {
  using V = typename Simd<T>::vec;
  V acc[ROW_BLOCK][COL_VECTORS];
  for (int64_t r = 0; r < ROW_BLOCK; ++r) {
    for (int64_t v = 0; v < COL_VECTORS; ++v) acc[r][v] = V{};
  }
  for (int64_t f = 0; f < d; ++f) {
    V bv[COL_VECTORS];
    for (int64_t v = 0; v < COL_VECTORS; ++v) std::memcpy(&bv[v], b + f * COL_BLOCK<T> + v * LANES<T>, sizeof(V));
    for (int64_t r = 0; r < ROW_BLOCK; ++r) {
      const V ar = a[r * d + f] - V{};  // a broadcast (x - 0 is x, -0 included)
      for (int64_t v = 0; v < COL_VECTORS; ++v) acc[r][v] = ar * bv[v] + acc[r][v];
    }
  }
  for (int64_t r = 0; r < ROW_BLOCK; ++r) {
    for (int64_t v = 0; v < COL_VECTORS; ++v) std::memcpy(c + r * ldc + v * LANES<T>, &acc[r][v], sizeof(V));
  }
}

// Token embeddings [B, L, D] as the kernel reads them, any strides and any float dtype In; a token's row in
// the accumulation type T: in place where it already is one (T, unit feature stride), else widened into
// the caller's scratch (bfloat16 and float16 to float32: exact).
template <typename In, typename T>
class TokenRows {
 public:
  explicit TokenRows(const at::Tensor& t)
      : base_(t.data_ptr<In>()), stride_b_(t.stride(0)), stride_l_(t.stride(1)), stride_f_(t.stride(2)),
        d_(t.size(2)) {}

  const T* row(int64_t b, int64_t l, T* scratch) const {
    const In* p = base_ + b * stride_b_ + l * stride_l_;
    if constexpr (std::is_same<In, T>::value) {
      if (stride_f_ == 1) return p;
    }
    for (int64_t f = 0; f < d_; ++f) scratch[f] = static_cast<T>(p[f * stride_f_]);
    return scratch;
  }

 private:
  const In* base_;
  int64_t stride_b_, stride_l_, stride_f_, d_;
};

// A tile of documents packed for token_block: their real tokens only (a masked token is never read), in
// order, document after document, as column blocks [blocks][d][COL_BLOCK] with zero columns after the last.
// Document j's tokens are columns [start[j], start[j + 1]); token[c] is column c's index in its document.
template <typename T>
struct DocumentPanel {
  int64_t d = 0, columns = 0, blocks = 0;
  std::vector<int64_t> start;
  std::vector<int32_t> token;
  std::vector<T> packed;

  template <typename In>
  void pack(const at::Tensor& docs, const uint8_t* real) {
    const int64_t nk = docs.size(0), lk = docs.size(1);
    d = docs.size(2);
    start.assign(nk + 1, 0);
    for (int64_t j = 0; j < nk; ++j) {
      int64_t n = lk;
      if (real) n = std::count_if(real + j * lk, real + (j + 1) * lk, [](uint8_t r) { return r != 0; });
      start[j + 1] = start[j] + n;
    }
    columns = start[nk];
    blocks = (columns + COL_BLOCK<T> - 1) / COL_BLOCK<T>;
    token.assign(columns, 0);
    packed.assign(blocks * d * COL_BLOCK<T>, T(0));
    const TokenRows<In, T> rows(docs);
    std::vector<T> scratch(d);
    for (int64_t j = 0; j < nk; ++j) {
      int64_t c = start[j];
      for (int64_t u = 0; u < lk; ++u) {
        if (real && !real[j * lk + u]) continue;
        const T* x = rows.row(j, u, scratch.data());
        T* out = packed.data() + (c / COL_BLOCK<T>)*d * COL_BLOCK<T> + c % COL_BLOCK<T>;
        for (int64_t f = 0; f < d; ++f) out[f * COL_BLOCK<T>] = x[f];
        token[c++] = static_cast<int32_t>(u);
      }
    }
  }

  const T* block(int64_t b) const { return packed.data() + b * d * COL_BLOCK<T>; }
};

}  // namespace maxsim
}  // namespace infcl
