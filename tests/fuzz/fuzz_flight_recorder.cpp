// libFuzzer target: a Flight Recorder dump (postmortem's reader): the plain-data fast path and the
// restricted unpickler or JSON reader behind it, then the conversion into calls. A pickle the fast
// path accepts must also be one the restricted unpickler accepts: the fast path decides nothing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/errors.h"
#include "io/flat_pickle.h"
#include "io/flight_recorder.h"
#include "io/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace lossguard;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (io::FlatPickle::parse(bytes)) {
    try {
      io::unpickle(bytes, "fuzz", [](const io::ValuePtr&) -> io::ValuePtr { return nullptr; });
    } catch (const InputError&) {
      std::abort();  // the fast path took what the restricted unpickler refuses
    }
  }
  try {
    FrJobBuilder builder;
    io::parse_flight_record(bytes, "fuzz", 0, builder);
  } catch (const InputError&) {
  }
  return 0;
}
