#!/usr/bin/env python3
"""What the Hugging Face adapter costs a real ``transformers.Trainer`` run, mode by mode (issue #55's goals):

    python bench/adapter_overhead.py [--vocab 2048,131072] [--repeats 5] [--steps 4] [--seq 128] [--bs 2]
        [--ga 2] [--binary build/cli/lossguard] [--device cpu] [--json FILE]

One process, CPU by default (``--device cuda`` where there is one: scripts/gpu-check runs it), a tiny Llama
built from its config (2 layers, hidden 64, no download) at each ``--vocab``, ``--ga`` micro-batches of
``--bs`` rows of ``--seq`` tokens per step, SGD. Four modes, each a whole ``trainer.train()`` of ``--steps``
optimizer steps from the same seed on the same data:

* ``plain``: no adapter (the reference);
* ``attached``: ``attach(trainer, out, steps=(10**9,), fail_fast=False)``: installed, no step recorded;
* ``recording``: ``steps=None, fail_fast=False``: every step recorded and written, never audited;
* ``default``: ``steps=(0,), fail_fast=True``: step 0 recorded and audited by ``--binary`` before its update.

Timing: every optimizer step's wall time (a TrainerCallback, on_step_begin to on_step_end), the first step of
each run left out as warm-up except in ``default`` (its step 0 is the audited one, reported alone). The modes
run interleaved ``--repeats`` times (plain, attached, recording, default, then again), so drift hits them alike;
reported: min and median per mode, and the ratio of each median to plain's median measured in the same run. In
``default`` the ``lossguard audit`` subprocess and the verdict's hand-over (``agree``) are timed apart from the
step. Host synchronisation: one more recorded step with torch.Tensor.item/cpu/tolist/numpy/__bool__/__int__/
__float__ counted where lossguard_capture's code makes the call, split into calls before the step's end (per
micro-batch: the goal is 0) and at it.

Prints a table per vocabulary and one JSON line (``JSON {...}``).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import lossguard_capture.adapter as ladapter  # noqa: E402
import lossguard_capture.hf as lhf  # noqa: E402

from overhead_common import MODES, SyncCounter, Timed, show_modes, summarise  # noqa: E402

def make_model(vocab, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg)


def make_data(vocab, n, seq, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g)
        labels = ids.clone()
        labels[: seq // 4] = -100                              # a prompt
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t0 = [], None

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t0)


class StepEnd(TrainerCallback):
    """Marks the step's end for the SyncCounter: the adapter's step end is its on_pre_optimizer_step, which
    runs after this callback's (added first)."""

    def __init__(self, counter):
        self.counter = counter

    def on_step_begin(self, args, state, control, **kw):
        self.counter.at_step_end = False

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.counter.at_step_end = True


def run(mode, opt, vocab, data, out, counter=None):
    args = TrainingArguments(output_dir=os.path.join(out, "o"), per_device_train_batch_size=opt.bs,
                             gradient_accumulation_steps=opt.ga, max_steps=opt.steps if counter is None else 1,
                             optim="sgd", learning_rate=0.01, use_cpu=opt.device == "cpu", report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False, max_grad_norm=0.0, seed=1234, dataloader_num_workers=0)
    tr = Trainer(model=make_model(vocab, 1234), args=args, train_dataset=data, data_collator=collate)
    timer = StepTimer()
    if counter is not None:
        tr.add_callback(StepEnd(counter))
    tr.add_callback(timer)
    caps = os.path.join(out, "caps")
    audit = agree = None
    if mode == "attached":
        lhf.attach(tr, caps, steps=(10 ** 9,), fail_fast=False)          # a step the run never reaches
    elif mode == "recording":
        lhf.attach(tr, caps, steps=None, fail_fast=False)
    elif mode == "default":
        audit, agree = Timed(ladapter, "run_audit"), Timed(ladapter, "agree")
        lhf.attach(tr, caps, steps=(0,), fail_fast=True, lossguard_bin=opt.binary)
    try:
        tr.train()
    finally:
        if audit is not None:
            audit.restore()
            agree.restore()
    shutil.rmtree(out, ignore_errors=True)
    return timer.times, (audit.total if audit else None), (agree.total - audit.total if agree else None)


def bench_vocab(opt, vocab):
    data = make_data(vocab, opt.bs * opt.ga * opt.steps, opt.seq, 7)
    steps = {m: [] for m in MODES}
    audited, audit_s, handover_s = [], [], []
    tmp = tempfile.mkdtemp(prefix="lossguard-adapter-bench-")
    try:
        for rep in range(opt.repeats):
            for mode in MODES:
                times, a, h = run(mode, opt, vocab, data, os.path.join(tmp, f"{mode}-{rep}"))
                steps[mode] += times[1:]
                if mode == "default":
                    audited.append(times[0])
                    audit_s.append(a)
                    handover_s.append(h)
        counter = SyncCounter()
        with counter:
            run("recording", opt, vocab, data, os.path.join(tmp, "sync"), counter)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"vocab": vocab, "rows_per_microbatch": opt.bs * opt.seq, "microbatches": opt.ga,
           "modes": summarise(steps)}
    res["default_audited_step"] = {"median_ms": statistics.median(audited) * 1e3,
                                   "audit_subprocess_median_ms": statistics.median(audit_s) * 1e3,
                                   "verdict_handover_median_ms": statistics.median(handover_s) * 1e3,
                                   "step_without_audit_median_ms":
                                       statistics.median([s - a for s, a in zip(audited, audit_s)]) * 1e3}
    res["host_syncs_per_recorded_step"] = {"before_step_end": counter.before_end, "at_step_end": counter.at_end}
    return res


def show(r):
    print(f"\nvocab {r['vocab']}: {r['microbatches']} micro-batch(es) of {r['rows_per_microbatch']} rows per step")
    show_modes(r["modes"])
    d = r["default_audited_step"]
    print(f"  default's audited step 0: {d['median_ms']:.1f} ms median, of which lossguard audit "
          f"{d['audit_subprocess_median_ms']:.1f} ms, the verdict's hand-over {d['verdict_handover_median_ms']:.2f} ms")
    h = r["host_syncs_per_recorded_step"]
    print(f"  host-sync-prone calls by lossguard_capture per recorded step: {h['before_step_end']} before the step's "
          f"end (per micro-batch), {h['at_step_end']} at it")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="2048,131072")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--ga", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--binary", default=os.environ.get("LOSSGUARD_BIN", os.path.join(ROOT, "build", "cli",
                                                                                          "lossguard")))
    ap.add_argument("--json")
    ap.add_argument("--require-no-sync", action="store_true",
                    help="exit 1 when lossguard_capture makes a host-sync-prone call before a step's end")
    opt = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    try:
        for v in (int(x) for x in opt.vocab.split(",")):
            r = bench_vocab(opt, v)
            show(r)
            results.append(r)
    except Exception:                                   # noqa: BLE001 - say where
        traceback.print_exc()
        return 1
    doc = {"bench": "adapter_overhead", "adapter": "hf", "device": opt.device, "results": results}
    print("JSON " + json.dumps(doc))
    if opt.json:
        with open(opt.json, "w") as f:
            json.dump(doc, f, indent=1)
    synced = [r["vocab"] for r in results if r["host_syncs_per_recorded_step"]["before_step_end"]]
    if opt.require_no_sync and synced:
        print(f"adapter_overhead: host-sync-prone calls before the step's end at vocab {synced}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
