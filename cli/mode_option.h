// A mode given on the command line, parsed from its one name table (core/modes.h): a bad value is
// an input error that lists the choices ("--impl must be torch or kernels, got 'x'").
#pragma once
#include <string>
#include <string_view>

#include "core/errors.h"
#include "core/modes.h"

namespace lossguard::cli {

template <typename E>
E mode_from_option(std::string_view option, const std::string& value) {
  E mode{};
  if (!parse_mode(value, &mode))
    throw_input_error("{} must be {}, got '{}'", option, mode_choices<E>(), value);
  return mode;
}

}  // namespace lossguard::cli
