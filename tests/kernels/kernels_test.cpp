// The CPU twins of kernels/ against plain float64 reference loops and the oracle: token counts
// exactly (every fixture case, random batches, every layout), the fused cross entropy under argued
// bounds on every instruction-set build this CPU runs (awkward vocabulary sizes, inactive rows,
// zero coefficients), and the skip decision.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/fused_xent_rows.h"
#include "kernels/cpu/parallel.h"
#include "kernels/fused_xent.h"
#include "kernels/token_count.h"
#include "kernels/zero_flag.h"
#include "kernels_reference.h"
#include "oracle/count/denominators.h"
#include "synth/cases.h"

namespace lossguard::kernels {
namespace {

std::vector<int64_t> kernel_counts(const Batch& b, const std::vector<int64_t>& cps,
                                   const ShardLayout& layout) {
  TokenCountArgs a = host_token_count_args(b, cps, layout);
  std::vector<int64_t> out(static_cast<std::size_t>(token_count_size(a)), -1);
  a.counts = out.data();
  count_tokens(a, Device::kCpu);
  return out;
}

// Compares the kernel's counts with the oracle's count_owned_tokens, entry by entry.
void expect_counts_match_oracle(const Batch& b, const std::vector<int64_t>& cps,
                                const ShardLayout& layout, const std::string& what) {
  const std::vector<int64_t> got = kernel_counts(b, cps, layout);
  const oracle::OwnedCounts want = oracle::count_owned_tokens(b, cps, layout);
  std::size_t offset = 0;
  for (std::size_t c = 0; c < cps.size(); ++c) {
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      for (int64_t r = 0; r < cps[c]; ++r) {
        ASSERT_EQ(got[offset + static_cast<std::size_t>(i * cps[c] + r)],
                  want.count(c, static_cast<std::size_t>(i), r))
            << what << ": cp " << cps[c] << ", sample " << i << " (T " << b.total_lengths[i]
            << ", R " << b.response_lengths[i] << "), rank " << r;
      }
    }
    offset += static_cast<std::size_t>(b.num_samples() * cps[c]);
  }
}

TEST(TokenCount, MatchesTheOracleOnEveryFixtureCase) {
  const std::vector<int64_t> cps = {1, 2, 3, 4, 8, 16};
  for (const auto& c : synth::list_cases()) {
    synth::GenOptions o;
    o.seed = test_seed();
    o.masks_only = true;
    expect_counts_match_oracle(synth::make_case(c.name, o), cps, {}, c.name);
  }
}

TEST(TokenCount, MatchesTheOracleOnRandomBatchesAndEveryLayout) {
  synth::Rng rng(test_seed());
  for (int trial = 0; trial < 40; ++trial) {
    synth::GenOptions o;
    o.seed = rng.next();
    o.masks_only = true;
    o.num_samples = rng.uniform_int(0, 40);
    o.max_prompt = rng.uniform_int(1, 64);
    o.max_response =
        rng.uniform_int(1, trial % 2 ? 300 : 6000);  // both the short- and the long-mask path
    o.empty_fraction = 0.2;
    o.masked_fraction = 0.2;
    const Batch b = synth::make_case(trial % 3 == 0 ? "long-random" : "random", o);
    int64_t longest = 0;
    for (int64_t t : b.total_lengths) longest = std::max(longest, t);
    const std::vector<int64_t> cps = {1, 2, 4, 8};
    expect_counts_match_oracle(b, cps, {}, fmt::format("trial {} thd", trial));
    ShardLayout padded;
    padded.padded_total_length = (longest / 16 + 1) * 16;
    expect_counts_match_oracle(b, cps, padded, fmt::format("trial {} padded", trial));
    ShardLayout bshd;
    bshd.packing = Packing::kBshd;
    bshd.max_seq_len = longest + static_cast<int64_t>(rng.uniform_int(0, 9));
    expect_counts_match_oracle(b, {1, 3, 5}, bshd, fmt::format("trial {} bshd", trial));
  }
}

TEST(TokenCount, NoSamplesWritesNothing) {
  Batch b;
  b.response_offsets = {0};
  b.token_offsets = {0};
  EXPECT_TRUE(kernel_counts(b, {1, 2}, {}).empty());
}

TEST(ParallelRanges, CoverEveryItemOnceAndRethrowAWorkersException) {
  std::vector<int> hits(1000, 0);
  parallel_ranges(1000, 10, [&](int64_t b, int64_t e, int) {
    for (int64_t k = b; k < e; ++k) ++hits[k];
  });
  for (int h : hits) ASSERT_EQ(h, 1);
  // The last range throws; with one thread or many, the caller sees it after every thread finished.
  EXPECT_THROW(parallel_ranges(1000, 10,
                               [](int64_t, int64_t e, int) {
                                 if (e == 1000) throw std::bad_alloc();
                               }),
               std::bad_alloc);
}

TEST(SkipDecision, FlagIsSetExactlyWhenTheCountsSumToZero) {
  SkipDecision d;
  const std::vector<int64_t> zeros = {0, 0, 0}, some = {0, 3, 0};
  reduce_skip_decision(zeros.data(), 3, &d, Device::kCpu);
  EXPECT_EQ(read_skip_decision(&d, Device::kCpu).skip, 1);
  EXPECT_EQ(d.num_tokens, 0);
  reduce_skip_decision(some.data(), 3, &d, Device::kCpu);
  EXPECT_EQ(read_skip_decision(&d, Device::kCpu).skip, 0);
  EXPECT_EQ(d.num_tokens, 3);
  reduce_skip_decision(nullptr, 0, &d, Device::kCpu);  // no ranks' counts: nothing to train on
  EXPECT_EQ(d.skip, 1);
}

TEST(FusedXent, EveryInstructionSetMatchesTheFloat64Reference) {
  struct Isa {
    const char* name;
    void (*fn)(const XentArgs&, int64_t, int64_t);
    bool runs;
  };
  const std::vector<Isa> isas = {
    {"generic", generic::xent_rows, xent_isa_runs("generic")},
#if defined(__x86_64__) && defined(LOSSGUARD_XENT_X86)
    {"avx2", avx2::xent_rows, xent_isa_runs("avx2")},
    {"avx512", avx512::xent_rows, xent_isa_runs("avx512")},
#endif
  };
  int ran = 0;
  for (const Isa& isa : isas) {
    if (!isa.runs) continue;
    ++ran;
    for (const XentCase& c : xent_cases()) {
      const auto fn = isa.fn;
      expect_xent_matches_reference(
          c, make_data(c, test_seed() + static_cast<uint64_t>(c.vocab)),
          [fn](const XentArgs& a) { fn(a, 0, a.rows); }, isa.name);
    }
  }
  EXPECT_GE(ran, 1);
  std::printf("instruction sets checked: %d (this process dispatches to %s)\n", ran,
              xent_cpu_isa());
}

TEST(FusedXent, ThreadedDispatchMatchesTheReference) {
  const XentCase c{DType::kBFloat16, 64, 3001, 4.0};
  expect_xent_matches_reference(
      c, make_data(c, test_seed()), [](const XentArgs& a) { fused_xent(a, Device::kCpu); },
      "dispatch");
}

// One row's kernel arguments over caller-owned buffers.
XentArgs one_row(const std::vector<float>& z, const int64_t& target, const float& scale, float& lse,
                 float& loss, std::vector<float>& g) {
  XentArgs a;
  a.logits = z.data();
  a.rows = 1;
  a.vocab = static_cast<int64_t>(z.size());
  a.row_stride = a.vocab;
  a.targets = &target;
  a.grad_scale = &scale;
  a.lse = &lse;
  a.token_loss = &loss;
  a.grad = g.data();
  return a;
}

// Rows of several 2048-logit blocks whose maximum moves from block to block: up by 10 (the
// one-sweep blocks rescale their sum), up by 25 and by 100 (each block over the slack of 20, so
// redone with its own maximum; kept, e^100 would overflow float), down by 25 (later blocks far
// below the first), on every instruction set, against the float64 reference under the same
// bounds as random logits.
TEST(FusedXent, RisingAndFallingBlockMaximaMatchTheReference) {
  const int64_t rows = 4, vocab = 4 * 2048 + 100;
  const double steps[rows] = {10.0, 25.0, -25.0, 100.0};
  const XentCase c{DType::kFloat32, rows, vocab, 1.0};
  XentData d = make_data(c, test_seed());
  for (int64_t r = 0; r < rows; ++r) {
    d.active[r] = 1;
    d.scale[r] = 0.5f;
    for (int64_t k = 0; k < vocab; ++k) {
      const float x = d.f32[r * vocab + k] + static_cast<float>(steps[r] * (k / 2048));
      d.f32[r * vocab + k] = x;
      d.exact[r * vocab + k] = x;
    }
  }
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    if (!xent_isa_runs(isa)) continue;
    void (*fn)(const XentArgs&, int64_t, int64_t) = generic::xent_rows;
#if defined(__x86_64__) && defined(LOSSGUARD_XENT_X86)
    if (std::string(isa) == "avx2") fn = avx2::xent_rows;
    if (std::string(isa) == "avx512") fn = avx512::xent_rows;
#endif
    expect_xent_matches_reference(
        c, d, [fn](const XentArgs& a) { fn(a, 0, a.rows); }, isa);
  }
}

