// The candidate's switch: the LibTorch plugin (liblossguard_trainer.so, loaded on first use) or the
// kernels, in process.
#include "core/errors.h"
#include "core/plugin_loader.h"
#include "lossguard/build_config.h"
#include "trainer/candidate.h"
#include "trainer/mutation.h"

namespace lossguard::trainer {

const char* impl_name(Impl i) { return i == Impl::kKernels ? "kernels" : "torch"; }

bool parse_impl(const std::string& s, Impl* out) {
  if (s == "torch")
    *out = Impl::kTorch;
  else if (s == "kernels")
    *out = Impl::kKernels;
  else
    return false;
  return true;
}

CandidateOutput run_candidate(const CandidateInput& in_given) {
  // Test-only: a planted bug (LOSSGUARD_TEST_MUTATION, mutation.h) the tests expect check to catch.
  const std::optional<Mutation> mutation = mutation_from_environment();
  std::optional<Batch> mutated;
  CandidateInput in = in_given;
  if (mutation && (mutated = mutate_input(*mutation, *in.batch))) in.batch = &*mutated;
  std::vector<double> weight_scale;
  if (mutation && !(weight_scale = mutate_weights(*mutation, *in.batch, in.cp, in.layout)).empty())
    in.weight_scale = &weight_scale;
  CandidateOutput out;
  if (in.impl == Impl::kKernels) {
    run_kernels_candidate(in, &out);
  } else {
    const auto* api = static_cast<const TrainerApi*>(
        load_plugin_table("the LibTorch trainer (liblossguard_trainer.so)", "LOSSGUARD_TRAINER",
                          LOSSGUARD_TRAINER_PLUGIN, "lossguard_trainer_api", kTrainerAbiVersion));
    api->run(&in, &out);
  }
  if (!out.error.empty()) {
    rethrow_error(out.error_kind == ErrorKind::kNone ? ErrorKind::kInternal : out.error_kind,
                  std::string("trainer (") + impl_name(in.impl) + "): " + out.error);
  }
  if (mutation) mutate_output(*mutation, *in_given.batch, &out);
  return out;
}

}  // namespace lossguard::trainer
