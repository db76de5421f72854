// The MaxSim (late-interaction) loss's native kernel: the two ops behind infcl/backends/native/maxsim.py, which
// runs the softmax over their score tiles with the torch tiles' own functions (infcl/lse.py's merge).
//
// maxsim_scores(q [Bq, Lq, D], docs [nk, Lk, D], q_weight [Bq, Lq], docs_mask [nk, Lk]?, with_winners)
//   -> R [Bq, nk], winners [Bq, Lq, nk] int32 (or empty)
//   R[i, j] = sum_t w[i, t] * max_{u real} q[i, t] . docs[j, u] over the weighted tokens (w != 0) in order of t;
//   -inf where document j has no real token and query i a weighted one, 0 where query i has none. With
//   with_winners, winners[i, t, j] is the lowest u among the real tokens whose score equals the max (the first
//   NaN where the max is NaN), -1 for a token of weight 0 or a document with no real token.
// maxsim_route_(q, docs, winners, coef [Bq, nk], q_weight, dq, dk): the routing of each max as the sparse matrix
//   P[(i, t), (j, u*)] = coef[i, j] * w[i, t]: dq += P @ docs (threads own queries; each dq row sums over j in
//   order) and dk += P.T @ q (threads own documents; each dk row sums over (i, t) in order): no atomics, and
//   the same bits at any thread count.
//
// Tiling: the documents are packed once per call (maxsim_tokens.h: real tokens only); threads take groups of
// queries (and, when the groups are fewer than the threads, ranges of the documents), whose weighted tokens are
// packed into row blocks, and pass the row blocks over one L2-sized column chunk of the documents at a time,
// folding each strip of scores into the running maxima per (token, document).

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
#include "maxsim_tokens.h"

namespace infcl {
namespace maxsim {
namespace {

// Weighted query tokens per query group (a thread's unit of work): the group's packed rows, ~128 KiB in float32
// at D = 128, stay in L2 beside the documents' column chunk.
constexpr int64_t GROUP_ROWS = 256;

// One strip row's scores over its columns [lo, hi) (strip-relative): the max, NaN if any is NaN.
template <typename T>
inline T segment_max(const T* s, int64_t lo, int64_t hi) {
  T m = -std::numeric_limits<T>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t c = lo; c < hi; ++c) {
    m = s[c] > m ? s[c] : m;
    nan |= s[c] != s[c];
  }
  return nan ? std::numeric_limits<T>::quiet_NaN() : m;
}

// The first column in [lo, hi) holding m (the first NaN where m is NaN).
template <typename T>
inline int64_t first_of(const T* s, int64_t lo, int64_t hi, T m) {
  const bool nan = m != m;
  for (int64_t c = lo; c < hi; ++c) {
    if (nan ? s[c] != s[c] : s[c] == m) return c;
  }
  return hi;  // unreachable: m is one of the segment's values
}

// One thread's query groups against the call's documents.
template <typename In, typename T>
class ScoreWorker {
 public:
  ScoreWorker(const at::Tensor& q, const T* weight, const DocumentPanel<T>& panel, int64_t nk, int64_t group,
              bool with_winners)
      : q_(q), weight_(weight), panel_(panel), lq_(q.size(1)), d_(q.size(2)), nk_(nk), with_winners_(with_winners),
        chunk_(std::max<int64_t>(1, CHUNK_BYTES / (d_ * COL_BLOCK<T> * int64_t(sizeof(T)))) * COL_BLOCK<T>),
        rows_cap_((group * lq_ + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK), a_(rows_cap_ * d_), strip_(ROW_BLOCK * chunk_),
        maxima_(group * lq_ * nk), winner_(with_winners ? group * lq_ * nk : 0), row_query_(group * lq_),
        row_token_(group * lq_) {}

  // Queries [i0, i1) against documents [j0, j1): their scores into raw [Bq, nk] and (with_winners) their winners
  // [Bq, Lq, nk]. The column blocks the documents touch are formed whole (a block two calls share is formed by
  // each, the same bits), so the results do not depend on how the documents are split.
  void run(int64_t i0, int64_t i1, int64_t j0, int64_t j1, T* raw, int32_t* winners) {
    const int64_t m = pack_rows(i0, i1);
    const int64_t padded = (m + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    std::fill(maxima_.begin(), maxima_.begin() + m * nk_, -std::numeric_limits<T>::infinity());
    if (with_winners_) std::fill(winner_.begin(), winner_.begin() + m * nk_, -1);
    const int64_t first = panel_.start[j0] / COL_BLOCK<T> * COL_BLOCK<T>;
    const int64_t last = (panel_.start[j1] + COL_BLOCK<T> - 1) / COL_BLOCK<T> * COL_BLOCK<T>;
    for (int64_t c0 = first; c0 < last; c0 += chunk_) {
      const int64_t c1 = std::min(last, c0 + chunk_);
      for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK) {
        for (int64_t c = c0; c < c1; c += COL_BLOCK<T>) {
          token_block(a_.data() + r0 * d_, panel_.block(c / COL_BLOCK<T>), d_, strip_.data() + (c - c0), chunk_);
        }
        for (int64_t r = 0; r < std::min(ROW_BLOCK, m - r0); ++r) {
          fold(strip_.data() + r * chunk_, c0, c1, j0, j1, r0 + r);
        }
      }
    }
    write(i0, i1, j0, j1, m, raw, winners);
  }

 private:
  // The weighted tokens of queries [i0, i1) as rows of a_ (zero rows up to the row block); returns their count.
  int64_t pack_rows(int64_t i0, int64_t i1) {
    const TokenRows<In, T> rows(q_);
    int64_t m = 0;
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t t = 0; t < lq_; ++t) {
        if (weight_[i * lq_ + t] == T(0)) continue;
        T* out = a_.data() + m * d_;
        const T* x = rows.row(i, t, out);
        if (x != out) std::copy(x, x + d_, out);
        row_query_[m] = i, row_token_[m] = t, ++m;
      }
    }
    std::fill(a_.begin() + m * d_, a_.begin() + (m + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK * d_, T(0));
    return m;
  }

