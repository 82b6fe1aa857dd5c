// The gradient comparison of a check case as a stream (SPEC §5 "Scale"): the candidate hands over
// its gradient a block of rows at a time (GradSink), and each row is compared at once with the
// oracle's row, computed on the fly from the row's logits and the oracle's per-row lse and
// coefficient. Neither a [rows, vocab] float64 truth nor the candidate's whole gradient ever
// exists: memory is one block plus a row per core.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/batch.h"
#include "core/candidate_result.h"
#include "oracle/check/compare.h"
#include "oracle/check/loss.h"
#include "oracle/math/row_math.h"

namespace lossguard::oracle {

// A bound on one gradient element's error, |got - w| with w = c (p - onehot) from logits (p =
// softmax, c the token's weight) or w = c times the per-token derivative:
//   atol + |c| atol_per_weight + rtol |w| + |c| p (alpha_row + beta |log p|),
//   alpha_row = alpha + alpha_per_spread spread + alpha_per_log_sum log_sum + alpha_per_abs_lse
//   |lse|
// with the row's spread, log_sum and lse from the oracle (OracleLoss). The p terms apply to logits
// only. check.cpp derives the coefficients for each candidate's arithmetic.
struct ElementBound {
  double atol = 0.0, atol_per_weight = 0.0, rtol = 0.0;
  double alpha = 0.0, alpha_per_spread = 0.0, alpha_per_log_sum = 0.0, alpha_per_abs_lse = 0.0;
  double beta = 0.0;
};

struct GradStreamSettings {
  // An element passes within the smallest of these (one or two: the per-dtype default and the
  // bound derived from the candidate's arithmetic).
  std::vector<ElementBound> bounds;
  DType got_dtype = DType::kFloat32;                // the candidate's gradient dtype (its input's)
  const std::vector<uint8_t>* skip_rows = nullptr;  // rows not compared (ppo-clip boundary)
  std::function<void(int64_t rows_done)> progress;  // after each block
};

class GradStream {
 public:
  GradStream(const Batch& batch, const OracleLoss& want, GradStreamSettings settings);
  ~GradStream();
  GradStream(const GradStream&) = delete;
  GradStream& operator=(const GradStream&) = delete;

  // The sink to hand to the candidate (valid while this object lives).
  GradSink sink();
  // n rows of the candidate's gradient (each row once over the whole stream).
  void add(const int64_t* rows, int64_t n, const void* data);
  // Rows never delivered are compared as zeros (a trainer that never wrote them); then the
  // totals, the worst elements located by CP rank and chunk.
  GradComparison finish(const std::vector<int32_t>& row_rank, const std::vector<int8_t>& row_chunk);

 private:
  struct Part;
  // `raw`: the candidate's row in got_dtype; z and got: float64 scratch rows.
  void compare_row(Part& part, int64_t row, const std::byte* raw, std::vector<double>& z,
                   std::vector<double>& got) const;
  // A row with weight from logits (the hot path); `note` records a worst-element candidate.
  template <typename Note>
  void compare_logits(Part& part, int64_t row, const std::byte* raw, std::vector<double>& z,
                      std::vector<double>& got, const Note& note) const;
  const Batch& b_;
  const OracleLoss& want_;
  GradStreamSettings s_;
  int64_t cols_ = 1;
  std::vector<uint8_t> delivered_;
  int64_t rows_done_ = 0;
  std::vector<std::unique_ptr<Part>> parts_;
};

// The bound at one row.
ElementBoundRow bound_at_row(const ElementBound& b, double c, double spread, double log_sum,
                             double lse);

}  // namespace lossguard::oracle
