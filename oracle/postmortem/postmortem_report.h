// What `postmortem`'s text and JSON print, composed from the analysis (postmortem_report.cpp):
// private to oracle/postmortem/, called once by analyse_flight_records.
#pragma once
#include "oracle/postmortem/postmortem.h"

namespace lossguard::oracle {

// Fills the sentences (each divergence's summary, each cycle step's), the headline's blamed ranks
// grouped by their last call, the issuers' call, the culprits' last calls and the frames each
// shows, under `options` (frames, listed_divergences), from `r.job` and the analysis already in
// `r`.
void compose_report(PostmortemResult& r, const PostmortemOptions& options);

}  // namespace lossguard::oracle
