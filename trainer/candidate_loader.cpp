// The candidate's switch: the LibTorch plugin (liblossguard_trainer.so, loaded on first use) or the
// kernels, in process.
#include "core/errors.h"
#include "core/plugin_loader.h"
#include "lossguard/build_config.h"
#include "trainer/candidate.h"

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

CandidateOutput run_candidate(const CandidateInput& in) {
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
  return out;
}

}  // namespace lossguard::trainer
