// Loads liblossguard_trainer.so on first use.
#include "io/plugin_loader.h"
#include "lossguard/build_config.h"
#include "oracle/errors.h"
#include "trainer/candidate.h"

namespace lossguard::trainer {

CandidateOutput run_candidate(const CandidateInput& in) {
  const auto* api = static_cast<const TrainerApi*>(io::load_plugin_table(
      "the LibTorch trainer (liblossguard_trainer.so)", "LOSSGUARD_TRAINER", LOSSGUARD_TRAINER_PLUGIN, "lossguard_trainer_api",
      kTrainerAbiVersion));
  CandidateOutput out;
  api->run(&in, &out);
  if (!out.error.empty()) throw InputError("trainer: " + out.error);
  return out;
}

}  // namespace lossguard::trainer
