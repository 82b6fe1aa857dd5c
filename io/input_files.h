// Input paths as every command takes them: a directory stands for its files of the given
// extensions, in name order; any other path must name a regular file (never opened otherwise: a
// FIFO would block open() and a pipe is not a file that can be memory-mapped).
#pragma once
#include <string>
#include <vector>

namespace lossguard::io {

struct InputFileKind {
  std::vector<std::string> extensions;  // ".safetensors", ...
  bool recursive = false;               // look in subdirectories too
  std::string described;                // "dump files (*.safetensors, *.pt, *.pth, *.json)"
};

// The files the paths name, directories expanded. Throws InputError naming the path: missing, an
// empty directory, or not a regular file (with its kind: FIFO or pipe, device, socket).
std::vector<std::string> expand_input_paths(const std::vector<std::string>& paths,
                                            const InputFileKind& kind);

// Throws InputError unless `path` is a regular file (symbolic links followed).
void require_regular_file(const std::string& path);

}  // namespace lossguard::io
