// `lossguard postmortem`: why a distributed job hung, from its PyTorch Flight Recorder dumps
// (SPEC §12).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <utility>

#include "cli/command.h"
#include "cli/postmortem_render.h"
#include "io/flight_recorder.h"
#include "oracle/postmortem/postmortem.h"

namespace lossguard::cli {

namespace {

struct PostmortemOptions {
  std::vector<std::string> paths;
  oracle::PostmortemOptions analysis;      // --frames, --max-divergences, --naming-max-world
  int64_t world = 0;                       // 0: not given
  int64_t tp = 0, pp = 0, cp = 0, dp = 0;  // 0: not given; any one given sets the layout (1s)

  oracle::JobShape shape() const {
    oracle::JobShape s;
    if (world > 0) s.world = world;
    if (tp > 0 || pp > 0 || cp > 0 || dp > 0) {
      s.layout = oracle::Topology(std::max<int64_t>(tp, 1), std::max<int64_t>(pp, 1),
                                  std::max<int64_t>(cp, 1), std::max<int64_t>(dp, 1));
    }
    return s;
  }
};

void run_postmortem(const PostmortemOptions& o, Report& report, Context& ctx) {
  const auto t0 = std::chrono::steady_clock::now();
  bool shown = false;
  FrJob job = io::read_flight_records(o.paths, [&](std::size_t done, std::size_t total) {
    if (!ctx.err_is_terminal || total < 64 || (done % 64 != 0 && done != total)) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ctx.err << fmt::format("\r\x1b[Kreading dumps {}/{} ({:.1f} s)", done, total, s) << std::flush;
    shown = true;
  });
  if (shown) ctx.err << "\r\x1b[K" << std::flush;
  const oracle::PostmortemResult r = oracle::postmortem(std::move(job), o.shape(), o.analysis);
  for (const auto& d : r.job.ranks) report.add_input(d.path, "flight-recorder-" + d.format);
  render_postmortem_text(ctx.out, r);
  auto& res = report.results();
  const nlohmann::ordered_json doc = postmortem_json(r);
  for (auto it = doc.begin(); it != doc.end(); ++it) res[it.key()] = *it;
  const Judgement judgement = r.judgement();
  if (judgement.unverified.empty()) {
    report.add_case({"lossguard.postmortem", "ranks_aligned", !r.diverged(),
                     r.diverged() && r.root ? r.root->summary : "", false});
  }
  report.record(judgement);
}

}  // namespace

void register_postmortem(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<PostmortemOptions>();
  CLI::App* app = root.add_subcommand(
      "postmortem",
      "Why a distributed job hung: its PyTorch Flight Recorder dumps aligned per process group, "
      "the "
      "first divergence, the culprit ranks and the skip-decision protocol that explains it");
  cmd->app = app;
  app->add_option("dumps", opts->paths,
                  "One dump per rank (pickle or JSON), a directory of them, or their common prefix "
                  "(TORCH_FR_DUMP_TEMP_FILE); a dump's rank is the number its name ends in")
      ->required();
  app->add_option("--frames", opts->analysis.frames,
                  "Stack frames shown per call (the job's own code first)")
      ->check(CLI::Range(int64_t{0}, int64_t{1000}))
      ->capture_default_str();
  app->add_option("--max-divergences", opts->analysis.listed_divergences,
                  "Divergences listed in the text after the first (--json has them all)")
      ->check(CLI::Range(int64_t{0}, kMaxCount))
      ->capture_default_str();
  app->add_option("--world", opts->world,
                  "The job's number of ranks, where the dumps do not state it (Gloo's never do): "
                  "a rank without a dump is then seen missing")
      ->check(CLI::Range(int64_t{1}, kMaxFrWorld));
  for (auto [name, size, what] : {std::tuple{"--tp", &opts->tp, "Tensor-parallel size"},
                                  std::tuple{"--pp", &opts->pp, "Pipeline-parallel size"},
                                  std::tuple{"--cp", &opts->cp, "Context-parallel size"},
                                  std::tuple{"--dp", &opts->dp, "Data-parallel size"}}) {
    app->add_option(name, *size,
                    fmt::format("{} of the job's layout (Megatron order tp-cp-dp-pp; the sizes "
                                "not given are 1): the world, and the members of its groups",
                                what))
        ->check(CLI::Range(int64_t{1}, kMaxFrWorld));
  }
  app->add_option("--naming-max-world", opts->analysis.naming_max_world,
                  "Largest world in which the divergence is matched against the skip-decision "
                  "protocols (a simulation per layout and protocol)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app->footer(
      "Turn Flight Recorder on in the job (every rank):\n"
      "  TORCH_FR_BUFFER_SIZE=2000                 calls kept per rank (0 turns it off)\n"
      "  TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/trace_    where dumps go: <prefix><rank>\n"
      "  TORCH_NCCL_DUMP_ON_TIMEOUT=1              NCCL: the watchdog dumps on a collective "
      "timeout\n"
      "and dump on the job's own error path (Gloo has no watchdog dump):\n"
      "  except Exception:\n"
      "      torch._C._distributed_c10d._dump_fr_trace_file(dist.get_rank(), True, True, False)\n"
      "      raise\n"
      "Reads the pickle torch writes (never running it: a pickle that would run code is refused)\n"
      "and the JSON of _dump_fr_trace_json. The world and the groups' members are never guessed:\n"
      "NCCL's dumps list them (pg_config); Gloo's list none, so give --world N or the layout\n"
      "(--tp/--pp/--cp/--dp): groups Megatron names (group_desc MODEL_PARALLEL_GROUP, ...) and\n"
      "groups whose callers are one group of the layout get their members from it; others only\n"
      "the ranks seen calling on them, marked *. A rank without a dump is a suspect.\n"
      "The culprit is found by causality: the rank short on a group where the others wait, a\n"
      "missing dump that explains the waits, or a cycle of waits (both sides shown); the time a\n"
      "call was created only breaks a tie, and the report says so.\n"
      "Give subgroups a timeout (new_group(..., timeout=)) so a waiting rank dumps.\n"
      "Exit codes: 3 the ranks diverged; 0 every member of every group present and matched\n"
      "through the last call, the world known; 4 nothing verified (no collective recorded, or no\n"
      "divergence while the world is unknown, ranks left no dump or some group's members are\n"
      "unknown: a hung job is never green); 2 unreadable or inconsistent dumps.\n"
      "Examples:\n"
      "  lossguard postmortem /tmp/fr/\n"
      "  lossguard postmortem /tmp/fr/trace_ --tp 2 --pp 2 --dp 2 --json report.json\n"
      "  lossguard postmortem /tmp/fr/ --world 16\n"
      "More: docs/postmortem.md");
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_postmortem(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
