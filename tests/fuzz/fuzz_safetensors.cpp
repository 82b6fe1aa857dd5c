// libFuzzer target: safetensors parsing and the packed-batch conversion and validation behind it.
#include <cstddef>
#include <cstdint>

#include "core/errors.h"
#include "io/dump.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace lossguard;
  try {
    io::SafetensorsFile f = io::parse_safetensors(nullptr, reinterpret_cast<const std::byte*>(data),
                                                  size, "fuzz.safetensors");
    io::Dump d;
    d.path = "fuzz.safetensors";
    d.tree = io::Value::make_dict();
    for (auto& [name, a] : f.tensors)
      d.tree->entries.emplace_back(io::Value::make_string(name), io::Value::make_tensor(a));
    io::build_batch({d}, {});
  } catch (const InputError&) {
  }
  return 0;
}
