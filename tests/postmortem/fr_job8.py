"""An 8-rank Megatron-style training job (TP2 x PP2 x DP2, CP1) under torchrun over Gloo on CPU, with
PyTorch's Flight Recorder on, hung in one planted way per scenario; each rank dumps its recorder
from its own error or timeout path, as a user's job would. The culprit of each scenario is worked
out by hand in SCENARIOS below (from the fault planted and the layout), never from lossguard.

  OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 fr_job8.py --scenario dp-skip --out DIR

Layout (Megatron's order tp-cp-dp-pp): rank = tp + TP*(cp + CP*(dp + DP*pp)). At TP2 CP1 DP2 PP2:

  stage 0: ranks 0 1 (dp 0), 2 3 (dp 1)      stage 1: ranks 4 5 (dp 0), 6 7 (dp 1)
  TENSOR_MODEL_PARALLEL_GROUP   [0,1] [2,3] [4,5] [6,7]
  DATA_PARALLEL_GROUP(_WITH_CP) [0,2] [1,3] [4,6] [5,7]   (and their _GLOO twins, as Megatron makes)
  PIPELINE_MODEL_PARALLEL_GROUP [0,4] [1,5] [2,6] [3,7]   (last rank: 4 5 6 7)
  MODEL_PARALLEL_GROUP          [0,1,4,5] [2,3,6,7]

One training step, on every rank, in this order (a Megatron step's collectives):
  1. two TENSOR_MODEL_PARALLEL all-reduces (forward activations, backward input gradients), 16 floats;
  2. DDP's gradient bucket all-reduce over DATA_PARALLEL_GROUP, 256 floats;
  3. last stage only: the step's token count (1 int64) all-reduced over DATA_PARALLEL_GROUP_WITH_CP;
  4. the skip flag (1 int64) broadcast over the pipeline group from its last rank (a global rank);
  5. optimizer.step(): the grad norm (1 float) all-reduced over MODEL_PARALLEL_GROUP;
  6. a barrier on the world (the next step begins).
STEPS steps; the fault is planted in the last one. The job writes DIR/fr_trace_rank_<rank> (pickle,
via TORCH_FR_DUMP_TEMP_FILE=DIR/fr_trace_rank_).
"""

import argparse
import datetime
import importlib
import os
import signal
import sys
import threading
import time

