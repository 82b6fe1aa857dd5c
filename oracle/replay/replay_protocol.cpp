// The protocols' descriptions and parts (oracle/replay/replay_protocol.h).
#include "oracle/replay/replay_protocol.h"

namespace lossguard::oracle {

const char* protocol_description(Protocol p) {
  switch (p) {
    case Protocol::kPr285:
      return "token count all-reduced over DP+CP, flag broadcast from the pipeline last rank "
             "(Relax "
             "after PR #285; correct)";
    case Protocol::kPr285SrcLocal:
      return "as pr285, broadcast src = PP-1: a stage index used as a global rank";
    case Protocol::kPr285AlwaysBroadcast:
      return "as pr285-src-local, broadcasting even when PP = 1";
    case Protocol::kValues0:
      return "decides on values[0]: a sample count when per-token loss is off";
    case Protocol::kNoSkip:
      return "never skips (Megatron baseline)";
    case Protocol::kMicrobatchSkip:
      return "a micro-batch skips its backward when its count all-reduced over DP+CP is 0 "
             "(correct, unless that backward is the one issuing the gradient all-reduce)";
    case Protocol::kMicrobatchSkipLocal:
      return "a micro-batch skips its backward when this rank's own count is 0 (the DDP gradient "
             "all-reduce is then issued by some ranks only)";
    case Protocol::kMicrobatchesMax:
      return "micro-batch count all-reduced (MAX) over DP, dummy micro-batches counting 0 tokens "
             "pad the lighter ranks (Relax __is_dummy__; correct)";
    case Protocol::kMicrobatchesLocal:
      return "every DP rank runs the micro-batches it has (the lighter rank leaves early)";
    case Protocol::kNanSkip:
      return "skip when the grad norm, all-reduced over the model-parallel group, is not finite "
             "(Megatron; correct)";
    case Protocol::kNanSkipLocal:
      return "skip when this rank's own gradient is not finite, before the norm's all-reduce";
    case Protocol::kNanSkipRank0:
      return "rank 0 checks its own gradient and broadcasts the decision";
    case Protocol::kFlagBroadcast:
      return "as pr285, the flag also broadcast on --flag-group from dist.get_global_rank(group, "
             "0) "
             "(correct)";
    case Protocol::kFlagBroadcastSrcLocal:
      return "as flag-broadcast with src = 0: a group-local index used as a global rank";
  }
  return "?";
}

ProtocolParts protocol_parts(Protocol p) {
  switch (p) {
    case Protocol::kMicrobatchSkip:
      return {Loop::kSkipGlobal, NanCheck::kNone, false};
    case Protocol::kMicrobatchSkipLocal:
      return {Loop::kSkipLocal, NanCheck::kNone, false};
    case Protocol::kMicrobatchesMax:
      return {Loop::kCountMax, NanCheck::kNone, false};
    case Protocol::kMicrobatchesLocal:
      return {Loop::kCountLocal, NanCheck::kNone, false};
    case Protocol::kNanSkip:
      return {Loop::kPlain, NanCheck::kAfterAllReduce, false};
    case Protocol::kNanSkipLocal:
      return {Loop::kPlain, NanCheck::kLocal, false};
    case Protocol::kNanSkipRank0:
      return {Loop::kPlain, NanCheck::kRank0, false};
    case Protocol::kFlagBroadcast:
    case Protocol::kFlagBroadcastSrcLocal:
      return {Loop::kNone, NanCheck::kNone, true};
    default:
      return {};
  }
}

}  // namespace lossguard::oracle
