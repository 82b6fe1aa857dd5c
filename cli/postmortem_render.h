// `postmortem`'s result as text (the divergence, the culprit ranks and their last frames, the
// matched protocol) and as the JSON document's results.
#pragma once
#include <nlohmann/json.hpp>
#include <ostream>

#include "core/flight_record.h"
#include "oracle/postmortem/postmortem.h"

namespace lossguard::cli {

struct PostmortemRenderOptions {
  int64_t frames = 4;             // frames shown per call (the job's own first; 0: none)
  int64_t shown_divergences = 5;  // in the text
};

void render_postmortem_text(std::ostream& out, const FrJob& job, const oracle::PostmortemResult& r,
                            const PostmortemRenderOptions& o);
nlohmann::ordered_json postmortem_json(const FrJob& job, const oracle::PostmortemResult& r,
                                       const PostmortemRenderOptions& o);

}  // namespace lossguard::cli