SCENARIOS = {
    # name: layout (TP, CP, DP, PP), the fault in the last step, steps, ring-buffer size.
    #
    # No fault: every call of every group completes on every rank.
    "clean": dict(),
    # Rank 5 skips its DP gradient all-reduce in the last step and goes straight on.
    # By hand: rank 5's DP group is [5,7]. Rank 7 issues DP all-reduce #3 on [5,7] and waits there
    # for 5. Rank 5 goes on to the token count #3 on DP_WITH_CP [5,7] and waits there for 7 (who
    # never gets past the gradient all-reduce). Every other rank waits on 5 or 7: 4 and 6 finish
    # their DP and count calls, broadcast (src 4, 6), then wait in the grad-norm all-reduce with
    # 0 (on [0,1,4,5], where 5 never comes) and 2 (on [2,3,6,7], where 7 never comes); 1 waits for
    # the flag from 5 on [1,5], 3 for the flag from 7 on [3,7]. 5 and 7 wait on each other (a
    # cycle of waits, as in wait-cycle), but the dumps say which one left the step: in steps 1 and
    # 2 every last-stage rank issued DP #k before the count #k (and 4 and 6 do in step 3); 7's step
    # 3 is a prefix of that order, 5's is not (count #3 with no gradient #3): culprit rank 5.
    "dp-skip": dict(fault=("dp-skip", 5)),
    # Ranks 5 and 7 (DP group [5,7]) reduce two new metrics at the end of the last step in opposite
    # orders (a set iterated in a per-process hash order), on the _GLOO twins of their data-parallel
    # groups, which nothing used before: 5 all-reduces on DATA_PARALLEL_GROUP_GLOO then on
    # DATA_PARALLEL_GROUP_WITH_CP_GLOO; 7 the other way round. Neither group has a history, so
    # neither order is the "right" one.
    # By hand: 5 waits in DP_GLOO #1 on [5,7] for 7; 7 waits in DP_WITH_CP_GLOO #1 on [5,7] for 5:
    # a wait cycle {5 -> 7, 7 -> 5}. The other six ranks wait in the world barrier #3 for 5 and 7.
    "wait-cycle": dict(fault=("cycle", 5, 7)),
    # Rank 5 sends a gradient bucket of another size and dtype (64 float64, 512 bytes, instead of
    # 256 float32, 1024 bytes: the same byte count would pass silently) in the last step's DP
    # all-reduce on [5,7]. Found by running it: Gloo's ring hands rank 5 a 256-byte chunk of 7's
    # bucket where 5 expects 128 bytes; its transport thread throws ("Received data size doesn't
    # match expected size") and the process aborts (SIGABRT) before it can dump. Rank 7 receives
    # only shorter chunks, which Gloo accepts, then sees the connection reset and dumps, as the
    # others do after their timeouts. The rank without a dump, 5, is the job's root.
    "abort-before-dump": dict(fault=("bucket", 5)),
    # dp-skip on rank 6 in the last of 10 steps, with a 16-entry ring buffer: every rank's buffer
    # wrapped (a step is 6-7 entries). By hand, as dp-skip with 6 for 5: DP group [4,6]; 4 waits in
    # DP #10 for 6; 6 waits in the count #10 on DP_WITH_CP [4,6] for 4. Culprit rank 6.
    "wrapped": dict(fault=("dp-skip", 6), steps=10, buffer=16),
    # TP1 PP1 DP4: the token count all-reduced over the WORLD group instead of
    # DATA_PARALLEL_GROUP_WITH_CP (the same members at this layout), and the seed's bug: the flag
    # broadcast over the (one-rank) pipeline group with src = PP-1 = 0, the stage index, as a
    # global rank, even at PP1. By hand: step 1, every rank completes the count (world #1); rank 0
    # broadcasts on [0] (src 0 is its member), steps and waits in the world barrier #2; ranks 1-3
    # raise in the broadcast (src 0 is not in [1], [2], [3]) and issue nothing more. Divergence:
    # barrier #2 on the world, issued [0], not issued [1,2,3] (pr285-always-broadcast).
    "world-count": dict(layout=(1, 1, 4, 1), count_group="world", src="stage-index"),
    # The dp-skip fault (rank 5) with groups created without group_desc, in another order
    # (pipeline, tensor, model, data-with-cp, data instead of Megatron's). The same derivation as
    # dp-skip: culprit rank 5.
    "no-desc": dict(fault=("dp-skip", 5), desc=False),
    # slime's advantage-whitening bug shape: after the last step's barrier, only the last pipeline
    # stage (ranks 4-7) whitens its advantages with an all-reduce on the WORLD group (in
    # whiten_advantages); stage 0 (ranks 0-3) never does and goes on to wait for the next rollout
    # (no collective). By hand: world all_reduce #(barriers + 1) issued by [4,5,6,7], never by
    # [0,1,2,3], who completed everything and are idle. Either side may be the wrong one (4-7
    # should not reduce over the world, or 0-3 should have joined).
    "stage-only-call": dict(fault=("whiten",)),
    # dp-skip (rank 5) with the groups of megatron.core.parallel_state.initialize_model_parallel
    # (TP2 PP2 on the gloo default group), the gradient all-reduce on get_data_parallel_group().
    # Megatron makes more groups (its *_GLOO twins, CP, embedding, expert groups) but the step
    # calls only the five above: the same derivation as dp-skip, culprit rank 5.
    "megatron-core": dict(fault=("dp-skip", 5), megatron=True),
}


def rank_of(tp, cp, dp, pp, T, C, D):
    return tp + T * (cp + C * (dp + D * pp))


def coords_of(rank, T, C, D):
    tp = rank % T
    rest = rank // T
    cp = rest % C
    rest //= C
    return tp, cp, rest % D, rest // D


