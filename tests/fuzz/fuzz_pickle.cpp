// libFuzzer target: the restricted unpickler (a torch.save archive's data.pkl; every persistent id
// resolves to a small storage) and the conversion of whatever it builds into a batch.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/errors.h"
#include "io/dump.h"
#include "io/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace lossguard;
  static const HostArray kStorage =
      HostArray::from_i64(DType::kInt64, {16}, std::vector<int64_t>(16, 1));
  io::PersistentLoad load = [](const io::ValuePtr&) {
    auto v = std::make_shared<io::Value>();
    v->kind = io::Value::Kind::kStorage;
    v->array = kStorage;
    return v;
  };
  io::UnpickleLimits limits;
  limits.max_items = 1 << 20;
  limits.max_string_bytes = 1 << 20;
  try {
    io::Dump d;
    d.path = "fuzz.pt";
    d.tree = io::unpickle(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.pt",
                          load, limits);
    io::build_batch({d}, {});
  } catch (const InputError&) {
  }
  return 0;
}
