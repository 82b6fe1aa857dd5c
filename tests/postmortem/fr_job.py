"""A training step's collectives under torchrun (Gloo, CPU) with PyTorch's Flight Recorder on, as a
Megatron-style trainer issues them, and each rank dumping its recorder from its own error or
timeout path as a user's job would. Every scenario is one way the skip decision's participation
goes wrong (SPEC §7's protocols), written here from the protocol's text, not from lossguard's code.

  torchrun --nproc-per-node 4 fr_job.py --scenario seed-pp1-broadcast --out DIR

Layout (Megatron order tp-cp-dp-pp): rank = tp + TP*(cp + CP*(dp + DP*pp)). The job writes
DIR/fr_trace_rank_<rank> (pickle, via TORCH_FR_DUMP_TEMP_FILE) and DIR/json/rank_<rank>.json.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

SCENARIOS = {
    # name: (TP, CP, DP, PP, protocol, what goes wrong in the failing step)
    "clean": (2, 1, 1, 2, "pr285", None),
    "seed-pp1-broadcast": (1, 1, 4, 1, "pr285-always-broadcast", None),
    "src-local-pp2": (2, 1, 1, 2, "pr285-src-local", None),
    "local-count": (1, 1, 4, 1, "microbatch-skip-local", ("empty", 2)),
    "skip-optimizer": (2, 1, 2, 1, "nan-skip-local", ("nan", 1)),
}
STEPS = 3  # the last one fails (data-dependent scenarios); the others pass


def groups_of(tp_size, cp_size, dp_size, pp_size, timeout):
    """Every rank creates every group, in one order, as Megatron's parallel_state does."""
    def rank(tp, cp, dp, pp):
        return tp + tp_size * (cp + cp_size * (dp + dp_size * pp))

    me = dist.get_rank()
    mine = {}
    # pipeline groups: fixed tp, cp, dp
    for tp in range(tp_size):
        for cp in range(cp_size):
            for dp in range(dp_size):
                ranks = [rank(tp, cp, dp, pp) for pp in range(pp_size)]
                g = dist.new_group(ranks, group_desc="PIPELINE_MODEL_PARALLEL_GROUP", timeout=timeout)
                if me in ranks:
                    mine["pp"] = (g, ranks)
    # data parallel with context parallel: fixed tp, pp
    for tp in range(tp_size):
        for pp in range(pp_size):
            ranks = sorted(rank(tp, cp, dp, pp) for cp in range(cp_size) for dp in range(dp_size))
            g = dist.new_group(ranks, group_desc="DATA_PARALLEL_GROUP_WITH_CP", timeout=timeout)
            if me in ranks:
                mine["dp_cp"] = (g, ranks)
    # model parallel: fixed cp, dp (where the optimizer reduces its grad norm)
    for cp in range(cp_size):
        for dp in range(dp_size):
            ranks = sorted(rank(tp, cp, dp, pp) for tp in range(tp_size) for pp in range(pp_size))
            g = dist.new_group(ranks, group_desc="MODEL_PARALLEL_GROUP", timeout=timeout)
            if me in ranks:
                mine["mp"] = (g, ranks)
    return mine


def train_step(step, scenario, groups, coords):
    tp_size, cp_size, dp_size, pp_size, protocol, fault = SCENARIOS[scenario]
    tp, cp, dp, pp = coords
    me = dist.get_rank()
    last_stage = pp == pp_size - 1
    failing = step == STEPS - 1 and fault is not None
    # This rank's effective tokens in its one micro-batch, and whether its gradient is finite.
    tokens = 3
    if failing and fault[0] == "empty":
        empty_rank = fault[1]
        # every rank of the empty rank's (dp, cp) slot holds the same samples' shards
        e_tp, e_cp, e_dp, e_pp = coords_of(empty_rank, tp_size, cp_size, dp_size)
        if (e_cp, e_dp) == (cp, dp):
            tokens = 0
    nan_here = failing and fault[0] == "nan" and fault[1] == me

    # The micro-batch loop: forward, then backward and DDP's gradient all-reduce over DP x CP.
    # The bucket is one float64, the size of the int64 token count: a mismatched all-reduce then
    # mixes a gradient with a count silently, as NCCL may, and the job hangs later (a real,
    # larger bucket makes Gloo abort the receiving rank before it can dump).
    grads = torch.ones(1, dtype=torch.float64)
    if nan_here:
        grads[0] = float("nan")
    skip_backward = protocol == "microbatch-skip-local" and last_stage and tokens == 0
    if protocol in ("microbatch-skip-local", "nan-skip-local") and not skip_backward:
        dist.all_reduce(grads, group=groups["dp_cp"][0])

    # The end-of-step zero-token decision (Relax PR #285 and its buggy forms).
    flag = torch.zeros(1, dtype=torch.int64)
    if last_stage:
        count = torch.tensor([tokens], dtype=torch.int64)
        dist.all_reduce(count, group=groups["dp_cp"][0])
        flag[0] = int(count.item() == 0)
    if pp_size > 1 or protocol == "pr285-always-broadcast":
        pp_group, pp_ranks = groups["pp"]
        if protocol in ("pr285-src-local", "pr285-always-broadcast"):
            src = pp_size - 1  # the stage index used as a global rank: the bug
        else:
            src = pp_ranks[-1]  # the pipeline's last rank, a global rank
        dist.broadcast(flag, src=src, group=pp_group)
    skip = bool(flag.item())
    if protocol == "nan-skip-local" and not bool(torch.isfinite(grads).all()):
        skip = True  # decided on this rank's own gradient: the bug
    if not skip:
        # optimizer.step(): the grad norm all-reduced over the model-parallel group
        norm = torch.ones(1)
        dist.all_reduce(norm, group=groups["mp"][0])
    dist.barrier()  # the next step begins on every rank


def coords_of(rank, tp_size, cp_size, dp_size):
    tp = rank % tp_size
    rest = rank // tp_size
    cp = rest % cp_size
    rest //= cp_size
    dp = rest % dp_size
    return tp, cp, dp, rest // dp_size


def dump(out, rank):
    """What a user's error path does: the recorder to TORCH_FR_DUMP_TEMP_FILE<rank>, and JSON."""
    torch._C._distributed_c10d._dump_fr_trace_file(rank, True, True, False)
    os.makedirs(os.path.join(out, "json"), exist_ok=True)
    with open(os.path.join(out, "json", f"rank_{rank}.json"), "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace_json(True, False))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=6.0)
    a = ap.parse_args()
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(a.out, "fr_trace_rank_"))
    tp_size, cp_size, dp_size, pp_size = SCENARIOS[a.scenario][:4]
    timeout = datetime.timedelta(seconds=a.timeout)  # subgroups too: theirs defaults to 30 min
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    assert dist.get_world_size() == tp_size * cp_size * dp_size * pp_size
    groups = groups_of(tp_size, cp_size, dp_size, pp_size, timeout)
    coords = coords_of(rank, tp_size, cp_size, dp_size)
    try:
        for step in range(STEPS):
            train_step(step, a.scenario, groups, coords)
    except Exception as e:  # a raise (src not in group) or Gloo's timeout: dump, as a user would
        dump(a.out, rank)
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        # Stay until every waiting rank has timed out and dumped: torchrun stops the others as
        # soon as one process exits.
        time.sleep(a.timeout + 4)
        sys.exit(1)
    dump(a.out, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
