// The boundary to LibTorch's zip reader and writer (caffe2::serialize), which live in a plugin,
// liblossguard_torchzip.so, loaded on first use: LibTorch's start-up costs ~0.2 s per process,
// which commands that never open a .pt file (count on safetensors, topo, replay) should not pay.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lossguard::io {

struct ZipRecord {
  std::shared_ptr<const void> data;  // keeps the bytes alive
  std::size_t size = 0;
};

// C-style table of the plugin's entry points. Errors come back as text (never as exceptions across
// the library boundary); the caller turns them into InputError.
struct TorchZipApi {
  int abi_version;
  void* (*open)(const char* path, std::string* error);
  void (*close)(void* archive);
  bool (*has_record)(void* archive, const char* name);
  bool (*record_size)(void* archive, const char* name, std::size_t* size, std::string* error);
  bool (*read_record)(void* archive, const char* name, ZipRecord* out, std::string* error);
  bool (*write_archive)(
      const char* path,
      const std::vector<std::pair<std::string, std::pair<const void*, std::size_t>>>* records,
      std::string* error);
};
inline constexpr int kTorchZipAbiVersion = 1;

// Loads the plugin once (LOSSGUARD_TORCHZIP overrides its path); throws InputError when it cannot.
const TorchZipApi& torch_zip_api();

}  // namespace lossguard::io

extern "C" const lossguard::io::TorchZipApi* lossguard_torchzip_api();
