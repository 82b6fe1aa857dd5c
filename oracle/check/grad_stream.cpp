// Streaming gradient comparison (grad_stream.h).
#include "oracle/check/grad_stream.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "oracle/math/exp64.h"

namespace lossguard::oracle {

ElementBoundRow bound_at_row(const ElementBound& b, double c, double spread, double log_sum,
                             double lse) {
  ElementBoundRow r;
  r.atol = b.atol + std::fabs(c) * b.atol_per_weight;
  r.rtol = b.rtol;
  r.alpha = b.alpha + b.alpha_per_spread * spread + b.alpha_per_log_sum * std::fabs(log_sum) +
            b.alpha_per_abs_lse * std::fabs(lse);
  r.beta = b.beta;
  return r;
}

struct GradStream::Part {
  GradComparison c;
  int64_t worst_row = -1, worst_col = -1, worst_rel_row = -1, worst_rel_col = -1;
  double worst_got = 0, worst_want = 0, worst_rel_got = 0, worst_rel_want = 0;
};

namespace {

bool worse(double d, double best) { return d > best || (std::isnan(d) && !std::isnan(best)); }

}  // namespace

GradStream::GradStream(const Batch& b, const OracleLoss& want, GradStreamSettings s)
    : b_(b), want_(want), s_(std::move(s)) {
  cols_ = want.grad_cols;
  delivered_.assign(static_cast<std::size_t>(b.num_response_tokens()), 0);
  if (s_.bounds.empty()) s_.bounds.push_back({});
  if (s_.bounds.size() > 2) throw std::logic_error("GradStream: at most two element bounds");
  if (want.input == LossInput::kLogits && !want.grad_materialised &&
      b.logits->dtype != s_.got_dtype) {
    throw std::logic_error("GradStream: a logits gradient comes in the logits' dtype");
  }
  const int64_t threads =
      std::clamp<int64_t>(static_cast<int64_t>(std::thread::hardware_concurrency()), 1, 16);
  for (int64_t t = 0; t < threads; ++t) parts_.push_back(std::make_unique<Part>());
}

GradStream::~GradStream() = default;

GradSink GradStream::sink() {
  return GradSink{this, [](void* self, const int64_t* rows, int64_t n, const void* data) {
                    static_cast<GradStream*>(self)->add(rows, n, data);
                  }};
}

void GradStream::compare_row(Part& part, int64_t row, const std::byte* raw, std::vector<double>& z,
                             std::vector<double>& got_row) const {
  GradComparison& c = part.c;
  const double* got = got_row.data();
  if (s_.skip_rows != nullptr && (*s_.skip_rows)[row]) {
    ++c.not_compared;
    return;
  }
  const bool masked = b_.loss_mask[row] == 0;
  const double coeff = want_.coeff[row];
  c.checked += cols_;
  auto note = [&](int64_t col, double g, double w) {
    const double diff = std::fabs(g - w);
    const double rel = w != 0.0 ? diff / std::fabs(w) : (diff == 0.0 ? 0.0 : INFINITY);
    if (worse(diff, c.max_abs_diff) || part.worst_row < 0) {
      c.max_abs_diff = diff;
      part.worst_row = row;
      part.worst_col = col;
      part.worst_got = g;
      part.worst_want = w;
    }
    if (std::isfinite(rel) && (rel > c.max_rel_diff || part.worst_rel_row < 0)) {
      c.max_rel_diff = rel;
      part.worst_rel_row = row;
      part.worst_rel_col = col;
      part.worst_rel_got = g;
      part.worst_rel_want = w;
    }
  };
  const bool from_logits = want_.input == LossInput::kLogits && !want_.grad_materialised;
  if (from_logits && !masked && coeff != 0.0) {
    compare_logits(part, row, raw, z, got_row, note);
    return;
  }
  row_to_f64(raw, s_.got_dtype, cols_, got_row.data());
  if (from_logits) {
    // The truth is 0 (masked, or a zero weight): every element within the smallest absolute
    // slack, masked rows exactly 0.
    double tol = INFINITY;
    for (const ElementBound& e : s_.bounds)
      tol = std::min(tol, e.atol + std::fabs(coeff) * e.atol_per_weight);
    int64_t nonzero = 0;
    const RowComparison z0 = compare_zero_row(got, cols_, tol, &nonzero);
    c.mismatched += z0.mismatched;
    if (masked) c.masked_nonzero += nonzero;
    if (worse(z0.max_abs_diff, c.max_abs_diff) || part.worst_row < 0) {
      for (int64_t k = 0; k < cols_; ++k) {
        if (worse(std::fabs(got[k]), c.max_abs_diff) || part.worst_row < 0) note(k, got[k], 0.0);
      }
    }
    return;
  }
  // A materialised truth (per-token inputs; logits of small batches): element by element. For
  // logits the p terms of the bound use p recovered from w.
  const bool logits = want_.input == LossInput::kLogits && coeff != 0.0;
  std::vector<ElementBoundRow> rb;
  for (const ElementBound& e : s_.bounds) {
    rb.push_back(
        logits ? bound_at_row(e, coeff, want_.spread[row], want_.log_sum[row], want_.lse[row])
               : ElementBoundRow{e.atol + std::fabs(coeff) * e.atol_per_weight, e.rtol, 0.0, 0.0});
  }
  for (int64_t k = 0; k < cols_; ++k) {
    const double w = want_.grad[row * cols_ + k];
    const double g = got[k];
    const double diff = std::fabs(g - w);
    double p = 0.0;
    if (logits) p = k == want_.target[row] ? 1.0 + w / coeff : w / coeff;
    const double lp = p > 0.0 ? -std::log(p) : 0.0;
    double tol = INFINITY;
    for (const ElementBoundRow& b : rb)
      tol = std::min(tol,
                     element_tolerance(b, std::fabs(coeff), std::fabs(w), p > 0.0 ? p : 0.0, lp));
    if (masked && g != 0.0) ++c.masked_nonzero;
    if (!(diff <= tol)) ++c.mismatched;
    if (worse(diff, c.max_abs_diff) || part.worst_row < 0 ||
        (w != 0.0 && diff / std::fabs(w) > c.max_rel_diff))
      note(cols_ > 1 ? k : -1, g, w);
  }
}

template <typename Note>
void GradStream::compare_logits(Part& part, int64_t row, const std::byte* raw,
                                std::vector<double>& z, std::vector<double>& got,
                                const Note& note) const {
  // w_k = c (exp(z_k - lse) - [k == y]), compared in the vectorised row loop on the rows as
  // stored, except for the target, compared here; float64 copies of the two rows are made only
  // for a row that holds a new worst element.
  GradComparison& c = part.c;
  const double coeff = want_.coeff[row], lse = want_.lse[row];
  const int64_t y = want_.target[row];
  const std::byte* zraw =
      b_.logits->data + static_cast<std::size_t>(row * cols_) * dtype_size_bytes(b_.logits->dtype);
  const int nb = static_cast<int>(s_.bounds.size());
  ElementBoundRow rb[2];
  for (int j = 0; j < nb; ++j)
    rb[j] = bound_at_row(s_.bounds[static_cast<std::size_t>(j)], coeff, want_.spread[row],
                         want_.log_sum[row], lse);
  // The float32 screen (row_math.h) against this part's worst so far: a chunk it certifies can
  // add no mismatch and no new worst element, so only the others are compared in float64.
  LogitsScreen screen;
  if (part.worst_row >= 0)
    screen = logits_screen(coeff, lse, rb, nb, c.max_abs_diff, c.max_rel_diff);
  const RowComparison a =
      compare_logits_row(zraw, raw, s_.got_dtype, 0, y, coeff, lse, rb, nb, &screen);
  const RowComparison b =
      compare_logits_row(zraw, raw, s_.got_dtype, y + 1, cols_, coeff, lse, rb, nb, &screen);
  // Element k from its z and got: (|got - w|, w, whether within the bound).
  auto element = [&](int64_t k, double zk, double gk) {
    const double lp = lse - zk;
    const double p = exp_nonpositive(-lp);
    const double w = k == y ? coeff * std::expm1(-lp) : coeff * p;
    const double diff = std::fabs(gk - w);
    double tol = INFINITY;
    for (int j = 0; j < nb; ++j)
      tol = std::min(tol, element_tolerance(rb[j], std::fabs(coeff), std::fabs(w), p, lp));
    return std::make_tuple(diff, w, diff <= tol);
  };
  HostArray got_view;
  got_view.dtype = s_.got_dtype;
  got_view.shape = {cols_};
  got_view.data = raw;
  const auto [diff_y, w_y, ok_y] =
      element(y, b_.logits->get_f64(row * cols_ + y), got_view.get_f64(y));
  c.mismatched += a.mismatched + b.mismatched + (ok_y ? 0 : 1);
  double row_max = std::max(a.max_abs_diff, b.max_abs_diff);
  if (std::isnan(a.max_abs_diff) || std::isnan(b.max_abs_diff)) row_max = NAN;
  if (worse(diff_y, row_max)) row_max = diff_y;
  const double row_rel =
      std::max({a.max_rel_diff, b.max_rel_diff, w_y != 0.0 ? diff_y / std::fabs(w_y) : 0.0});
  // The row holds a new worst element: find it, in a scalar pass over the chunks that can hold it.
  if (worse(row_max, c.max_abs_diff) || part.worst_row < 0 ||
      (row_rel > c.max_rel_diff && std::isfinite(row_rel))) {
    row_to_f64(zraw, b_.logits->dtype, cols_, z.data());
    row_to_f64(raw, s_.got_dtype, cols_, got.data());
    constexpr int64_t kScan = 1024;
    for (int64_t k0 = 0; k0 < cols_; k0 += kScan) {
      const int64_t k1 = std::min(cols_, k0 + kScan);
      if (part.worst_row >= 0 && !(y >= k0 && y < k1)) {
        // The chunk's largest differences from the vectorised loop: a chunk none of whose
        // elements beats the worst so far (the running one: it only grows) is passed over, as
        // the scalar pass would pass over each of its elements. The two loops' w = c p differ in
        // the last bits (a table or another rounding of the exponential, whose argument carries
        // |lse| ulp): by far less than |c| 1e-13 (1 + |lse|) (p <= 1 off the target column), and
        // relative differences by far less than 1e-13 (1 + |lse|) (1 + rel).
        const RowComparison q =
            compare_logits_row(zraw, raw, s_.got_dtype, k0, k1, coeff, lse, rb, nb);
        const double slack = 1e-13 * (1.0 + std::fabs(lse));
        if (!worse(q.max_abs_diff + slack * std::fabs(coeff), c.max_abs_diff) &&
            !(q.max_rel_diff + slack * (1.0 + q.max_rel_diff) > c.max_rel_diff))
          continue;
      }
      for (int64_t k = k0; k < k1; ++k) {
        const auto [diff, w, ok] = element(k, z[k], got[k]);
        (void)ok;
        if (worse(diff, c.max_abs_diff) || part.worst_row < 0 ||
            (w != 0.0 && diff / std::fabs(w) > c.max_rel_diff))
          note(k, got[k], w);
      }
    }
  }
}

void GradStream::add(const int64_t* rows, int64_t n, const void* data) {
  const std::size_t row_bytes = static_cast<std::size_t>(cols_) * dtype_size_bytes(s_.got_dtype);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t row = rows[k];
    if (row < 0 || row >= static_cast<int64_t>(delivered_.size()) || delivered_[row]) {
      throw std::logic_error(fmt::format(
          "the candidate delivered gradient row {} {}", row,
          row < 0 || row >= static_cast<int64_t>(delivered_.size()) ? "out of range" : "twice"));
    }
    delivered_[row] = 1;
  }
  const int64_t threads = std::min<int64_t>(static_cast<int64_t>(parts_.size()), n);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(std::max<int64_t>(threads, 1)));
  auto work = [&](int64_t w) {
    try {
      std::vector<double> z(static_cast<std::size_t>(cols_)), got(static_cast<std::size_t>(cols_));
      for (int64_t k = w; k < n; k += threads) {
        const std::byte* raw =
            static_cast<const std::byte*>(data) + static_cast<std::size_t>(k) * row_bytes;
        const int64_t row = rows[k];
        Part& part = *parts_[static_cast<std::size_t>(w)];
        if (cols_ > 1 && (b_.loss_mask[row] == 0 || want_.coeff[row] == 0.0) &&
            (s_.skip_rows == nullptr || !(*s_.skip_rows)[row]) && part.worst_row >= 0 &&
            row_is_zero(raw, s_.got_dtype, cols_)) {
          part.c.checked += cols_;  // a zero truth met exactly (the common masked row)
        } else {
          compare_row(part, row, raw, z, got);
        }
        // The candidate has read this row of a mapped dump, and the comparison is done with it.
        if (b_.logits && cols_ > 1) b_.logits->drop_pages(row * cols_, (row + 1) * cols_);
      }
    } catch (...) {
      errors[static_cast<std::size_t>(w)] = std::current_exception();
    }
  };
  if (threads <= 1) {
    if (n > 0) work(0);
  } else {
    std::vector<std::thread> pool;
    for (int64_t w = 1; w < threads; ++w) pool.emplace_back(work, w);
    work(0);
    for (auto& t : pool) t.join();
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  rows_done_ += n;
  if (s_.progress) s_.progress(rows_done_);
}

