// Root command, option parsing and the one catch site that maps failures to exit codes.
#include "cli/app.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "cli/command.h"
#include "core/errors.h"
#include "core/printable.h"

namespace lossguard::cli {

namespace {

constexpr const char* kFooter =
    R"(Exit codes: 0 all checks passed; 1 a check failed (mismatch, broken invariant, wrong decision);
2 bad input or invocation; 3 distributed fault (error, deadlock, mismatch, timeout); 4 nothing verified.
When several apply: 3 > 1 > 2 > 4.

Dumps: safetensors (packed tensors), torch.save .pt (packed tensors, Relax/slime rollout and train dumps),
JSON ({"samples": [{"tokens": [...], "response_length": 3, "loss_mask": [1,0,1]}]}). Several dumps form one
global batch in the order given; a directory stands for its dump files in name order.

Examples:
  lossguard gen --case empty-responses --out batch.safetensors
  lossguard inspect batch.safetensors
  lossguard inspect rollout_0.pt --json report.json
Run `lossguard <command> --help` for each command's options. Semantics: docs/semantics.md in the repository.)";

// Every floating-point option of every command takes finite numbers only. CLI11's ranges let NaN
// through (every comparison with it is false), and a NaN tolerance then blamed a correct trainer
// ("2.2e-08 > nan"); added here once, so that no option added later forgets it.
void require_finite_numbers(CLI::App& app) {
  static const CLI::Validator kFinite(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end != text.c_str() && *end == '\0' && !std::isfinite(v))
          return fmt::format("{} is not a finite number", text);
        return {};
      },
      "FINITE");
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_type_name().find("FLOAT") != std::string::npos) opt->check(kFinite);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    require_finite_numbers(*sub);
}

class NullBuffer : public std::streambuf {
 protected:
  int overflow(int c) override { return c; }
};

}  // namespace

int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{
      "lossguard: verifies loss denominators, losses, gradients and the zero-token skip decision "
      "of "
      "context-parallel LLM training against an independent float64 oracle.",
      "lossguard"};
  app.footer(kFooter);
  app.require_subcommand(0, 1);
  bool show_version = false;
  app.add_flag("--version", show_version,
               "Print the version, LibTorch, CUDA and NCCL build flags and the device seen");
  Commands commands;
  register_inspect(app, commands);
  register_count(app, commands);
  register_check(app, commands);
  register_weights(app, commands);
  register_audit(app, commands);
  register_topo(app, commands);
  register_replay(app, commands);
  register_postmortem(app, commands);
  register_gen(app, commands);
  require_finite_numbers(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      app.exit(e, out, err);
      return kExitPass;
    }
    err << "lossguard: error: " << printable(e.what()) << "\n";
    err << "Run with --help for usage.\n";
    return kExitError;
  }
  if (show_version) {
    out << version_text();
    return kExitPass;
  }
  for (auto& cmd : commands) {
    if (!cmd->app->parsed()) continue;
    Report report(cmd->app->get_name());
    NullBuffer null_buffer;
    std::ostream null_stream(&null_buffer);
    const bool json_to_stdout = cmd->output.json_path == "-";
    Context ctx{json_to_stdout ? null_stream : out, err,
                &err == &std::cerr && isatty(STDERR_FILENO) == 1, !cmd->output.json_path.empty()};
    try {
      cmd->run(report, ctx);
    } catch (const JobFaultError& e) {
      report.fault_error(e.what());
      err << "lossguard: the job failed: " << printable(e.what()) << "\n";
    } catch (const InputError& e) {
      report.error(e.what());
      err << "lossguard: error: " << printable(e.what()) << "\n";
    } catch (const UnverifiedError& e) {
      report.unverified(e.what());
      err << "lossguard: nothing verified: " << printable(e.what()) << "\n";
    } catch (const InternalError& e) {
      report.error(std::string("internal error (a lossguard bug; please report it): ") + e.what());
      err << "lossguard: internal error (a lossguard bug; please report it): "
          << printable(e.what()) << "\n";
    } catch (const std::bad_alloc&) {
      report.error("out of memory");
      err << "lossguard: error: out of memory\n";
    } catch (const std::exception& e) {
      report.error(e.what());
      err << "lossguard: error: " << printable(e.what()) << "\n";
    }
    report.write_outputs(cmd->output, out, err);
    return report.exit_code();
  }
  out << app.help();
  return kExitError;
}

}  // namespace lossguard::cli
