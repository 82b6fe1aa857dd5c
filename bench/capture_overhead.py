#!/usr/bin/env python3
"""Recorder overhead on a real training step: tests/audit/mini_trainer.py's run_step with lossguard_capture
recording (the default) against the very same step with ``--no-capture``, in one process, on CPU.

    python bench/capture_overhead.py [--steps 20] [--warmup 3] [--samples 32] [--microbatches 4]
        [--prompt-len 32] [--response-len 96] [--dim 256] [--vocab 2048] [--threads 1]
        [--dtype float32] [--vary-batch] [--out DIR] [--keep]

One process, Gloo with world size 1 (dp = cp = 1; an in-memory store, no port).  The trainer's model is
widened (mini_trainer.DIM / VOCAB) and its batch lengthened (a batch generator with the trainer's
make_batch signature: P in [1, --prompt-len], R in [1, --response-len], ~75 % of mask entries 1; the same
batch every step unless --vary-batch, so that every step does the same work) so a step costs tens to
hundreds of milliseconds; everything else — placement, zig-zag ownership, per-token NLL,
gradient accumulation, all-reduce, grad_scale, SGD, and in capture mode the recorder's calls (one
lc.Capture per mode, a step recorder per step) and the capture file finish() writes (under --out, a
temporary directory by default) — is the trainer's own code.

Timing: after --warmup steps of each mode, --steps pairs of steps, interleaved (ABBA order, so drift
and neighbour noise hit both modes alike), each mode training its own model from the same seed on the
same batches; per-step wall time (time.perf_counter around run_step, gc collected before each step).
Reported: min and median per mode; end-to-end overhead = median(on)/median(off) - 1 (and by min, and the
median of the paired differences, as % of the no-capture median); and, far less noisy on a shared machine,
the time spent inside the recorder's own calls (Capture.step, StepRecorder.microbatch/finish,
MicroBatch.hook/loss/set; median per step, finish() separately) as % of the no-capture median.  That one
leaves out the backward hook's callback (a detach and an append per micro-batch), the step recorder's
`with` exit and the arguments the trainer builds for the calls.

Host synchronisation: one extra step per mode with torch.Tensor.item/cpu/tolist/numpy/__int__/__float__/
__bool__ wrapped to count calls (the set python/tests checks), split into calls made before finish()
(the micro-batch loop, the all-reduces, the optimizer) and inside finish(), and into calls with a
lossguard_capture frame on the stack (the recorder's, hook included) and the rest (the trainer's own:
on CPU tensors it reads values freely, which on a GPU would be syncs of its own).  Target: the recorder
adds none before finish(), i.e. 0 per micro-batch.  On CPU these calls cost no device wait; they are
counted because on a device each would be one.

Prints a table and one JSON line (prefixed ``JSON ``).  Target: overhead < 5 % of a step, judged both ways
(target_met_recorder_calls, target_met_end_to_end), and no recorder host sync before finish().
"""
import argparse
import gc
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
TRAINER = os.path.join(ROOT, "tests", "audit", "mini_trainer.py")
sys.path.insert(0, os.path.join(ROOT, "python"))
import lossguard_capture as lc  # noqa: E402

_spec = importlib.util.spec_from_file_location("lossguard_mini_trainer", TRAINER)
mt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mt)

SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__int__", "__float__", "__bool__")
LC_DIR = os.path.dirname(os.path.abspath(lc.__file__)) + os.sep


def make_bench_batch(args):
    """A make_batch(seed, step, n_samples, empty=False, sparse=False) with longer samples."""
    def make_batch(seed, step, n_samples, empty=False, sparse=False):
        g = torch.Generator().manual_seed(7919 * seed + 104729 * (step if args.vary_batch else 0) + 1)
        out = []
        for _ in range(n_samples):
            P = int(torch.randint(1, args.prompt_len + 1, (1,), generator=g))
            R = int(torch.randint(1, args.response_len + 1, (1,), generator=g))
            T = P + R
            tokens = torch.randint(0, mt.VOCAB, (T,), generator=g, dtype=torch.int64)
            mask = (torch.rand(R, generator=g) < 0.75).to(torch.int64)
            out.append({"tokens": tokens, "T": T, "R": R, "mask": mask})
        return out
    return make_batch


def trainer_args(args, no_capture):
    """The argparse namespace run_step reads (what mini_trainer.main would build), dp = cp = 1."""
    return argparse.Namespace(dp=1, cp=1, microbatches=args.microbatches, bug="none", reduce="per-token",
                              seed=args.seed, steps=args.steps, samples=args.samples, empty_step=None,
                              sparse_step=None, dtype=args.dtype, check_grad=False, no_capture=no_capture)