  // A strip row (columns [c0, c1) of the panel) into row `row`'s running maxima of the documents of [j0, j1) it
  // covers; a max replaces the running one only when greater (or the first NaN), so the lowest index wins a tie.
  void fold(const T* s, int64_t c0, int64_t c1, int64_t j0, int64_t j1, int64_t row) {
    const int64_t end = std::min(c1, panel_.columns);
    const std::vector<int64_t>& start = panel_.start;
    int64_t j = std::max<int64_t>(j0, std::upper_bound(start.begin(), start.end(), c0) - start.begin() - 1);
    T* maxima = maxima_.data() + row * nk_;
    int32_t* winner = with_winners_ ? winner_.data() + row * nk_ : nullptr;
    for (; j < j1 && start[j] < end; ++j) {
      const int64_t lo = std::max(start[j], c0) - c0, hi = std::min(start[j + 1], end) - c0;
      if (lo >= hi) continue;
      const T m = segment_max(s, lo, hi);
      const T cur = maxima[j];
      if (!winner) {
        maxima[j] = (m > cur || m != m) && cur == cur ? m : cur;
      } else if (winner[j] < 0 || m > cur || (m != m && cur == cur)) {
        maxima[j] = m;
        winner[j] = panel_.token[c0 + first_of(s, lo, hi, m)];
      }
    }
  }

  // R[i, j] = sum over query i's weighted tokens (in order) of w * max, j in [j0, j1); its winners by token.
  void write(int64_t i0, int64_t i1, int64_t j0, int64_t j1, int64_t m, T* raw, int32_t* winners) const {
    int64_t row = 0;
    for (int64_t i = i0; i < i1; ++i) {
      T* out = raw + i * nk_;
      std::fill(out + j0, out + j1, T(0));
      for (; row < m && row_query_[row] == i; ++row) {
        const T w = weight_[i * lq_ + row_token_[row]];
        const T* mx = maxima_.data() + row * nk_;
        for (int64_t j = j0; j < j1; ++j) out[j] += w * mx[j];
        if (winners) {
          std::copy(winner_.data() + row * nk_ + j0, winner_.data() + row * nk_ + j1,
                    winners + (i * lq_ + row_token_[row]) * nk_ + j0);
        }
      }
    }
  }

