// Interning of a Flight Recorder job's groups, signatures and stacks; operation names normalised.
#include "core/flight_record.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>

namespace lossguard {

FrJobBuilder::FrJobBuilder() { job_.stacks.emplace_back(); }

uint32_t FrJobBuilder::group(const std::string& name, const std::string& desc) {
  auto [it, fresh] = groups_.try_emplace(name, static_cast<uint32_t>(job_.groups.size()));
  if (fresh) {
    FrGroup g;
    g.name = name;
    g.desc = desc;
    job_.groups.push_back(std::move(g));
  } else if (job_.groups[it->second].desc.empty() || job_.groups[it->second].desc == "undefined") {
    job_.groups[it->second].desc = desc;
  }
  return it->second;
}

uint32_t FrJobBuilder::signature(FrSignature s) {
  std::string key = fmt::format("{}|{}|{}|{}|{}", s.profiling_name, s.input_sizes, s.output_sizes,
                                fmt::join(s.input_dtypes, ","), fmt::join(s.output_dtypes, ","));
  auto [it, fresh] = signatures_.try_emplace(std::move(key), 0);
  if (fresh) {
    it->second = static_cast<uint32_t>(job_.signatures.size());
    job_.signatures.push_back(std::move(s));
  }
  return it->second;
}

uint32_t FrJobBuilder::stack(std::vector<FrFrame> frames) {
  if (frames.empty()) return 0;
  std::string key;
  for (const auto& f : frames) key += fmt::format("{}\x1f{}\x1f{}\x1e", f.name, f.filename, f.line);
  auto [it, fresh] = stacks_.try_emplace(std::move(key), 0);
  if (fresh) {
    it->second = static_cast<uint32_t>(job_.stacks.size());
    job_.stacks.push_back(std::move(frames));
  }
  return it->second;
}

uint32_t FrJobBuilder::signature_by_key(const std::string& key,
                                        const std::function<FrSignature()>& make) {
  if (auto it = signature_keys_.find(key); it != signature_keys_.end()) return it->second;
  const uint32_t id = signature(make());
  signature_keys_.emplace(key, id);
  return id;
}

uint32_t FrJobBuilder::stack_by_key(const std::string& key,
                                    const std::function<std::vector<FrFrame>()>& make) {
  if (auto it = stack_keys_.find(key); it != stack_keys_.end()) return it->second;
  const uint32_t id = stack(make());
  stack_keys_.emplace(key, id);
  return id;
}

namespace {

// The spellings PyTorch's backends and hooks record for one operation (ProcessGroupNCCL,
// ProcessGroupGloo, c10d's FlightRecorderHook; torch/distributed/flight_recorder/components/
// types.py's COLLECTIVES lists them).
std::string normalise_op(std::string op) {
  std::transform(op.begin(), op.end(), op.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  static const std::pair<const char*, const char*> kAliases[] = {
      {"allreduce", "all_reduce"},
      {"allreduce_coalesced", "all_reduce"},
      {"all_reduce_coalesced", "all_reduce"},
      {"allreduce_sparse", "all_reduce"},
      {"_allgather_base", "all_gather"},
      {"_all_gather_base", "all_gather"},
      {"allgather", "all_gather"},
      {"all_gather_into_tensor", "all_gather"},
      {"all_gather_into_tensor_coalesced", "all_gather"},
      {"allgather_coalesced", "all_gather"},
      {"allgather_into_tensor_coalesced", "all_gather"},
      {"_reduce_scatter_base", "reduce_scatter"},
      {"reducescatter", "reduce_scatter"},
      {"reduce_scatter_tensor", "reduce_scatter"},
      {"reduce_scatter_tensor_coalesced", "reduce_scatter"},
      {"alltoall", "all_to_all"},
      {"alltoall_base", "all_to_all"},
      {"all_to_all_single", "all_to_all"},
      {"alltoallv", "all_to_all"},
  };
  for (const auto& [from, to] : kAliases) {
    if (op == from) return to;
  }
  return op;
}

std::optional<int32_t> parse_peer(const std::string& s) {
  if (s == "?") return -1;
  if (s.empty() || s.size() > 9) return std::nullopt;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  return static_cast<int32_t>(std::stol(s));
}

}  // namespace

std::optional<FrOpName> parse_profiling_name(const std::string& profiling_name) {
  const auto colon = profiling_name.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  FrOpName out;
  out.backend = profiling_name.substr(0, colon);
  std::string rest = profiling_name.substr(colon + 1);
  const auto space = rest.find(' ');
  std::string meta;
  if (space != std::string::npos) {
    meta = rest.substr(space + 1);
    rest = rest.substr(0, space);
  }
  if (rest.empty()) return std::nullopt;
  out.op = normalise_op(rest);
  if (out.op == "send" || out.op == "recv") {
    const bool send = out.op == "send";
    const auto arrow = meta.find(send ? "->" : "<-");
    if (arrow == std::string::npos) return std::nullopt;
    auto a = parse_peer(meta.substr(0, arrow));
    auto b = parse_peer(meta.substr(arrow + 2));
    if (!a || !b) return std::nullopt;
    // "send src->dst", "recv dst<-src"
    out.src = send ? *a : *b;
    out.dst = send ? *b : *a;
  }
  return out;
}

}  // namespace lossguard