class CallTimer:
    """Wraps the recorder's entry points (Capture.step, StepRecorder.microbatch/finish, MicroBatch.hook/
    loss/set) to add up the wall time spent inside them (a perf_counter pair per call, ~10 calls a step)."""

    TIMED = (("Capture", "step"), ("StepRecorder", "microbatch"), ("StepRecorder", "finish"),
             ("MicroBatch", "hook"), ("MicroBatch", "loss"), ("MicroBatch", "set"))

    def __init__(self):
        self.acc = {}
        self.saved = []

    def reset(self):
        self.acc = {}

    def __enter__(self):
        timer = self
        for cls_name, name in self.TIMED:
            cls = getattr(lc, cls_name)
            orig = cls.__dict__[name]
            self.saved.append((cls, name, orig))

            def wrapped(*a, _orig=orig, _n=name, **k):
                t = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    timer.acc[_n] = timer.acc.get(_n, 0.0) + time.perf_counter() - t
            setattr(cls, name, wrapped)
        return self

    def __exit__(self, *exc):
        for cls, name, orig in self.saved:
            setattr(cls, name, orig)


class SyncCounter:
    """Counts torch.Tensor value reads, by phase (before/in finish) and by caller (recorder/trainer)."""

    def __init__(self):
        self.counts = {}            # (phase, who, method) -> n
        self.in_finish = False
        self.saved = {}

    def _who(self):
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_filename.startswith(LC_DIR):
                return "recorder"
            f = f.f_back
        return "trainer"

    def __enter__(self):
        counter = self
        for n in SYNC_METHODS:
            orig = getattr(torch.Tensor, n)
            self.saved[n] = orig

            def wrapped(t, *a, _orig=orig, _n=n, **k):
                key = ("finish" if counter.in_finish else "loop", counter._who(), _n)
                counter.counts[key] = counter.counts.get(key, 0) + 1
                return _orig(t, *a, **k)
            setattr(torch.Tensor, n, wrapped)
        self.orig_finish = lc.StepRecorder.finish

        def finish(rec, *a, **k):
            counter.in_finish = True
            try:
                return counter.orig_finish(rec, *a, **k)
            finally:
                counter.in_finish = False
        lc.StepRecorder.finish = finish
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)
        lc.StepRecorder.finish = self.orig_finish

    def total(self, phase=None, who=None):
        return sum(v for (p, w, _), v in self.counts.items()
                   if (phase is None or p == phase) and (who is None or w == who))

    def by_method(self, phase, who):
        out = {}
        for (p, w, n), v in sorted(self.counts.items()):
            if p == phase and w == who:
                out[n] = out.get(n, 0) + v
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode (interleaved)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    ap.add_argument("--samples", type=int, default=32, help="samples per step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt length drawn from [1, N]")
    ap.add_argument("--response-len", type=int, default=96, help="response length drawn from [1, N]")
    ap.add_argument("--dim", type=int, default=256, help="model width (mini_trainer.DIM)")
    ap.add_argument("--vocab", type=int, default=2048, help="vocabulary (mini_trainer.VOCAB)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the trainer uses 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vary-batch", action="store_true", help="draw a new batch each step (default: the same one)")
    ap.add_argument("--out", default=None, help="capture directory (default: a temporary one, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the capture directory")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    mt.DIM, mt.VOCAB = args.dim, args.vocab
    mt.make_batch = make_bench_batch(args)
    out_dir = args.out or tempfile.mkdtemp(prefix="lossguard-capture-bench-")
    os.makedirs(out_dir, exist_ok=True)
    dtype = getattr(torch, args.dtype)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        modes = {}
        for name, off in (("capture", False), ("no-capture", True)):
            model = mt.make_model(args.seed, dtype)
            cap = lc.Capture(out_dir, reduce="per-token", steps=() if off else None)   # as mini_trainer.main
            modes[name] = (trainer_args(args, off), model, mt.SGD(model.parameters(), lr=0.1), cap)

        def step(name, k):
            targs, model, opt, cap = modes[name]
            mt.run_step(targs, "none", model, opt, k, cap, out_dir, 0, 0, 0, None)

        for k in range(args.warmup):
            for name in modes:
                gc.collect()
                step(name, k)

        times = {"capture": [], "no-capture": []}
        finish_s, inside_s = [], []      # per capture step: time inside finish(), inside all recorder calls
        with CallTimer() as ct:
            for i in range(args.steps):
                k = args.warmup + i
                order = ("capture", "no-capture") if i % 2 == 0 else ("no-capture", "capture")
                for name in order:
                    gc.collect()
                    ct.reset()
                    t = time.perf_counter()
                    step(name, k)
                    times[name].append(time.perf_counter() - t)
                    if name == "capture":
                        finish_s.append(ct.acc.get("finish", 0.0))
                        inside_s.append(sum(ct.acc.values()))

        # host-sync census: one more step per mode, instrumented (not timed)
        k = args.warmup + args.steps
        census = {}
        for name in modes:
            with SyncCounter() as sc:
                step(name, k)
            census[name] = sc
        cap_file = os.path.join(out_dir, lc.capture_filename(k, 0))
        cap_size = os.path.getsize(cap_file) if os.path.exists(cap_file) else None
    finally:
        dist.destroy_process_group()
        if args.out is None and not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)

    # micro-batches with samples (dummy ones carry no loss): the last census step's placement
    mbs = [m for m in mt.placement(args.samples, 1, args.microbatches)[0] if m]
    n_mb = len(mbs)
    batch = mt.make_batch(args.seed, args.warmup, args.samples)
    tokens = sum(s["T"] for s in batch)
    owned = sum(s["R"] for s in batch)

    on, off = times["capture"], times["no-capture"]
    med_on, med_off = statistics.median(on), statistics.median(off)
    min_on, min_off = min(on), min(off)
    paired = statistics.median([a - b for a, b in zip(on, off)])
    med_fin = statistics.median(finish_s)
    med_inside = statistics.median(inside_s)
    sc_on, sc_off = census["capture"], census["no-capture"]
    rec_loop = sc_on.total("loop", "recorder")
    added_loop = sc_on.total("loop") - sc_off.total("loop")
    res = {
        "bench": "capture_overhead", "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype,
        "world": 1, "dp": 1, "cp": 1, "samples": args.samples, "microbatches": n_mb,
        "tokens_per_step": tokens, "response_tokens_per_step": owned, "dim": args.dim, "vocab": args.vocab,
        "steps": args.steps, "warmup": args.warmup,
        "capture_ms": {"min": 1e3 * min_on, "median": 1e3 * med_on},
        "no_capture_ms": {"min": 1e3 * min_off, "median": 1e3 * med_off},
        "overhead_pct_median": 100.0 * (med_on / med_off - 1.0),
        "overhead_pct_min": 100.0 * (min_on / min_off - 1.0),
        "overhead_pct_paired_median": 100.0 * paired / med_off,
        "finish_ms_median": 1e3 * med_fin, "finish_pct_of_step": 100.0 * med_fin / med_off,
        "recorder_calls_ms_median": 1e3 * med_inside,
        "overhead_pct_recorder_calls": 100.0 * med_inside / med_off, "vary_batch": args.vary_batch,
        "capture_file_bytes": cap_size,
        "host_syncs": {
            "recorder_before_finish": rec_loop,
            "recorder_before_finish_per_microbatch": rec_loop / max(n_mb, 1),
            "added_before_finish_vs_no_capture": added_loop,
            "added_before_finish_per_microbatch": added_loop / max(n_mb, 1),
            "recorder_in_finish": sc_on.total("finish", "recorder"),
            "trainer_before_finish_capture": sc_on.total("loop", "trainer"),
            "trainer_before_finish_no_capture": sc_off.total("loop", "trainer"),
            "recorder_before_finish_by_method": sc_on.by_method("loop", "recorder"),
            "recorder_in_finish_by_method": sc_on.by_method("finish", "recorder"),
        },
    }
    syncs_ok = rec_loop == 0 and added_loop == 0
    res["target_met_recorder_calls"] = bool(res["overhead_pct_recorder_calls"] < 5.0 and syncs_ok)
    res["target_met_end_to_end"] = bool(res["overhead_pct_paired_median"] < 5.0 and syncs_ok)

    print(f"recorder overhead, mini trainer, CPU, world 1, {args.threads} thread(s), {args.dtype}: "
          f"{args.samples} samples, {n_mb} micro-batches, {tokens} tokens ({owned} response), "
          f"dim {args.dim}, vocab {args.vocab}; {args.steps} interleaved steps per mode after {args.warmup} warm-up")
    print(f"  {'mode':<12}{'min ms':>10}{'median ms':>12}")
    print(f"  {'no-capture':<12}{1e3 * min_off:>10.2f}{1e3 * med_off:>12.2f}")
    print(f"  {'capture':<12}{1e3 * min_on:>10.2f}{1e3 * med_on:>12.2f}")
    print(f"  end to end: {res['overhead_pct_median']:+.2f} % (medians), {res['overhead_pct_min']:+.2f} % (mins), "
          f"{res['overhead_pct_paired_median']:+.2f} % (median paired difference)")
    print(f"  inside the recorder's calls: {1e3 * med_inside:.2f} ms = {res['overhead_pct_recorder_calls']:.2f} % of a "
          f"no-capture step, of which finish() {1e3 * med_fin:.2f} ms"
          + (f" (file {cap_size} B)" if cap_size else ""))
    hs = res["host_syncs"]
    print(f"  host value reads before finish(): recorder {rec_loop} ({hs['recorder_before_finish_per_microbatch']:g} "
          f"per micro-batch), added vs no-capture {added_loop}; trainer's own {hs['trainer_before_finish_capture']} "
          f"(capture) / {hs['trainer_before_finish_no_capture']} (no-capture); in finish(): {hs['recorder_in_finish']}")
    print(f"  target (< 5 % of a step, no host sync per micro-batch): "
          f"{'met' if res['target_met_recorder_calls'] else 'NOT met'} by the time inside the recorder's calls, "
          f"{'met' if res['target_met_end_to_end'] else 'NOT met'} by the paired end-to-end difference")
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
