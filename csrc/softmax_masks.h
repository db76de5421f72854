// The softmax kernel's masks (infcl/masks.py: ids, multi_positive, a guide): which entries of a tile are
// its rows' positives P and which are left out of the rows' (and the columns') softmax, E. Formed per tile
// from O(B) data, never beyond the tile; read by the masked forward and backward alike.

#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "softmax_gemm.h"

namespace infcl {
namespace softmax {

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

// The tile's column of row i's positive, or -1 when it lies outside columns [j0, j0 + nj).
inline int64_t positive_in_tile(const int64_t* pos, int64_t i, int64_t j0, int64_t nj) {
  const int64_t c = pos[i] - j0;
  return (c >= 0 && c < nj) ? c : -1;
}

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

}  // namespace softmax
}  // namespace infcl
