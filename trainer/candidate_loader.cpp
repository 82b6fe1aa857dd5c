// Loads liblossguard_trainer.so on first use.
#include <mutex>

#include "io/plugin_loader.h"
#include "lossguard/build_config.h"
#include "oracle/errors.h"
#include "trainer/candidate.h"

namespace lossguard::trainer {

CandidateOutput run_candidate(const CandidateInput& in) {
  static const TrainerApi* api = nullptr;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      api = static_cast<const TrainerApi*>(io::load_plugin_table("the LibTorch trainer (liblossguard_trainer.so)",
                                                                 "LOSSGUARD_TRAINER", LOSSGUARD_TRAINER_PLUGIN,
                                                                 "lossguard_trainer_api", kTrainerAbiVersion));
    } catch (const InputError& e) {
      failure = e.what();
    }
  });
  if (api == nullptr) throw InputError(failure);
  CandidateOutput out;
  api->run(&in, &out);
  if (!out.error.empty()) throw InputError("trainer: " + out.error);
  return out;
}

}  // namespace lossguard::trainer
