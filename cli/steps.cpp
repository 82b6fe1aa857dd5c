// Per-step runs of a command over a dump that holds several optimizer steps.
#include "cli/steps.h"

#include <fmt/format.h>

#include "core/errors.h"

namespace lossguard::cli {

int64_t global_batch_size_of(int64_t given, const Batch& b) {
  if (given != 0) return given;
  const auto it = b.metadata.find("global_batch_size");
  return it != b.metadata.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
}

void run_per_step(const Batch& b, int64_t only_step, Report& report, Context& ctx,
                  const std::function<void(const StepView&)>& body) {
  if (b.steps.empty()) {
    if (only_step > 0)
      throw_input_error("--step {}: the dumps hold one step (step 0), with no step structure",
                        only_step);
    StepView v;
    v.batch = &b;
    body(v);
    return;
  }
  const auto num_steps = static_cast<int64_t>(b.steps.size());
  if (only_step >= num_steps)
    throw_input_error("--step {}: the dumps hold steps 0 to {}", only_step, num_steps - 1);
  const bool several = only_step < 0 && num_steps > 1;
  nlohmann::ordered_json steps_json = nlohmann::ordered_json::array();
  for (const BatchStep& st : b.steps) {
    if (only_step >= 0 && st.step != only_step) continue;
    // The step's samples renumbered from 0, and its layout in those numbers.
    std::vector<int64_t> local_of(static_cast<std::size_t>(b.num_samples()), -1);
    for (std::size_t k = 0; k < st.samples.size(); ++k)
      local_of[st.samples[k]] = static_cast<int64_t>(k);
    // A step holding every sample in order is the batch itself (no copy of its logits).
    bool whole = static_cast<int64_t>(st.samples.size()) == b.num_samples();
    for (std::size_t k = 0; whole && k < st.samples.size(); ++k)
      whole = st.samples[k] == static_cast<int64_t>(k);
    const Batch step_copy = whole ? Batch{} : b.subset(st.samples);
    const Batch& step_batch = whole ? b : step_copy;
    Placement layout = st.placement;
    for (auto& rank : layout)
      for (auto& mb : rank)
        for (int64_t& i : mb) i = local_of[i];
    StepView v;
    v.step = st.step;
    v.batch = &step_batch;
    v.layout = st.placement.empty() ? nullptr : &layout;
    v.layout_source = st.source;
    v.global_batch_size = st.global_batch_size;
    v.num_steps = num_steps;
    if (several) {
      std::string which;
      for (std::size_t k = 0; k < st.samples.size() && k < 12; ++k)
        which += (k ? ", " : "") + std::to_string(st.samples[k]);
      if (st.samples.size() > 12) which += ", ...";
      ctx.out << fmt::format(
          "{}== step {} of {}: {} samples (the dumps' samples {}; numbered from 0 below) ==\n",
          st.step == 0 ? "" : "\n", st.step, num_steps, st.samples.size(), which);
      report.set_case_prefix(fmt::format("step {}: ", st.step));
    }
    body(v);
    if (several) {
      nlohmann::ordered_json one = {{"step", st.step}};
      for (auto it = report.results().begin(); it != report.results().end(); ++it) {
        // A command that already reports its one step under "steps" (weights) is flattened.
        if (it.key() == "steps" && it.value().is_array() && it.value().size() == 1) {
          for (auto jt = it.value()[0].begin(); jt != it.value()[0].end(); ++jt)
            if (jt.key() != "step") one[jt.key()] = jt.value();
          continue;
        }
        one[it.key()] = it.value();
      }
      for (auto& [key, text] : report.take_raw_results())
        one[key] = nlohmann::ordered_json::parse(std::string_view(text.data(), text.size()));
      steps_json.push_back(std::move(one));
      report.results() = nlohmann::ordered_json::object();
    }
  }
  if (several) {
    report.set_case_prefix("");
    report.results()["steps"] = std::move(steps_json);
  } else {
    report.results()["step"] = only_step >= 0 ? only_step : b.steps.front().step;
  }
}

}  // namespace lossguard::cli
