// `postmortem`'s result as text (the divergence, the culprit ranks and their last frames, the
// matched protocol) and as the JSON document's results. Both only read the result, which was
// composed under the command's options (oracle::PostmortemOptions: the frames and divergences the
// text shows); the JSON holds every divergence kept and every frame of the culprits' last calls.
#pragma once
#include <nlohmann/json.hpp>
#include <ostream>

#include "oracle/postmortem/postmortem.h"

namespace lossguard::cli {

void render_postmortem_text(std::ostream& out, const oracle::PostmortemResult& r);
nlohmann::ordered_json postmortem_json(const oracle::PostmortemResult& r);

}  // namespace lossguard::cli
