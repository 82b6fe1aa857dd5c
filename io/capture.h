// The audit capture format (SPEC §10): one safetensors file per rank and step, written by
// lossguard-capture (python/) or any writer of the same tensors and metadata.
#pragma once
#include <string>
#include <vector>

#include "core/rank_capture.h"

namespace lossguard::io {

inline constexpr const char* kCaptureSchema = "audit/1";

// Reads one capture; throws InputError naming the file and the field (a missing required record, a
// wrong dtype or shape, lengths that do not add up).
RankCapture read_capture(const std::string& path);

// Every capture under `paths` (files, or directories searched recursively for *.safetensors whose
// metadata says lossguard.schema = audit/1), in path order.
std::vector<RankCapture> read_captures(const std::vector<std::string>& paths);

}  // namespace lossguard::io