def make_groups(T, C, D, P, timeout, desc=True):
    """Every rank creates every group, in one order (Megatron's unless desc is False)."""
    import torch.distributed as dist

    me = dist.get_rank()
    R = lambda tp, cp, dp, pp: rank_of(tp, cp, dp, pp, T, C, D)  # noqa: E731
    kinds = {
        "dp_cp": ("DATA_PARALLEL_GROUP_WITH_CP",
                  [sorted(R(tp, cp, dp, pp) for cp in range(C) for dp in range(D))
                   for pp in range(P) for tp in range(T)]),
        "dp": ("DATA_PARALLEL_GROUP",
               [[R(tp, cp, dp, pp) for dp in range(D)]
                for pp in range(P) for cp in range(C) for tp in range(T)]),
        "mp": ("MODEL_PARALLEL_GROUP",
               [sorted(R(tp, cp, dp, pp) for tp in range(T) for pp in range(P))
                for dp in range(D) for cp in range(C)]),
        "tp": ("TENSOR_MODEL_PARALLEL_GROUP",
               [[R(tp, cp, dp, pp) for tp in range(T)]
                for pp in range(P) for dp in range(D) for cp in range(C)]),
        "pp": ("PIPELINE_MODEL_PARALLEL_GROUP",
               [[R(tp, cp, dp, pp) for pp in range(P)]
                for dp in range(D) for cp in range(C) for tp in range(T)]),
    }
    # Megatron's order; each data-parallel group is followed by its _GLOO twin (backend="gloo",
    # create_gloo_process_groups=True), which the step never uses (the wait-cycle's metrics do).
    if desc:
        order = [("dp_cp", True), ("dp", True), ("mp", False), ("tp", False), ("pp", False)]
    else:
        order = [(k, False) for k in ("pp", "tp", "mp", "dp_cp", "dp")]
    mine = {}
    for kind, twin in order:
        name, all_ranks = kinds[kind]
        for ranks in all_ranks:
            kw = dict(group_desc=name) if desc else {}
            g = dist.new_group(ranks, timeout=timeout, **kw)
            if me in ranks:
                mine[kind] = (g, ranks)
            if twin:
                g = dist.new_group(ranks, timeout=timeout, backend="gloo",
                                   group_desc=name + "_GLOO")
                if me in ranks:
                    mine[kind + "_gloo"] = (g, ranks)
    return mine


def megatron_groups(T, P, timeout):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=T, pipeline_model_parallel_size=P,
                                 distributed_timeout_minutes=timeout.total_seconds() / 60)
    return {
        "tp": (ps.get_tensor_model_parallel_group(), None),
        "dp": (ps.get_data_parallel_group(), None),
        "dp_cp": (ps.get_data_parallel_group(with_context_parallel=True), None),
        "mp": (ps.get_model_parallel_group(), None),
        "pp": (ps.get_pipeline_model_parallel_group(),
               [ps.get_pipeline_model_parallel_last_rank()]),  # only its last rank is used
    }


def whiten_advantages(adv):
    """slime's shape: mean and variance over a group that holds ranks which never compute them."""
    import torch
    import torch.distributed as dist

    stats = torch.stack([adv.sum(), (adv * adv).sum(), torch.tensor(float(adv.numel()))])
    dist.all_reduce(stats)  # the WORLD group: stage-0 ranks never come
    mean = stats[0] / stats[2]
    return (adv - mean) / (stats[1] / stats[2] - mean * mean).clamp_min(1e-8).sqrt()


def wait_for_rollout(timeout):
    """Stage 0 after the last step: no collective, it waits for the next batch (and times out)."""
    time.sleep(timeout)
    raise TimeoutError(f"no rollout within {timeout:.0f} s")


