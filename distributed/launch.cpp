// The launcher environment, outcome serialisation and the plugin loader (no LibTorch here).
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/plugin_loader.h"
#include "distributed/real_replay.h"
#include "lossguard/build_config.h"
#include "lossguard/plugin_paths.h"

namespace lossguard::distributed {

namespace {
std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}
int64_t env_int(const char* name, bool required, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    if (required) {
      throw_input_error(
          "real-mode replay needs ${} (launch with torchrun --no-python lossguard replay ..., or "
          "set RANK, "
          "WORLD_SIZE, MASTER_ADDR and MASTER_PORT)",
          name);
    }
    return fallback;
  }
  try {
    std::size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used != std::string(v).size() || x < 0) throw std::invalid_argument("bad");
    return x;
  } catch (const std::exception&) {
    throw_input_error("${} = '{}' is not a natural number", name, v);
  }
}
}  // namespace

LaunchEnv launch_env_from_environment() {
  LaunchEnv e;
  e.rank = env_int("RANK", true, 0);
  e.world_size = env_int("WORLD_SIZE", true, 1);
  e.local_rank = env_int("LOCAL_RANK", false, e.rank);
  e.master_addr = env_or("MASTER_ADDR", "127.0.0.1");
  e.port = static_cast<int>(env_int("MASTER_PORT", true, 29500));
  e.agent_store = env_or("TORCHELASTIC_USE_AGENT_STORE", "") == "True";
  e.run_id = "lossguard/" + env_or("TORCHELASTIC_RUN_ID", "run") + "/" +
             env_or("TORCHELASTIC_RESTART_COUNT", "0");
  e.error_file = env_or("TORCHELASTIC_ERROR_FILE", "");
  if (e.rank >= e.world_size)
    throw_input_error("$RANK = {} is not below $WORLD_SIZE = {}", e.rank, e.world_size);
  if (e.port <= 0 || e.port > 65535)
    throw_input_error("$MASTER_PORT = {} is not a TCP port", e.port);
  return e;
}

void write_error_file(const LaunchEnv& env, const std::string& message) {
  if (env.error_file.empty()) return;
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  nlohmann::json j = {
      {"message",
       {{"message", message},
        {"extraInfo",
         {{"py_callstack", "(lossguard, C++)"},
          {"timestamp",
           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}}}}}};
  std::ofstream f(env.error_file, std::ios::trunc);
  f << j.dump() << "\n";
}

std::string rank_result_to_json(const oracle::RankResult& r) {
  nlohmann::json j = {{"rank", r.rank},
                      {"outcome", static_cast<int>(r.outcome)},
                      {"optimizer_stepped", r.optimizer_stepped},
                      {"scheduler_stepped", r.scheduler_stepped},
                      {"update_successful", r.update_successful},
                      {"unsynced_gradients", r.unsynced_gradients},
                      {"summary", r.summary},
                      {"detail", r.detail}};
  j["skip"] = r.skip ? nlohmann::json(*r.skip) : nlohmann::json(nullptr);
  j["grad_norm"] = r.grad_norm ? nlohmann::json(*r.grad_norm) : nlohmann::json(nullptr);
  return j.dump();
}

oracle::RankResult rank_result_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  oracle::RankResult r;
  r.rank = j.at("rank").get<int64_t>();
  r.outcome = static_cast<oracle::Outcome>(j.at("outcome").get<int>());
  r.optimizer_stepped = j.at("optimizer_stepped").get<bool>();
  r.scheduler_stepped = j.at("scheduler_stepped").get<bool>();
  r.update_successful = j.at("update_successful").get<bool>();
  r.unsynced_gradients = j.value("unsynced_gradients", false);
  r.summary = j.at("summary").get<std::string>();
  r.detail = j.at("detail").get<std::string>();
  if (!j.at("skip").is_null()) r.skip = j.at("skip").get<bool>();
  if (!j.at("grad_norm").is_null()) r.grad_norm = j.at("grad_norm").get<double>();
  return r;
}

const DistApi& dist_api() {
  return *static_cast<const DistApi*>(
      load_plugin_table("the real-mode backends (liblossguard_distributed.so)", "LOSSGUARD_DIST",
                        LOSSGUARD_DIST_PLUGIN, "lossguard_dist_api", kDistAbiVersion));
}

JobVerdict publish_job_verdict(const RealReplayInput& in, int exit_code,
                               const std::string& reason) {
  dist_api().agree_exit_code(&in, exit_code);
  if (exit_code != 0) write_error_file(in.env, reason);
  return {exit_code, true};
}

JobVerdict follow_job_verdict(const RealReplayInput& in) {
  const int code = dist_api().agree_exit_code(&in, -1);
  JobVerdict v{code < 0 ? kExitFault : code, code >= 0};
  if (v.exit_code != 0) {
    write_error_file(
        in.env,
        fmt::format("lossguard replay rank {}: the job's verdict is exit code {}{}", in.env.rank,
                    v.exit_code, v.heard_from_rank0 ? "" : " (no verdict from rank 0)"));
  }
  return v;
}

}  // namespace lossguard::distributed
