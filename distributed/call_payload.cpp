// The tagged payload every real collective carries (collectives.h): [value, nonfinite, tag, check].
#include "distributed/collectives.h"

namespace lossguard::distributed {

int64_t call_tag(const oracle::CollectiveCall& call) {
  return 1 + 8 * static_cast<int64_t>(call.op) + static_cast<int64_t>(call.payload);
}

std::vector<int64_t> call_payload(const oracle::CollectiveCall& call) {
  const int64_t tag = call_tag(call);
  const int64_t check = call.op == oracle::Op::kAllReduceMax ? -tag
                        : call.op == oracle::Op::kBroadcast  ? 0
                                                             : tag * tag;
  return {call.value, call.nonfinite ? 1 : 0, tag, check};
}

CallResult read_result(const oracle::CollectiveCall& call, const std::vector<int64_t>& r,
                       int64_t n) {
  CallResult out;
  out.value = call.op == oracle::Op::kBarrier ? 0 : r[0];
  out.nonfinite = r[1] != 0;
  switch (call.op) {
    case oracle::Op::kAllReduceMax:
      out.mismatch = r[2] != -r[3];
      break;
    case oracle::Op::kBroadcast:
      out.mismatch = r[2] != call_tag(call);
      break;
    case oracle::Op::kBarrier:
      break;
    default:
      out.mismatch = r[2] * r[2] != n * r[3];
  }
  return out;
}

}  // namespace lossguard::distributed