GradComparison GradStream::finish(const std::vector<int32_t>& row_rank,
                                  const std::vector<int8_t>& row_chunk) {
  // Rows the candidate never wrote hold zeros.
  {
    const std::size_t row_bytes = static_cast<std::size_t>(cols_) * dtype_size_bytes(s_.got_dtype);
    std::vector<std::byte> zeros(row_bytes);
    std::vector<int64_t> missing;
    for (std::size_t r = 0; r < delivered_.size(); ++r)
      if (!delivered_[r]) missing.push_back(static_cast<int64_t>(r));
    std::vector<double> z(static_cast<std::size_t>(cols_)),
        got(static_cast<std::size_t>(cols_), 0.0);
    for (int64_t row : missing) compare_row(*parts_[0], row, zeros.data(), z, got);
  }
  GradComparison out;
  int64_t worst_row = -1, worst_col = -1, worst_rel_row = -1, worst_rel_col = -1;
  double worst_got = 0, worst_want = 0, worst_rel_got = 0, worst_rel_want = 0;
  for (const auto& p : parts_) {
    const GradComparison& c = p->c;
    out.checked += c.checked;
    out.mismatched += c.mismatched;
    out.masked_nonzero += c.masked_nonzero;
    out.not_compared += c.not_compared;
    if (p->worst_row >= 0 &&
        (worst_row < 0 || worse(c.max_abs_diff, out.max_abs_diff) ||
         (c.max_abs_diff == out.max_abs_diff && worst_row >= 0 && p->worst_row < worst_row))) {
      out.max_abs_diff = c.max_abs_diff;
      worst_row = p->worst_row;
      worst_col = p->worst_col;
      worst_got = p->worst_got;
      worst_want = p->worst_want;
    }
    if (p->worst_rel_row >= 0 && (worst_rel_row < 0 || c.max_rel_diff > out.max_rel_diff ||
                                  (c.max_rel_diff == out.max_rel_diff && worst_rel_row >= 0 &&
                                   p->worst_rel_row < worst_rel_row))) {
      out.max_rel_diff = c.max_rel_diff;
      worst_rel_row = p->worst_rel_row;
      worst_rel_col = p->worst_rel_col;
      worst_rel_got = p->worst_rel_got;
      worst_rel_want = p->worst_rel_want;
    }
  }
  auto locate = [&](int64_t row, int64_t col, double g, double w) {
    GradLocation l;
    if (row < 0) return l;
    l.got = g;
    l.want = w;
    l.abs_diff = std::fabs(g - w);
    l.rel_diff = w != 0.0 ? l.abs_diff / std::fabs(w) : (l.abs_diff == 0.0 ? 0.0 : INFINITY);
    int64_t sample = static_cast<int64_t>(std::upper_bound(b_.response_offsets.begin(),
                                                           b_.response_offsets.end(), row) -
                                          b_.response_offsets.begin()) -
                     1;
    l.sample = sample;
    l.response_index = row - b_.response_offsets[sample];
    l.vocab_index = cols_ > 1 ? col : -1;
    l.cp_rank = row_rank.empty() ? -1 : row_rank[row];
    l.chunk = row_chunk.empty() ? -1 : row_chunk[row];
    return l;
  };
  out.worst = locate(worst_row, worst_col, worst_got, worst_want);
  out.worst_relative = locate(worst_rel_row, worst_rel_col, worst_rel_got, worst_rel_want);
  return out;
}

}  // namespace lossguard::oracle
