// The plugin itself: LibTorch's PyTorchStreamReader / PyTorchStreamWriter behind TorchZipApi. The
// only translation unit of lossguard's loaders that includes LibTorch.
#include "io/zip_plugin.h"

#include <caffe2/serialize/inline_container.h>

namespace {

using lossguard::io::TorchZipApi;
using lossguard::io::ZipRecord;
using Reader = caffe2::serialize::PyTorchStreamReader;

std::string first_line(const c10::Error& e) {
  std::string msg = e.what_without_backtrace();
  return msg.substr(0, msg.find('\n'));
}

void* zip_open(const char* path, std::string* error) {
  try {
    return new Reader(std::string(path));
  } catch (const c10::Error& e) {
    *error = first_line(e);
  } catch (const std::exception& e) {
    *error = e.what();
  }
  return nullptr;
}

void zip_close(void* archive) { delete static_cast<Reader*>(archive); }

bool zip_has_record(void* archive, const char* name) {
  try {
    return static_cast<Reader*>(archive)->hasRecord(name);
  } catch (const std::exception&) {
    return false;
  }
}

bool zip_record_size(void* archive, const char* name, std::size_t* size, std::string* error) {
  try {
    *size = static_cast<Reader*>(archive)->getRecordSize(name);
    return true;
  } catch (const c10::Error& e) {
    *error = first_line(e);
  } catch (const std::exception& e) {
    *error = e.what();
  }
  return false;
}

bool zip_read_record(void* archive, const char* name, ZipRecord* out, std::string* error) {
  try {
    auto [ptr, n] = static_cast<Reader*>(archive)->getRecord(name);
    auto holder = std::make_shared<at::DataPtr>(std::move(ptr));
    out->data = std::shared_ptr<const void>(holder, holder->get());
    out->size = n;
    return true;
  } catch (const c10::Error& e) {
    *error = first_line(e);
  } catch (const std::exception& e) {
    *error = e.what();
  }
  return false;
}

bool zip_write_archive(
    const char* path,
    const std::vector<std::pair<std::string, std::pair<const void*, std::size_t>>>* records,
    std::string* error) {
  try {
    caffe2::serialize::PyTorchStreamWriter writer{std::string(path)};
    for (const auto& [name, bytes] : *records) writer.writeRecord(name, bytes.first, bytes.second);
    writer.writeEndOfFile();
    return true;
  } catch (const c10::Error& e) {
    *error = first_line(e);
  } catch (const std::exception& e) {
    *error = e.what();
  }
  return false;
}

const TorchZipApi kApi = {lossguard::io::kTorchZipAbiVersion,
                          zip_open,
                          zip_close,
                          zip_has_record,
                          zip_record_size,
                          zip_read_record,
                          zip_write_archive};

}  // namespace

extern "C" __attribute__((visibility("default"))) const lossguard::io::TorchZipApi*
lossguard_torchzip_api() {
  return &kApi;
}
