// torch.save zip archives: layout, storages and the restricted unpickler; the zip itself is read
// and written by LibTorch's caffe2::serialize through the plugin (io/zip_plugin.h).
#include "io/torch_zip.h"

#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <map>

#include "core/errors.h"
#include "io/pickle.h"
#include "io/zip_plugin.h"

namespace lossguard::io {

namespace {

struct StorageType {
  const char* name;
  DType dtype;
};
constexpr StorageType kStorageTypes[] = {
    {"torch.FloatStorage", DType::kFloat32}, {"torch.DoubleStorage", DType::kFloat64},
    {"torch.HalfStorage", DType::kFloat16},  {"torch.BFloat16Storage", DType::kBFloat16},
    {"torch.LongStorage", DType::kInt64},    {"torch.IntStorage", DType::kInt32},
    {"torch.ShortStorage", DType::kInt16},   {"torch.CharStorage", DType::kInt8},
    {"torch.ByteStorage", DType::kUInt8},    {"torch.BoolStorage", DType::kBool},
    {"torch.UntypedStorage", DType::kUInt8},
};

const char* storage_type_for(DType d) {
  for (const auto& s : kStorageTypes) {
    if (s.dtype == d && std::strcmp(s.name, "torch.UntypedStorage") != 0)
      return s.name + 6;  // drop "torch."
  }
  return "ByteStorage";
}

std::string first_bytes(const std::string& path, std::size_t n) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw_input_error("{}: cannot open: {}", path, std::strerror(errno));
  std::string s(n, '\0');
  f.read(s.data(), static_cast<std::streamsize>(n));
  s.resize(static_cast<std::size_t>(f.gcount()));
  return s;
}

}  // namespace

// Long: the torch.save zip read in order (magic, archive, data.pkl, each storage record), each
// error naming the file and the record.
ValuePtr read_torch_save(const std::string& path) {
  const std::string head = first_bytes(path, 4);
  if (head.size() < 4 || head.compare(0, 4, "PK\x03\x04") != 0) {
    if (!head.empty() && static_cast<uint8_t>(head[0]) == 0x80) {
      throw_input_error(
          "{}: legacy (pre-1.6, non-zip) torch.save format is not supported; re-save it with "
          "torch.save(obj, path) from a current PyTorch",
          path);
    }
    throw_input_error("{}: not a torch.save archive (no zip signature)", path);
  }
  const TorchZipApi& zip = torch_zip_api();
  std::string error;
  std::shared_ptr<void> archive(zip.open(path.c_str(), &error), [&zip](void* a) {
    if (a != nullptr) zip.close(a);
  });
  if (!archive) throw_input_error("{}: malformed torch.save archive: {}", path, error);
  auto read = [&](const std::string& name) {
    ZipRecord rec;
    if (!zip.read_record(archive.get(), name.c_str(), &rec, &error)) {
      throw_input_error("{}: malformed torch.save archive: record '{}': {}", path, name, error);
    }
    return rec;
  };
  if (!zip.has_record(archive.get(), "data.pkl")) {
    if (zip.has_record(archive.get(), "constants.pkl") ||
        zip.has_record(archive.get(), "code/__torch__.py")) {
      throw_input_error("{}: a TorchScript archive (torch.jit.save), not a torch.save batch", path);
    }
    throw_input_error("{}: zip archive without data.pkl: not a torch.save file", path);
  }
  if (zip.has_record(archive.get(), "byteorder")) {
    ZipRecord rec = read("byteorder");
    std::string order(static_cast<const char*>(rec.data.get()), rec.size);
    if (order != "little")
      throw_input_error("{}: byteorder '{}' is not supported (little-endian only)", path, order);
  }
  ZipRecord pkl_rec = read("data.pkl");
  std::string_view pkl(static_cast<const char*>(pkl_rec.data.get()), pkl_rec.size);
  std::map<std::string, ValuePtr> storages;
  PersistentLoad load = [&](const ValuePtr& pid) -> ValuePtr {
    // ('storage', storage_type, key, location, numel)
    if (!pid->is_sequence() || pid->items.size() < 5 ||
        pid->items[0]->kind != Value::Kind::kString || pid->items[0]->s != "storage") {
      throw_input_error("{}: data.pkl: unsupported persistent id ({})", path, pid->type_name());
    }
    const ValuePtr& type = pid->items[1];
    const ValuePtr& key = pid->items[2];
    const ValuePtr& numel = pid->items[4];
    if (key->kind != Value::Kind::kString || numel->kind != Value::Kind::kInt || numel->i < 0) {
      throw_input_error("{}: data.pkl: malformed storage id", path);
    }
    if (auto it = storages.find(key->s); it != storages.end()) return it->second;
    const StorageType* st = nullptr;
    for (const auto& s : kStorageTypes) {
      if (type->kind == Value::Kind::kGlobal && type->s == s.name) st = &s;
    }
    if (st == nullptr)
      throw_input_error("{}: storage '{}' has unsupported type {}", path, key->s,
                        type->type_name());
    const std::string record = "data/" + key->s;
    if (!zip.has_record(archive.get(), record.c_str())) {
      throw_input_error("{}: storage record '{}' is missing from the archive", path, record);
    }
    if (static_cast<uint64_t>(numel->i) > (uint64_t{1} << 40)) {
      throw_input_error("{}: storage '{}' declares {} elements", path, key->s, numel->i);
    }
    const std::size_t want = static_cast<std::size_t>(numel->i) * dtype_size_bytes(st->dtype);
    std::size_t have = 0;
    if (!zip.record_size(archive.get(), record.c_str(), &have, &error)) {
      throw_input_error("{}: malformed torch.save archive: record '{}': {}", path, record, error);
    }
    if (have != want) {
      throw_input_error("{}: storage record '{}' has {} bytes but {} elements of {} need {}", path,
                        record, have, numel->i, dtype_name(st->dtype), want);
    }
    ZipRecord rec = read(record);
    auto v = std::make_shared<Value>();
    v->kind = Value::Kind::kStorage;
    v->array.dtype = st->dtype;
    v->array.shape = {numel->i};
    v->array.data = static_cast<const std::byte*>(rec.data.get());
    v->array.owner = rec.data;
    storages[key->s] = v;
    return v;
  };
  return unpickle(pkl, path + ": data.pkl", load);
}

