// Failures that stop a command. Mismatches are data (counted and reported); these are for "cannot
// compute": each kind maps to one exit code at the single catch site in cli/app.cpp.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace lossguard {

// The exit codes (docs/exit-codes.md): when several apply, 3 > 1 > 2 > 4. cli/report.cpp maps
// results and errors to them; the real-mode SIGTERM handler (distributed/) exits with kExitFault
// directly.
enum ExitCode : int {
  kExitPass = 0,
  kExitFail = 1,
  kExitError = 2,
  kExitFault = 3,
  kExitUnverified = 4
};

// Bad input or invocation: exit code 2. The message names the file, sample and field.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A contract whose scale no trainer can apply on a layout tried (core's scale_value): an input
// error that a search over layouts must not take for "this layout cannot hold the batch".
class ScaleRangeError : public InputError {
 public:
  using InputError::InputError;
};

// A requested check could not run at all (no samples, no CUDA device): exit code 4.
class UnverifiedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The job under test broke while lossguard ran it (a rank of a real replay raised): exit code 3,
// the message naming the rank.
class JobFaultError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A broken internal invariant: a lossguard bug. Exit code 2, with the source location.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// A failure crossing a plugin boundary travels as data (a kind beside the message), so that an
// internal failure (out of memory, a CUDA error) is not reported as bad input on the other side.
enum class ErrorKind { kNone, kInput, kUnverified, kInternal };
inline ErrorKind error_kind_of(const std::exception& e) {
  if (dynamic_cast<const InputError*>(&e) != nullptr) return ErrorKind::kInput;
  if (dynamic_cast<const UnverifiedError*>(&e) != nullptr) return ErrorKind::kUnverified;
  return ErrorKind::kInternal;
}
// Throws the exception of `kind` (kNone: nothing).
inline void rethrow_error(ErrorKind kind, const std::string& message) {
  switch (kind) {
    case ErrorKind::kNone:
      return;
    case ErrorKind::kInput:
      throw InputError(message);
    case ErrorKind::kUnverified:
      throw UnverifiedError(message);
    case ErrorKind::kInternal:
      throw InternalError(message);
  }
}

template <typename... Args>
[[noreturn]] void throw_input_error(fmt::format_string<Args...> f, Args&&... args) {
  throw InputError(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace lossguard

// Checks an internal invariant; throws InternalError naming file:line, the condition and a message.
#define LG_CHECK(cond, ...)                                                                        \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      throw ::lossguard::InternalError(::fmt::format(                                              \
          "{}:{}: check `{}` failed: {}", __FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__))); \
    }                                                                                              \
  } while (0)
