// `lossguard gen`: seeded synthetic batches in safetensors, torch.save or JSON (by the extension of
// --out).
#include <fmt/format.h>

#include "cli/command.h"
#include "core/errors.h"
#include "io/dump.h"
#include "synth/cases.h"

namespace lossguard::cli {

namespace {

struct GenCliOptions {
  std::string out_path;
  std::string case_name = "random";
  std::string dtype = "float32";
  bool list = false;
  synth::GenOptions gen;
};

void run_gen(GenCliOptions& o, CLI::App& app, Report& report, Context& ctx) {
  if (o.list) {
    for (const auto& c : synth::list_cases())
      ctx.out << fmt::format("{:<20} {}\n", c.name, c.description);
    report.record(Judgement::verified());
    return;
  }
  if (o.out_path.empty())
    throw InputError("gen: --out FILE is required (.safetensors, .pt or .json)");
  if (!parse_dtype(o.dtype, &o.gen.dtype)) throw_input_error("gen: unknown --dtype '{}'", o.dtype);
  if (o.case_name == "long-random") {  // larger defaults unless sizes were given
    if (app.count("--samples") == 0) o.gen.num_samples = 64;
    if (app.count("--max-prompt") == 0) o.gen.max_prompt = 512;
    if (app.count("--max-response") == 0) o.gen.max_response = 1024;
  }
  Batch batch = synth::make_case(o.case_name, o.gen);
  io::write_batch(batch, o.out_path);
  const int64_t effective = batch.num_effective_tokens();
  ctx.out << fmt::format(
      "wrote {}: case {}, seed {}, {} samples, {} tokens, {} response tokens, {} effective{}\n",
      o.out_path, o.case_name, o.gen.seed, batch.num_samples(), batch.tokens.size(),
      batch.num_response_tokens(), effective,
      batch.logits ? fmt::format(", logits [{}, {}] {}", batch.logits->shape[0],
                                 batch.logits->shape[1], dtype_name(batch.logits->dtype))
                   : "");
  report.add_input(o.out_path, "output");
  report.results()["case"] = o.case_name;
  report.results()["seed"] = o.gen.seed;
  report.results()["num_samples"] = batch.num_samples();
  report.results()["num_effective_tokens"] = effective;
  report.record(Judgement::verified());
}

}  // namespace

void register_gen(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<GenCliOptions>();
  CLI::App* app = root.add_subcommand(
      "gen", "Write a seeded synthetic batch: random, or a named edge case (--list)");
  cmd->app = app;
  app->footer(
      "The format follows the extension of --out: .safetensors, .pt (torch.save) or .json.\n"
      "Examples:\n  lossguard gen --out batch.safetensors --samples 100 --vocab 1000 --dtype "
      "bfloat16\n"
      "  lossguard gen --case zero-token --out zero.pt\n  lossguard gen --list");
  app->add_option("--out", opts->out_path, "Output file")->type_name("FILE");
  app->add_option("--case", opts->case_name, "Named case (see --list)")->capture_default_str();
  app->add_flag("--list", opts->list, "List the named cases");
  app->add_option("--seed", opts->gen.seed, "Random seed (recorded in the batch metadata)")
      ->capture_default_str();
  app->add_option("--samples", opts->gen.num_samples, "Number of samples")->capture_default_str();
  app->add_option("--min-prompt", opts->gen.min_prompt, "Shortest prompt")->capture_default_str();
  app->add_option("--max-prompt", opts->gen.max_prompt, "Longest prompt")->capture_default_str();
  app->add_option("--max-response", opts->gen.max_response, "Longest response")
      ->capture_default_str();
  app->add_option("--vocab", opts->gen.vocab_size, "Vocabulary size of the logits (0: no logits)")
      ->capture_default_str();
  app->add_flag("--masks-only", opts->gen.masks_only,
                "Write tokens, lengths and masks only (no logits, no per-token fields)");
  app->add_option("--dtype", opts->dtype,
                  "dtype of logits and per-token fields: float32, bfloat16, float16, float64")
      ->capture_default_str();
  add_output_options(*app, cmd->output);
  cmd->run = [opts, app](Report& r, Context& c) { run_gen(*opts, *app, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
