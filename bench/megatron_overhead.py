#!/usr/bin/env python3
"""What the Megatron adapter (lossguard_capture.megatron) costs megatron-core's own training step, mode by mode
(issue #55's goals), at PP 1 (DP 2) and PP 2 (the 1F1B schedule), two ranks each:

    python bench/megatron_overhead.py [--pp 1,2] [--vocab 2048,131072] [--repeats 5] [--steps 4] [--seq 128]
        [--mbs 2] [--microbatches 4] [--binary build/cli/lossguard] [--json FILE] [--require-no-sync]

Run with the Python of a venv holding megatron-core (scripts/setup-trainers.sh megatron:
~/.cache/lossguard/venv-megatron/bin/python); it launches ``torch.distributed.run`` itself, once per ``--pp``,
with ``--nproc-per-node 2`` over Gloo on the CPU (lossguard_capture.megatron_cpu puts Megatron's few CUDA
tensors on the CPU, and the attention's fork of Megatron's CUDA RNG tracker, for a dropout of 0 here, changes
nothing; every mode runs under both alike).

The step: a ``GPTModel`` (2 layers, hidden 64, Megatron's local layer spec, untied output layer) at each
``--vocab``, called with labels (the per-token losses ``[b, s]`` Megatron's ``compute_language_model_loss``
returns), a pretrain_gpt-style 3-tuple loss_func under ``calculate_per_token_loss``, ``--microbatches``
micro-batches of ``--mbs`` rows of ``--seq`` tokens per DP rank and step (the first quarter of each row a
prompt), ``forward_backward_func`` (no pipelining at PP 1, 1F1B at PP 2), Megatron's DDP, ``finalize_model_grads``,
``get_megatron_optimizer`` (SGD) and ``OptimizerParamScheduler``: a whole iteration of Megatron-LM's loop.

Modes (bench/overhead_common.py), each a fresh model from the same seed on the same data, ``--steps`` iterations:
``plain`` (no adapter), ``attached`` (``attach(..., steps=(10**9,), fail_fast=False)``: nothing recorded),
``recording`` (every step recorded and written, never audited; the capture's write,
``StepRecorder.finish``, timed apart), ``default`` (step 0 recorded and audited by
``--binary`` before ``optimizer.step()`` applies it). Interleaved ``--repeats`` times; a step's time is the
slowest rank's; the first step of each run is left out except in ``default``, whose step 0 is reported alone
with the ``lossguard audit`` subprocess and the verdict's hand-over (``agree``, every rank) timed apart.
Host synchronisation: one more recorded run with ``torch.Tensor.item/cpu/...`` counted where lossguard_capture's
code makes the call, split into calls before the step's end (before ``finalize_model_grads``, i.e. during the
micro-batches' forwards and backwards: the goal is 0) and at it; summed over the ranks. Calls on tensors the
adapter builds on the host itself (the CP placement of a micro-batch shape, once per shape, from ``torch.arange``
on the CPU: no device memory is read) are counted apart.

Prints a table per layout and vocabulary and one JSON line (``JSON {...}``).
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

SEED = 1234


# ---- the launcher: one torchrun per pipeline size, the workers' JSON merged ---------------------------------
def launch(opt):
    results = []
    for pp in (int(x) for x in opt.pp.split(",")):
        fd, path = tempfile.mkstemp(prefix="lossguard-megatron-bench-", suffix=".json")
        os.close(fd)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--worker", "--pp", str(pp), "--vocab", opt.vocab, "--repeats",
               str(opt.repeats), "--steps", str(opt.steps), "--seq", str(opt.seq), "--mbs", str(opt.mbs),
               "--microbatches", str(opt.microbatches), "--binary", opt.binary, "--json", path]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            if subprocess.run(cmd, env=env).returncode != 0:
                print(f"megatron_overhead: the PP {pp} run failed (command: {' '.join(cmd)})", file=sys.stderr)
                return 1
            with open(path) as f:
                results += json.load(f)
        finally:
            os.unlink(path)
    for r in results:
        show(r)
    doc = {"bench": "megatron_overhead", "adapter": "megatron", "device": "cpu", "results": results}
    print("JSON " + json.dumps(doc))
    if opt.json:
        with open(opt.json, "w") as f:
            json.dump(doc, f, indent=1)
    synced = [(r["pp"], r["vocab"]) for r in results if r["host_syncs_per_recorded_step"]["before_step_end"]]
    if opt.require_no_sync and synced:
        print(f"megatron_overhead: host-sync-prone calls before the step's end at (pp, vocab) {synced}")
        return 1
    return 0


def show(r):
    print(f"\nPP {r['pp']} x DP {r['dp']}, vocab {r['vocab']}: {r['microbatches']} micro-batches of "
          f"{r['rows_per_microbatch']} rows x {r['seq']} tokens per DP rank and step")
    from overhead_common import show_modes
    show_modes(r["modes"])
    print(f"  recording: the capture's write {r['recording_capture_write_median_ms']:.1f} ms a step (slowest rank); "
          f"the recorded step x{r['recording_min_ratio_to_plain_plus_write']:.3f} (min) / "
          f"x{r['recording_ratio_to_plain_plus_write']:.3f} (median) of plain's plus that write")
    d = r["default_audited_step"]
    print(f"  default's audited step 0: {d['median_ms']:.1f} ms median, of which lossguard audit "
          f"{d['audit_subprocess_median_ms']:.1f} ms, the verdict's hand-over {d['verdict_handover_median_ms']:.2f} ms; "
          f"the step after it x{d['next_step_ratio_median']:.3f} of plain's median")
    h = r["host_syncs_per_recorded_step"]
    print(f"  host-sync-prone calls by lossguard_capture per recorded step (all ranks): {h['before_step_end']} "
          f"before the step's end (the micro-batches), {h['at_step_end']} at it; on the adapter's own host tensors "
          f"{h['host_only_in_two_steps']} in two steps (the CP placement, once per shape)")
    if h["before_step_end_where"]:
        print(f"  before the step's end, where (2 steps): {h['before_step_end_where']}")


# ---- a worker (one rank of one torchrun) -------------------------------------------------------------------
def worker(opt):
    import warnings
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    opt.pp = int(opt.pp)
    from lossguard_capture.megatron_cpu import cuda_on_cpu, import_megatron_core
    import_megatron_core()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(pipeline_model_parallel_size=opt.pp)
    results = []
    try:
        with cuda_on_cpu():
            # the attention forks Megatron's CUDA RNG tracker for its dropout (0 here): on the CPU a fork that
            # changes nothing (model_parallel_cuda_manual_seed needs a GPU's RNG state)
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
            get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
            for vocab in (int(x) for x in opt.vocab.split(",")):
                results.append(bench_vocab(opt, vocab))
    finally:
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(opt.json, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    return 0


def build(opt, vocab):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                               use_cpu_initialization=True, calculate_per_token_loss=True,
                               pipeline_model_parallel_size=opt.pp, pipeline_dtype=torch.float32,
                               batch_p2p_comm=False, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(SEED)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=opt.seq, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=False, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    ddp = DDP(config, DistributedDataParallelConfig(), model)
    optim = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.01, weight_decay=0.0, clip_grad=0.0,
                                                   bf16=False, fp16=False), [ddp])
    sched = OptimizerParamScheduler(optim, init_lr=0.01, max_lr=0.01, min_lr=0.01, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=10, wd_incr_style="constant")
    config.grad_scale_func = optim.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return config, ddp, optim, sched


def microbatches(opt, vocab, step):
    """This DP rank's micro-batches of ``step``: rows of random tokens, labels shifted, a prompt of a quarter."""
    import torch
    from megatron.core import parallel_state as ps
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(SEED + 7919 * step)
    rows = opt.mbs * opt.microbatches * dp
    tokens = torch.randint(1, vocab, (rows, opt.seq), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.zeros(rows, 1, dtype=torch.int64)], dim=1)
    mask = torch.ones(rows, opt.seq)
    mask[:, : opt.seq // 4] = 0
    mask[:, -1] = 0
    out = []
    for k in range(opt.microbatches):
        first = (k * dp + dp_rank) * opt.mbs
        sl = slice(first, first + opt.mbs)
        out.append({"tokens": tokens[sl], "labels": labels[sl], "loss_mask": mask[sl],
                    "position_ids": torch.arange(opt.seq).expand(opt.mbs, opt.seq).contiguous(),
                    "sample_indices": torch.arange(first, first + opt.mbs)})
    return out


def loss_func(loss_mask, output_tensor):
    """pretrain_gpt's shape: the sum over the loss-bearing tokens, their count, a report."""
    import torch
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    count = mask.sum().to(torch.int)
    return total, count.clone().detach(), {"lm loss": torch.cat([total.detach().view(1), count.view(1)])}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run(opt, mode, vocab, data, out, counter=None):
    """One ``--steps`` run of ``mode``; this rank's step times, and rank 0's audit / hand-over seconds."""
    import lossguard_capture.adapter as ladapter
    import lossguard_capture.megatron as lcm
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from overhead_common import Timed
    config, ddp, optim, sched = build(opt, vocab)
    caps = os.path.join(out, "caps")
    audit, timed = None, []
    if mode == "attached":
        audit = lcm.attach(config, caps, model=ddp, optimizer=optim, scheduler=sched, steps=(10 ** 9,),
                           fail_fast=False)
    elif mode == "recording":
        from lossguard_capture import recorder
        timed = [Timed(recorder.StepRecorder, "finish")]         # the capture's write, timed apart
        audit = lcm.attach(config, caps, model=ddp, optimizer=optim, scheduler=sched, steps=None, fail_fast=False)
    elif mode == "default":
        timed = [Timed(ladapter, "run_audit"), Timed(ladapter, "agree")]
        audit = lcm.attach(config, caps, model=ddp, optimizer=optim, scheduler=sched, steps=(0,), fail_fast=True,
                           lossguard_bin=opt.binary, timeout=300)
    if counter is not None:         # the step's end: the adapter's wrapper of finalize_model_grads begins
        orig_finalize = lcm.MegatronAdapter._finalize

        def finalize(self, *a, **k):
            counter.at_step_end = True
            return orig_finalize(self, *a, **k)
        lcm.MegatronAdapter._finalize = finalize

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])
        fn = partial(loss_func, mb["loss_mask"])
        if audit is not None:
            fn = audit.loss_func(fn, tokens=mb["tokens"], loss_mask=mb["loss_mask"],
                                 sample_indices=mb["sample_indices"])
        return output, fn

    fb = get_forward_backward_func()
    times = []
    try:
        for step, mbs in enumerate(data):
            if counter is not None:
                counter.at_step_end = False
            t0 = time.perf_counter()
            ddp.zero_grad_buffer()
            optim.zero_grad()
            with audit.step(step) if audit is not None else _Null():
                fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=[ddp],
                   num_microbatches=opt.microbatches, seq_length=opt.seq, micro_batch_size=opt.mbs)
                optim.step()
                sched.step(increment=1)
            times.append(time.perf_counter() - t0)
    finally:
        for t in timed:
            t.restore()
        if counter is not None:
            lcm.MegatronAdapter._finalize = orig_finalize
    done(out)
    if mode == "recording":                     # this rank's capture writes, per step
        return times, timed[0].total / len(times), None
    audit_s = timed[0].total if timed else None
    return times, audit_s, (timed[1].total - audit_s if timed else None)


