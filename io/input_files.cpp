// Input paths: directories expanded, and anything that is not a regular file refused by its kind
// before it is opened.
#include "io/input_files.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "core/errors.h"

namespace lossguard::io {

namespace fs = std::filesystem;

namespace {

const char* kind_name(fs::file_type t) {
  switch (t) {
    case fs::file_type::fifo:
      return "a pipe or FIFO";
    case fs::file_type::character:
      return "a character device";
    case fs::file_type::block:
      return "a block device";
    case fs::file_type::socket:
      return "a socket";
    case fs::file_type::directory:
      return "a directory";
    default:
      return "not a regular file";
  }
}

template <class Iterator>
void collect(const std::string& dir, const InputFileKind& kind, std::vector<std::string>& out) {
  std::error_code ec;
  std::vector<std::string> found;
  for (const auto& e : Iterator(dir, ec)) {
    const std::string ext = e.path().extension().string();
    // is_regular_file follows links and never opens: FIFOs and devices in the directory are skipped
    if (e.is_regular_file(ec) &&
        std::find(kind.extensions.begin(), kind.extensions.end(), ext) != kind.extensions.end()) {
      found.push_back(e.path().string());
    }
  }
  if (ec) throw_input_error("{}: cannot list the directory: {}", dir, ec.message());
  std::sort(found.begin(), found.end());
  if (found.empty()) throw_input_error("{}: directory holds no {}", dir, kind.described);
  out.insert(out.end(), found.begin(), found.end());
}

}  // namespace

void require_regular_file(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found)
    throw_input_error("{}: no such file or directory", path);
  if (ec) throw_input_error("{}: cannot read its status: {}", path, ec.message());
  if (st.type() == fs::file_type::regular) return;
  throw_input_error(
      "{}: is {}, not a regular file: inputs are memory-mapped and may be read more than once; "
      "write the data to a file first (e.g. cat ... > batch.safetensors)",
      path, kind_name(st.type()));
}

std::vector<std::string> expand_input_paths(const std::vector<std::string>& paths,
                                            const InputFileKind& kind) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      if (kind.recursive) {
        collect<fs::recursive_directory_iterator>(p, kind, out);
      } else {
        collect<fs::directory_iterator>(p, kind, out);
      }
    } else {
      require_regular_file(p);
      out.push_back(p);
    }
  }
  return out;
}

}  // namespace lossguard::io