  const at::Tensor& q_;
  const T* weight_;
  const DocumentPanel<T>& panel_;
  int64_t lq_, d_, nk_;
  bool with_winners_;
  int64_t chunk_, rows_cap_;
  std::vector<T> a_, strip_, maxima_;
  std::vector<int32_t> winner_;
  std::vector<int64_t> row_query_, row_token_;
};

void check_tokens(const at::Tensor& q, const at::Tensor& docs, const at::Tensor& q_weight, const char* op) {
  TORCH_CHECK(q.device().is_cpu() && docs.device().is_cpu(), op, ": q and docs must be CPU tensors");
  TORCH_CHECK(q.dim() == 3 && docs.dim() == 3 && q.size(2) == docs.size(2), op, ": q ", q.sizes(), " and docs ",
              docs.sizes(), " must be [B, L, D] with one D");
  TORCH_CHECK(q.scalar_type() == docs.scalar_type() && at::isFloatingType(q.scalar_type()), op,
              ": q and docs must share one float dtype");
  TORCH_CHECK(q_weight.sizes() == q.sizes().slice(0, 2) &&
                  q_weight.scalar_type() == accumulation_type(q.scalar_type()),
              op, ": q_weight must be [Bq, Lq] in the accumulation dtype, got ", q_weight.sizes(), " ",
              q_weight.scalar_type());
}

template <typename In>
void scores_impl(const at::Tensor& q, const at::Tensor& docs, const at::Tensor& weight, const uint8_t* real,
                 at::Tensor& raw, at::Tensor& winners) {
  using T = std::conditional_t<std::is_same<In, double>::value, double, float>;
  const int64_t bq = q.size(0), lq = q.size(1), nk = docs.size(0);
  DocumentPanel<T> panel;
  panel.template pack<In>(docs, real);
  const int64_t group = std::max<int64_t>(1, GROUP_ROWS / lq);
  const int64_t groups = (bq + group - 1) / group;
  // Fewer query groups than threads (a small block): the documents are split too, so that every thread has work.
  const int64_t parts = std::clamp<int64_t>((at::get_num_threads() + groups - 1) / groups, 1, std::max<int64_t>(1, nk));
  const T* w = weight.data_ptr<T>();
  T* out = raw.data_ptr<T>();
  int32_t* win = winners.numel() ? winners.data_ptr<int32_t>() : nullptr;
  at::parallel_for(0, groups * parts, 1, [&](int64_t u0, int64_t u1) {
    ScoreWorker<In, T> work(q, w, panel, nk, group, win != nullptr);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / parts, p = u % parts;
      work.run(g * group, std::min(bq, (g + 1) * group), nk * p / parts, nk * (p + 1) / parts, out, win);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> maxsim_scores(const at::Tensor& q, const at::Tensor& docs,
                                                 const at::Tensor& q_weight,
                                                 const std::optional<at::Tensor>& docs_mask, bool with_winners) {
  const char* op = "infcl::maxsim_scores";
  check_tokens(q, docs, q_weight, op);
  const at::ScalarType acc = accumulation_type(q.scalar_type());
  const int64_t bq = q.size(0), lq = q.size(1), nk = docs.size(0);
  at::Tensor real;
  if (docs_mask.has_value()) {
    TORCH_CHECK(docs_mask->sizes() == docs.sizes().slice(0, 2), op, ": docs_mask ", docs_mask->sizes(),
                " must be [nk, Lk] of docs ", docs.sizes());
    real = docs_mask->ne(0).to(at::kByte).contiguous();
  }
  const at::Tensor weight = q_weight.contiguous();
  at::Tensor raw = at::empty({bq, nk}, q.options().dtype(acc));
  at::Tensor winners = at::empty({with_winners ? bq : 0, lq, nk}, q.options().dtype(at::kInt));
  if (with_winners) winners.fill_(-1);
  const uint8_t* r = real.defined() ? real.data_ptr<uint8_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "maxsim_scores", [&] {
    scores_impl<scalar_t>(q, docs, weight, r, raw, winners);
  });
  return {raw, winners};
}

template <typename In>
void route_impl(const at::Tensor& q, const at::Tensor& docs, const int32_t* win, const at::Tensor& coef_t,
                const at::Tensor& weight_t, at::Tensor& dq_t, at::Tensor& dk_t) {
  using T = std::conditional_t<std::is_same<In, double>::value, double, float>;
  const int64_t bq = q.size(0), lq = q.size(1), d = q.size(2), nk = docs.size(0), lk = docs.size(1);
  const T* coef = coef_t.data_ptr<T>();
  const T* weight = weight_t.data_ptr<T>();
  T* dq = dq_t.data_ptr<T>();
  T* dk = dk_t.data_ptr<T>();
  const TokenRows<In, T> q_rows(q), doc_rows(docs);
  // dq[i, t] += sum_j coef[i, j] w[i, t] docs[j, u*], j in order.
  at::parallel_for(0, bq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<T> scratch(d);
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t t = 0; t < lq; ++t) {
        const T w = weight[i * lq + t];
        if (w == T(0)) continue;
        const int32_t* u = win + (i * lq + t) * nk;
        T* out = dq + (i * lq + t) * d;
        for (int64_t j = 0; j < nk; ++j) {
          if (u[j] < 0) continue;
          const T c = coef[i * nk + j] * w;
          const T* x = doc_rows.row(j, u[j], scratch.data());
#pragma omp simd
          for (int64_t f = 0; f < d; ++f) out[f] += c * x[f];
        }
      }
    }
  });
  // dk[j, u] += sum over (i, t) winning at u of coef[i, j] w[i, t] q[i, t], (i, t) in order.
  at::parallel_for(0, nk, 1, [&](int64_t j0, int64_t j1) {
    std::vector<T> scratch(d);
    for (int64_t i = 0; i < bq; ++i) {
      for (int64_t t = 0; t < lq; ++t) {
        const T w = weight[i * lq + t];
        if (w == T(0)) continue;
        const int32_t* u = win + (i * lq + t) * nk;
        const T* x = nullptr;
        for (int64_t j = j0; j < j1; ++j) {
          if (u[j] < 0) continue;
          if (!x) x = q_rows.row(i, t, scratch.data());
          const T c = coef[i * nk + j] * w;
          T* out = dk + (j * lk + u[j]) * d;
#pragma omp simd
          for (int64_t f = 0; f < d; ++f) out[f] += c * x[f];
        }
      }
    }
  });
}

void maxsim_route_(const at::Tensor& q, const at::Tensor& docs, const at::Tensor& winners, const at::Tensor& coef,
                   const at::Tensor& q_weight, at::Tensor& dq, at::Tensor& dk) {
  const char* op = "infcl::maxsim_route_";
  check_tokens(q, docs, q_weight, op);
  const at::ScalarType acc = accumulation_type(q.scalar_type());
  const int64_t bq = q.size(0), lq = q.size(1), nk = docs.size(0);
  TORCH_CHECK(winners.dim() == 3 && winners.size(0) == bq && winners.size(1) == lq && winners.size(2) == nk &&
                  winners.scalar_type() == at::kInt,
              op, ": winners must be int32 [Bq, Lq, nk], got ", winners.sizes(), " ", winners.scalar_type());
  TORCH_CHECK(coef.dim() == 2 && coef.size(0) == bq && coef.size(1) == nk && coef.scalar_type() == acc, op,
              ": coef must be [Bq, nk] in the accumulation dtype, got ", coef.sizes(), " ", coef.scalar_type());
  ContiguousGrads grads(dq, dk, q, docs, acc, op);
  const at::Tensor win = winners.contiguous(), c = coef.contiguous(), w = q_weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "maxsim_route_", [&] {
    route_impl<scalar_t>(q, docs, win.data_ptr<int32_t>(), c, w, grads.dq, grads.dk);
  });
  grads.write_back();
}

}  // namespace

TORCH_LIBRARY_IMPL(infcl, CPU, m) { m.impl("maxsim_scores", &maxsim_scores).impl("maxsim_route_", &maxsim_route_); }

}  // namespace maxsim
}  // namespace infcl