def done(out):
    """Every rank is done with ``out``: rank 0 removes it."""
    import torch.distributed as dist
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)


def slowest(times):
    """Per step, the slowest rank's time (every rank holds the step until the last one is done)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def bench_vocab(opt, vocab):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from overhead_common import MODES, SyncCounter, summarise
    data = [microbatches(opt, vocab, s) for s in range(opt.steps)]
    tmp = tempfile.mkdtemp(prefix="lossguard-megatron-bench-") if dist.get_rank() == 0 else None
    box = [tmp]
    dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    steps = {m: [] for m in MODES}
    audited, audit_s, handover_s, write_s, after_audit = [], [], [], [], []
    for rep in range(opt.repeats):
        for mode in MODES:
            times, a, h = run(opt, mode, vocab, data, os.path.join(tmp, f"{mode}-{rep}"))
            times = slowest(times)
            steps[mode] += times[1:]
            if mode == "recording":
                write_s.append(slowest([a])[0])
            if mode == "default":
                audited.append(times[0])
                after_audit.append(times[1])
                if a is not None:
                    audit_s.append(a)
                    handover_s.append(h)
    # _local_index: the CP placement of a [b, s] micro-batch, computed once per shape from torch.arange on the
    # CPU through megatron's own get_batch_on_this_cp_rank (lossguard_capture/megatron.py): host tensors only
    counter = SyncCounter(host_only_functions=("_local_index",))
    with counter:
        run(opt, "recording", vocab, data[:2], os.path.join(tmp, "sync"), counter)
    counts = torch.tensor([counter.before_end, counter.at_end, counter.host_only], dtype=torch.int64)
    dist.all_reduce(counts)
    where = [None] * dist.get_world_size()
    dist.all_gather_object(where, counter.where_before)
    done(tmp)
    res = {"pp": opt.pp, "dp": ps.get_data_parallel_world_size(), "vocab": vocab, "seq": opt.seq,
           "rows_per_microbatch": opt.mbs, "microbatches": opt.microbatches, "modes": summarise(steps)}
    # the goal of a recorded step: <= 10 % over the same step plus writing its capture
    write = statistics.median(write_s)
    res["recording_capture_write_median_ms"] = write * 1e3
    res["recording_ratio_to_plain_plus_write"] = (statistics.median(steps["recording"])
                                                  / (statistics.median(steps["plain"]) + write))
    res["recording_min_ratio_to_plain_plus_write"] = min(steps["recording"]) / (min(steps["plain"]) + write)
    if dist.get_rank() == 0:
        res["default_audited_step"] = {
            "median_ms": statistics.median(audited) * 1e3,
            "audit_subprocess_median_ms": statistics.median(audit_s) * 1e3,
            "verdict_handover_median_ms": statistics.median(handover_s) * 1e3,
            "step_without_audit_median_ms": statistics.median([s - a for s, a in zip(audited, audit_s)]) * 1e3,
            # the step right after the audited one (the audit subprocess ran in between), against plain's
            "next_step_ratio_median": statistics.median(after_audit) / statistics.median(steps["plain"])}
    # two recorded steps were counted: per step
    res["host_syncs_per_recorded_step"] = {"before_step_end": int(counts[0]) // 2, "at_step_end": int(counts[1]) // 2,
                                           "host_only_in_two_steps": int(counts[2]),
                                           "before_step_end_where": {f"rank{r}:{k}": v for r, w in enumerate(where)
                                                                     for k, v in w.items()}}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", default="1,2", help="pipeline sizes, a run of two ranks each (PP 1: DP 2)")
    ap.add_argument("--vocab", default="2048,131072")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per DP rank and step")
    ap.add_argument("--binary", default=os.environ.get("LOSSGUARD_BIN", os.path.join(ROOT, "build", "cli",
                                                                                          "lossguard")))
    ap.add_argument("--json")
    ap.add_argument("--require-no-sync", action="store_true",
                    help="exit 1 when lossguard_capture makes a host-sync-prone call before a step's end")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opt = ap.parse_args()
    try:
        return worker(opt) if opt.worker else launch(opt)
    except Exception:                                   # noqa: BLE001 - say where
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