void write_torch_save(const std::string& path, const std::vector<TorchSaveEntry>& entries) {
  PickleWriter p;
  std::vector<const HostArray*> storages;
  p.proto();
  p.empty_dict();
  p.mark();
  for (const auto& e : entries) {
    p.string(e.key);
    const Value& v = *e.value;
    switch (v.kind) {
      case Value::Kind::kTensor: {
        const HostArray& a = v.array;
        p.global("torch._utils", "_rebuild_tensor_v2");
        p.mark();
        {
          p.mark();  // persistent id ('storage', type, key, 'cpu', numel)
          p.string("storage");
          p.global("torch", storage_type_for(a.dtype));
          p.string(std::to_string(storages.size()));
          p.string("cpu");
          p.integer(a.numel());
          p.tuple();
          p.binpersid();
        }
        p.integer(0);
        p.mark();
        for (int64_t d : a.shape) p.integer(d);
        p.tuple();
        p.mark();
        int64_t stride = 1;
        std::vector<int64_t> strides(a.shape.size());
        for (std::size_t d = a.shape.size(); d-- > 0;) {
          strides[d] = stride;
          stride *= a.shape[d];
        }
        for (int64_t s : strides) p.integer(s);
        p.tuple();
        p.boolean(false);
        p.global("collections", "OrderedDict");
        p.mark();
        p.tuple();
        p.reduce();
        p.tuple();
        p.reduce();
        storages.push_back(&a);
        break;
      }
      case Value::Kind::kInt:
        p.integer(v.i);
        break;
      case Value::Kind::kFloat:
        p.floating(v.f);
        break;
      case Value::Kind::kString:
        p.string(v.s);
        break;
      case Value::Kind::kBool:
        p.boolean(v.b);
        break;
      case Value::Kind::kNone:
        p.none();
        break;
      default:
        LG_CHECK(false, "write_torch_save: unsupported value {}", v.type_name());
    }
  }
  p.setitems();
  p.stop();
  write_torch_archive(path, p.out, storages);
}

void write_torch_archive(const std::string& path, const std::string& pickle,
                         const std::vector<const HostArray*>& storages) {
  std::vector<std::pair<std::string, std::pair<const void*, std::size_t>>> records;
  records.push_back({"data.pkl", {pickle.data(), pickle.size()}});
  records.push_back({"byteorder", {"little", 6}});
  for (std::size_t k = 0; k < storages.size(); ++k) {
    records.push_back(
        {"data/" + std::to_string(k), {storages[k]->data, storages[k]->size_bytes()}});
  }
  std::string error;
  if (!torch_zip_api().write_archive(path.c_str(), &records, &error)) {
    throw_input_error("{}: cannot write torch.save archive: {}", path, error);
  }
}

}  // namespace lossguard::io
