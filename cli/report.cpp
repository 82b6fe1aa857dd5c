// Report: verdict, exit code, JSON and JUnit output.
#include "cli/report.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <functional>

#include "lossguard/build_config.h"

namespace lossguard::cli {

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::kPass:
      return "pass";
    case Verdict::kFail:
      return "fail";
    case Verdict::kError:
      return "error";
    case Verdict::kFault:
      return "fault";
    case Verdict::kUnverified:
      return "unverified";
  }
  return "?";
}

void add_output_options(CLI::App& app, OutputOptions& o) {
  app.add_option("--json", o.json_path,
                 "Write the versioned JSON report (schema lossguard/1) to FILE, or - for stdout")
      ->type_name("FILE|-");
  app.add_option("--junit", o.junit_path, "Write JUnit XML (one test case per check) to FILE")
      ->type_name("FILE");
}

Report::Report(std::string command) : command_(std::move(command)) {}

void Report::error(const std::string& message) {
  errored_ = true;
  errors_.push_back(message);
}

void Report::record(const Judgement& judgement) {
  if (!judgement.unverified.empty()) throw UnverifiedError(judgement.unverified);
  verified_ = true;
  failed_ = failed_ || judgement.failed;
  faulted_ = faulted_ || judgement.faulted;
}

void Report::fault_error(const std::string& message) {
  faulted_ = true;
  error(message);
}

void Report::unverified(const std::string& reason) {
  unverified_ = true;
  unverified_reason_ = reason;
}

Verdict Report::verdict() const {
  if (faulted_) return Verdict::kFault;
  if (failed_) return Verdict::kFail;
  if (errored_) return Verdict::kError;
  if (unverified_ || !verified_) return Verdict::kUnverified;
  return Verdict::kPass;
}

int Report::exit_code() const {
  if (forced_exit_code_ >= 0) return forced_exit_code_;
  switch (verdict()) {
    case Verdict::kPass:
      return kExitPass;
    case Verdict::kFail:
      return kExitFail;
    case Verdict::kError:
      return kExitError;
    case Verdict::kFault:
      return kExitFault;
    case Verdict::kUnverified:
      return kExitUnverified;
  }
  return kExitError;
}

void Report::add_input(const std::string& path, const std::string& format) {
  inputs_.push_back({{"path", path}, {"format", format}});
}

void Report::add_findings(const std::vector<oracle::Finding>& f) {
  findings_.insert(findings_.end(), f.begin(), f.end());
}

nlohmann::ordered_json Report::to_json() const {
  nlohmann::ordered_json j;
  j["schema"] = "lossguard/1";
  j["command"] = command_;
  j["verdict"] = verdict_name(verdict());
  j["exit_code"] = exit_code();
  j["tool_version"] = LOSSGUARD_VERSION;
  j["inputs"] = inputs_;
  nlohmann::ordered_json f = nlohmann::ordered_json::array();
  for (const auto& x : findings_) {
    nlohmann::ordered_json e = {{"kind", x.kind}, {"message", x.message}};
    for (auto it = x.detail.begin(); it != x.detail.end(); ++it) e[it.key()] = it.value();
    f.push_back(e);
  }
  j["findings"] = f;
  if (!errors_.empty()) j["errors"] = errors_;
  if (unverified_) j["unverified_reason"] = unverified_reason_;
  for (auto it = results_.begin(); it != results_.end(); ++it) j[it.key()] = it.value();
  for (const auto& [key, text] : raw_results_)
    j[key] = nlohmann::ordered_json::parse(std::string_view(text.data(), text.size()));
  if (!raw_values_.empty()) {
    // Placeholders (raw_value) replaced by their values, wherever they sit.
    std::function<void(nlohmann::ordered_json&)> fill = [&](nlohmann::ordered_json& node) {
      if (node.is_string()) {
        const std::string& sv = node.get_ref<const std::string&>();
        if (sv.rfind("\x01lossguard-raw-", 0) != 0) return;
        for (const auto& [token, text] : raw_values_) {
          if (token == sv) {
            node = nlohmann::ordered_json::parse(std::string_view(text.data(), text.size()));
            return;
          }
        }
      } else if (node.is_structured()) {
        for (auto& child : node) fill(child);
      }
    };
    fill(j);
  }
  return j;
}

namespace {
std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&apos;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t')
          o += ' ';
        else
          o += c;
    }
  }
  return o;
}
}  // namespace

