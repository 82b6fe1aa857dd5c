// libFuzzer target: the JSON batch format, from text to a validated batch.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/errors.h"
#include "io/dump.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace lossguard;
  try {
    io::Dump d;
    d.path = "fuzz.json";
    d.tree = io::json_to_value(std::string(reinterpret_cast<const char*>(data), size), "fuzz.json");
    io::build_batch({d}, {});
  } catch (const InputError&) {
  }
  return 0;
}