def train_step(step, steps, sc, layout, groups, me, timeout):
    import torch
    import torch.distributed as dist

    T, C, D, P = layout
    tp, cp, dp, pp = coords_of(me, T, C, D)
    last_stage = pp == P - 1
    fault = sc.get("fault") if step == steps - 1 else None
    kind = fault[0] if fault else None

    # forward and backward: the tensor-parallel all-reduces
    for _ in range(2):
        dist.all_reduce(torch.ones(16), group=groups["tp"][0])

    # DDP's gradient bucket over the data-parallel group
    if kind == "dp-skip" and me == fault[1]:
        pass  # the fault: this rank skips it and goes straight on
    elif kind == "bucket" and me == fault[1]:
        dist.all_reduce(torch.ones(64, dtype=torch.float64), group=groups["dp"][0])
    else:
        dist.all_reduce(torch.ones(256), group=groups["dp"][0])

    # the token count on the last stage
    flag = torch.zeros(1, dtype=torch.int64)
    if last_stage:
        count = torch.tensor([3], dtype=torch.int64)
        cgroup = dist.group.WORLD if sc.get("count_group") == "world" else groups["dp_cp"][0]
        dist.all_reduce(count, group=cgroup)
        flag[0] = int(count.item() == 0)

    # the skip flag from the pipeline's last rank
    pp_group, pp_ranks = groups["pp"]
    if sc.get("src") == "stage-index":
        src = P - 1  # the stage index used as a global rank: the seed's bug
    else:
        src = pp_ranks[-1]
    dist.broadcast(flag, src=src, group=pp_group)

    if not bool(flag.item()):  # optimizer.step(): the grad norm over the model-parallel group
        dist.all_reduce(torch.ones(1), group=groups["mp"][0])

    if kind == "cycle" and me in fault[1:]:
        # two metrics reduced in a per-process order (a set's iteration order), on the gloo twins:
        # 5 DATA_PARALLEL_GROUP_GLOO then DATA_PARALLEL_GROUP_WITH_CP_GLOO, 7 the other way
        order = ["dp_gloo", "dp_cp_gloo"] if me == fault[1] else ["dp_cp_gloo", "dp_gloo"]
        for k in order:
            dist.all_reduce(torch.ones(4), group=groups[k][0])

    dist.barrier()  # the next step begins

    if kind == "whiten":
        if last_stage:
            whiten_advantages(torch.arange(8, dtype=torch.float32))
        else:
            wait_for_rollout(timeout)


def dump(rank):
    """What a user's error path does: the recorder to TORCH_FR_DUMP_TEMP_FILE<rank>."""
    import torch

    torch._C._distributed_c10d._dump_fr_trace_file(rank, True, True, False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=4.0)
    a = ap.parse_args()
    sc = SCENARIOS[a.scenario]
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(a.out, "fr_trace_rank_"))
    if "buffer" in sc:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(sc["buffer"])
    else:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

    # torchrun stops every process (SIGTERM) as soon as one fails. A rank still waiting for its
    # Gloo timeout must outlive that to dump: the signal is deferred until this rank has dumped.
    state = {"dumped": False, "term": False}

    def on_term(signum, frame):
        state["term"] = True
        if state["dumped"]:
            os._exit(1)

    signal.signal(signal.SIGTERM, on_term)

    import torch.distributed as dist

    layout = sc.get("layout", (2, 1, 2, 2))
    T, C, D, P = layout
    steps = sc.get("steps", 3)
    timeout = datetime.timedelta(seconds=a.timeout)  # subgroups too: theirs defaults to 30 min
    # A generous timeout while 8 processes import torch on few cores and meet, then the short one.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    assert dist.get_world_size() == T * C * D * P
    if sc.get("megatron"):
        groups = megatron_groups(T, P, timeout)
    else:
        groups = make_groups(T, C, D, P, timeout, desc=sc.get("desc", True))
    dist.set_timeout(timeout)  # the world group's collectives time out as the subgroups' do
    # The dump's first call imports torch._inductor (1.5 s of CPU a process; 8 processes on 2 cores):
    # done in the background, while the ranks wait out the hang, not after it. Nothing recorded
    # changes.
    threading.Thread(target=importlib.import_module, args=("torch._inductor",), daemon=True).start()
    try:
        for step in range(steps):
            train_step(step, steps, sc, layout, groups, rank, a.timeout)
    except Exception as e:  # a raise (src not in group), Gloo's timeout, no rollout: dump
        dump(rank)
        state["dumped"] = True
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        if state["term"]:
            os._exit(1)
        # Stay a while so that the ranks waiting beside this one time out and dump (not cut short by
        # this one's exit), then fail.
        time.sleep(2)
        sys.exit(1)
    dump(rank)
    state["dumped"] = True
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