// A NaN or +inf logit in a later block makes the row's lse and loss NaN: a finite loss would hide
// it (the one-sweep path must not keep a block whose maximum is not finite).
TEST(FusedXent, NonFiniteLogitInALaterBlockIsNotHidden) {
  const int64_t vocab = 3 * 2048;
  for (const float bad : {NAN, INFINITY}) {
    std::vector<float> z(static_cast<std::size_t>(vocab));
    for (int64_t k = 0; k < vocab; ++k) z[k] = static_cast<float>((k * 7919) % 13) * 0.1f;
    z[2 * 2048 + 5] = bad;
    const int64_t target = 1;
    const float scale = 1.0f;
    float lse = 0, loss = 0;
    std::vector<float> g(static_cast<std::size_t>(vocab), 0.0f);
    const XentArgs a = one_row(z, target, scale, lse, loss, g);
    for (const char* isa : {"generic", "avx2", "avx512"}) {
      if (!xent_isa_runs(isa)) continue;
      lse = loss = 0.0f;
#if defined(__x86_64__) && defined(LOSSGUARD_XENT_X86)
      if (std::string(isa) == "avx2") avx2::xent_rows(a, 0, 1);
      if (std::string(isa) == "avx512") avx512::xent_rows(a, 0, 1);
#endif
      if (std::string(isa) == "generic") generic::xent_rows(a, 0, 1);
      EXPECT_TRUE(std::isnan(lse)) << isa << " logit " << bad << ": lse " << lse;
      EXPECT_TRUE(std::isnan(loss)) << isa << " logit " << bad << ": loss " << loss;
    }
  }
}

