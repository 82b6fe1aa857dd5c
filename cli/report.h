// One report per command run: verdict flags, findings, the JSON document (SPEC §8), JUnit cases,
// and the single place where they become an exit code.
#pragma once
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/judgement.h"
#include "oracle/count/findings.h"

namespace CLI {
class App;
}

namespace lossguard::cli {

enum class Verdict { kPass, kFail, kError, kFault, kUnverified };
const char* verdict_name(Verdict v);

struct JunitCase {
  std::string classname;  // "lossguard.count"
  std::string name;       // "I1 cp=2"
  bool ok = true;
  std::string message;   // failure message
  bool skipped = false;  // not computed
};

struct OutputOptions {
  std::string json_path;  // "" none, "-" stdout
  std::string junit_path;
};
void add_output_options(CLI::App& app, OutputOptions& options);

class Report {
 public:
  explicit Report(std::string command);

  // Outcomes; the exit code is the most severe, ordered 3 > 1 > 2 > 4 (SPEC §8). A result's
  // judgement (decided by the library) is recorded as it is: nothing verified throws
  // UnverifiedError (cli/app.cpp reports it), else the check counts as run and its failure or fault
  // is kept.
  void record(const Judgement& judgement);
  void error(const std::string& message);
  void fault_error(const std::string& message);  // a JobFaultError: exit 3, the message kept
  void unverified(const std::string& reason);
  // A real-mode replay rank other than 0 exits with the code rank 0 decided, whatever it saw
  // itself.
  void force_exit_code(int code) { forced_exit_code_ = code; }
  void suppress_outputs() { suppress_outputs_ = true; }  // --json/--junit are rank 0's to write

  Verdict verdict() const;
  int exit_code() const;

  void add_input(const std::string& path, const std::string& format);
  void add_findings(const std::vector<oracle::Finding>& findings);
  void add_case(JunitCase c) {
    c.name = case_prefix_ + c.name;
    cases_.push_back(std::move(c));
  }
  void set_case_prefix(std::string prefix) { case_prefix_ = std::move(prefix); }
  nlohmann::ordered_json& results() { return results_; }  // command-specific fields
  // A large command-specific field rendered to JSON text by the command (count's per-sample rows):
  // written into the document as it is, so a 100,000-sample report is never built as a tree.
  void set_raw_result(const std::string& key, fmt::memory_buffer&& json_text) {
    raw_results_.emplace_back(key, std::move(json_text));
  }
  // The same anywhere in the tree: returns a placeholder string to store where the value goes
  // (weights' per-token rows under steps[k].samples); the text replaces it when written.
  std::string raw_value(fmt::memory_buffer&& json_text) {
    std::string token = "\x01lossguard-raw-" + std::to_string(raw_values_.size());
    raw_values_.emplace_back(token, std::move(json_text));
    return token;
  }
  std::vector<std::pair<std::string, fmt::memory_buffer>> take_raw_results() {
    return std::move(raw_results_);
  }
  const std::vector<oracle::Finding>& findings() const { return findings_; }

  nlohmann::ordered_json to_json() const;
  std::string to_junit() const;
  // Writes --json / --junit. JSON to "-" goes to `out`. Write failures are reported on `err`.
  void write_outputs(const OutputOptions& options, std::ostream& out, std::ostream& err);

 private:
  std::string command_;
  std::string case_prefix_;
  int forced_exit_code_ = -1;
  bool suppress_outputs_ = false;
  bool failed_ = false, faulted_ = false, errored_ = false, unverified_ = false, verified_ = false;
  std::vector<std::string> errors_;
  std::string unverified_reason_;
  nlohmann::ordered_json inputs_ = nlohmann::ordered_json::array();
  std::vector<oracle::Finding> findings_;
  std::vector<JunitCase> cases_;
  nlohmann::ordered_json results_ = nlohmann::ordered_json::object();
  std::vector<std::pair<std::string, fmt::memory_buffer>> raw_results_;
  std::vector<std::pair<std::string, fmt::memory_buffer>> raw_values_;  // (placeholder, text)
};

// Prints findings as indented lines under a heading; nothing when there are none.
void print_findings(std::ostream& out, const std::vector<oracle::Finding>& findings);

}  // namespace lossguard::cli
