// PyTorch Flight Recorder dumps (SPEC §12) read into a core::FrJob: the pickle torch writes
// (`_dump_fr_trace`, `_dump_fr_trace_file`, the NCCL watchdog's dump on timeout) through the
// restricted unpickler, which never runs the file's code, and the JSON form
// (`_dump_fr_trace_json`).
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/flight_record.h"

namespace lossguard::io {

// Each path is a dump file, a directory (its files whose names end in a rank number), or a prefix
// as TORCH_FR_DUMP_TEMP_FILE is (`/tmp/trace_` stands for /tmp/trace_0, /tmp/trace_1, ...). A
// file's rank is the number its name ends in (before a .json, .pkl or .pickle extension).
std::vector<std::pair<std::string, int64_t>> flight_record_files(
    const std::vector<std::string>& paths);

// Reads one dump. Throws InputError naming the file (and the entry and field): not a pickle or JSON
// document, a pickle that would run code, a truncated file, a field missing or of the wrong type.
FrRankDump read_flight_record(const std::string& path, int64_t rank, FrJobBuilder& builder);
// The same from bytes already in memory (`what` names them in errors).
FrRankDump parse_flight_record(std::string_view bytes, const std::string& what, int64_t rank,
                               FrJobBuilder& builder);

// Every dump of a job, and the groups' membership. Throws InputError naming the files when two
// claim one rank, when their versions differ (mixed jobs or torch builds), or when two give one
// group different members. `progress(done, total)` is called as files are read.
FrJob read_flight_records(const std::vector<std::string>& paths,
                          const std::function<void(std::size_t, std::size_t)>& progress = {});

}  // namespace lossguard::io
