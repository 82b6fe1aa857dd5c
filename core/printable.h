// Text that came from an input (a dump's frame names, a file name) as a terminal shows it: control
// characters escaped, so it can neither forge a line of a report nor move the cursor.
#pragma once
#include <fmt/format.h>

#include <string>
#include <string_view>

namespace lossguard {

inline std::string printable(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace lossguard
