// The lossguard command line as a function, so tests drive it in-process.
#pragma once
#include <ostream>

namespace lossguard::cli {

// Parses argv, runs one subcommand, writes text to `out` and diagnostics to `err`, returns the exit
// code of SPEC §8 (0 pass, 1 check failed, 2 bad input, 3 distributed fault, 4 nothing verified).
int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace lossguard::cli
