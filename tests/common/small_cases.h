// Small seeded batches of a named case (synth/cases.h) for the loss and gradient tests: prompts of
// up to 6 tokens, responses of up to 9, a small vocabulary.
#pragma once
#include <cstdint>
#include <string>

#include "core/batch.h"
#include "synth/cases.h"

namespace lossguard::testing {

inline Batch small_case(const std::string& name, DType dtype, uint64_t seed, int64_t samples = 10,
                        int64_t vocab = 7) {
  synth::GenOptions o;
  o.seed = seed;
  o.num_samples = samples;
  o.vocab_size = vocab;
  o.max_prompt = 6;
  o.max_response = 9;
  o.dtype = dtype;
  return synth::make_case(name, o);
}

}  // namespace lossguard::testing