TEST(FusedXent, ExtremeLogitsStayFinite) {
  // One dominant logit (p = 1 exactly in float) and -inf entries (masked vocabulary).
  const int64_t v = 37;
  std::vector<float> z(static_cast<std::size_t>(v), -INFINITY);
  z[3] = 1e4f;
  z[5] = 0.0f;
  const int64_t target = 5;
  const float scale = 0.5f;
  float lse = 0, loss = 0;
  std::vector<float> g(static_cast<std::size_t>(v), NAN);
  fused_xent(one_row(z, target, scale, lse, loss, g), Device::kCpu);
  EXPECT_FLOAT_EQ(lse, 1e4f);
  EXPECT_FLOAT_EQ(loss, 1e4f);
  EXPECT_FLOAT_EQ(g[3], 0.5f);
  EXPECT_FLOAT_EQ(g[5], -0.5f);
  for (int64_t k = 0; k < v; ++k) {
    if (k != 3 && k != 5) {
      EXPECT_EQ(g[k], 0.0f) << k;
    }
  }
}

TEST(FusedXent, RejectsTargetsOutsideTheVocabularyAndUnsupportedDtypes) {
  const std::vector<float> z(8, 0.0f);
  const int64_t target = 8;
  float lse, loss;
  XentArgs a;
  a.logits = z.data();
  a.rows = 1;
  a.vocab = 8;
  a.row_stride = 8;
  a.targets = &target;
  a.lse = &lse;
  a.token_loss = &loss;
  EXPECT_THROW(fused_xent(a, Device::kCpu), std::out_of_range);
  a.dtype = DType::kFloat64;
  EXPECT_THROW(fused_xent(a, Device::kCpu), std::invalid_argument);
}

}  // namespace
}  // namespace lossguard::kernels