std::string Report::to_junit() const {
  int failures = 0, skipped = 0;
  std::vector<JunitCase> cases = cases_;
  for (const auto& e : errors_) cases.push_back({"lossguard." + command_, "run", false, e, false});
  for (const auto& c : cases) {
    failures += !c.ok && !c.skipped;
    skipped += c.skipped;
  }
  std::string x = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  x += fmt::format("<testsuites name=\"lossguard\" tests=\"{}\" failures=\"{}\" skipped=\"{}\">\n",
                   cases.size(), failures, skipped);
  x += fmt::format(
      "  <testsuite name=\"lossguard.{}\" tests=\"{}\" failures=\"{}\" skipped=\"{}\">\n",
      xml_escape(command_), cases.size(), failures, skipped);
  for (const auto& c : cases) {
    x += fmt::format("    <testcase classname=\"{}\" name=\"{}\"", xml_escape(c.classname),
                     xml_escape(c.name));
    if (c.skipped) {
      x += fmt::format("><skipped message=\"{}\"/></testcase>\n", xml_escape(c.message));
    } else if (!c.ok) {
      x +=
          fmt::format("><failure message=\"{}\">{}</failure></testcase>\n",
                      xml_escape(c.message.substr(0, c.message.find('\n'))), xml_escape(c.message));
    } else {
      x += "/>\n";
    }
  }
  x += "  </testsuite>\n</testsuites>\n";
  return x;
}

void Report::write_outputs(const OutputOptions& o, std::ostream& out, std::ostream& err) {
  if (suppress_outputs_) return;
  if (!o.json_path.empty()) {
    // The tree, then the raw fields written in before its closing brace (never copied into it).
    std::string head;
    {
      auto raw = std::move(raw_results_);
      auto values = std::move(raw_values_);
      raw_results_.clear();
      raw_values_.clear();
      // Input text that is not UTF-8 (a dump's frame name) is replaced, never a throw.
      head = to_json().dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
      raw_results_ = std::move(raw);
      raw_values_ = std::move(values);
    }
    // Where each raw_value placeholder landed in the text (as nlohmann writes it: "\u0001...").
    std::vector<std::pair<std::size_t, const std::pair<std::string, fmt::memory_buffer>*>> at;
    for (const auto& rv : raw_values_) {
      const std::string quoted = nlohmann::ordered_json(rv.first).dump();
      const std::size_t pos = head.find(quoted);
      if (pos != std::string::npos) at.emplace_back(pos, &rv);
    }
    std::sort(at.begin(), at.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    const bool splice = !raw_results_.empty() && !head.empty() && head.back() == '}';
    if (splice) {
      head.pop_back();
      while (!head.empty() && head.back() == '\n') head.pop_back();
    }
    auto write = [&](std::ostream& s) -> bool {
      std::size_t from = 0;
      for (const auto& [pos, rv] : at) {
        s.write(head.data() + from, static_cast<std::streamsize>(pos - from));
        s.write(rv->second.data(), static_cast<std::streamsize>(rv->second.size()));
        from = pos + nlohmann::ordered_json(rv->first).dump().size();
      }
      s.write(head.data() + from, static_cast<std::streamsize>(head.size() - from));
      if (splice) {
        for (const auto& [key, raw] : raw_results_)
          (s << ",\n  " << nlohmann::ordered_json(key).dump() << ": ")
              .write(raw.data(), static_cast<std::streamsize>(raw.size()));
        s << "\n}";
      }
      s << "\n";
      return static_cast<bool>(s);
    };
    if (o.json_path == "-") {
      write(out);
    } else {
      std::ofstream f(o.json_path, std::ios::trunc);
      // A CI gate reads this file: one that cannot be written is an error (exit 2), never a silent
      // pass.
      if (!f || !write(f)) {
        error("cannot write the JSON report to " + o.json_path);
        err << "lossguard: error: cannot write the JSON report to " << o.json_path << "\n";
      }
    }
  }
  if (!o.junit_path.empty()) {
    std::ofstream f(o.junit_path, std::ios::trunc);
    if (!(f << to_junit())) {
      error("cannot write the JUnit report to " + o.junit_path);
      err << "lossguard: error: cannot write the JUnit report to " << o.junit_path << "\n";
    }
  }
}

void print_findings(std::ostream& out, const std::vector<oracle::Finding>& findings) {
  if (findings.empty()) return;
  out << fmt::format("\nfindings ({}):\n", findings.size());
  for (const auto& f : findings) out << "  [" << f.kind << "] " << f.message << "\n";
}

}  // namespace lossguard::cli
