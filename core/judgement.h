// A result's judgement: what it says for the exit code (SPEC §8): whether anything was verified,
// and whether it failed (1) or faulted (3). The library's results decide it (`judgement()`); the
// CLI's Report is the one place that turns judgements and errors into an exit code.
#pragma once
#include <string>
#include <utility>

namespace lossguard {

struct Judgement {
  std::string unverified;  // non-empty: nothing was verified, and why (exit 4)
  bool failed = false;     // a check found wrong numbers (exit 1)
  bool faulted = false;    // the job itself broke: an error, block, mismatch or divergence (exit 3)

  static Judgement nothing_verified(std::string why) {
    Judgement j;
    j.unverified = std::move(why);
    return j;
  }
  static Judgement verified(bool failed = false, bool faulted = false) {
    Judgement j;
    j.failed = failed;
    j.faulted = faulted;
    return j;
  }
};

}  // namespace lossguard
