#!/usr/bin/env python3
"""Runs the real ``transformers.Trainer.train`` on a tiny Llama (built from a config, CPU, no downloads)
under several loss-normalisation configurations, each twice from the same seed: with the lossguard
adapter attached and without it, and writes what the tests compare.

    python tests/trainers/hf_driver.py --out DIR --configs ga1-kw,ga2-nokw,...            # one process
    torchrun --standalone --nproc-per-node 2 tests/trainers/hf_driver.py --out DIR --configs ...

A config name is ``ga{G}-{kw|nokw}[-noavg][-empty][-dropnum]``: gradient accumulation G; ``kw`` a model that accepts
loss kwargs (the Trainer normalises by num_items_in_batch), ``nokw`` one that does not
(``accepts_loss_kwargs = False``, as Qwen2.5-VL: the Trainer averages each micro-batch); ``-noavg`` turns
``average_tokens_across_devices`` off; ``-empty`` makes samples 0 and 1 fully masked and samples the data
in order (no shuffle), so that step 0's first micro-batch (DP 1) has no token that carries loss;
``-dropnum``: a Trainer subclass whose compute_loss drops ``num_items_in_batch`` (calls the model without
it: a per-micro-batch mean) while the Trainer, seeing a model that accepts loss kwargs, takes the loss as
already scaled for gradient accumulation and does not divide it by G.  Per config and run (``DIR/<config>/{adapter,plain}/``):

* ``losses-rank{r}.pt`` — every micro-batch's ``training_step`` return value (the scalar the Trainer
  backpropagated, detached), in order;
* ``grads-step{n}-rank{r}.pt`` — every parameter's ``.grad`` at ``on_pre_optimizer_step`` (after the
  Trainer's backward and DDP's all-reduce, before the optimizer), steps 0 and 1;
* ``params-step{n}-rank{r}.pt`` — the parameters the step's forward used;
* ``captures/`` (adapter runs) — the adapter's capture files, ``captures/step{n:06d}/...``.

``--fail-fast CONFIG``: only that config, with the adapter and fail_fast; a rank that gets
``lossguard_capture.AuditFailed`` writes ``DIR/failfast-rank{r}.json`` (the global step, exit code, text,
whether the parameters were still those of the step's start) and re-raises, so the process exits non-zero.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import lossguard_capture as lc  # noqa: E402
import lossguard_capture.hf  # noqa: E402,F401

SEED = 1234
VOCAB = 96
BS = 2                    # per_device_train_batch_size
STEPS = 2                 # optimizer steps per run (both captured)
N_SAMPLES = 40
PAD = 0


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=PAD, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


class NoKwargsLlamaForCausalLM(LlamaForCausalLM):
    """A causal LM whose forward the Trainer may not give loss kwargs (as Qwen2.5-VL, Gemma 4 ...:
    ``accepts_loss_kwargs = False``): no num_items_in_batch, so the model's loss is a per-micro-batch mean."""
    accepts_loss_kwargs = False


def make_model(kwargs_ok: bool) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    cls = LlamaForCausalLM if kwargs_ok else NoKwargsLlamaForCausalLM
    m = cls(model_config())
    return m


def dataset(empty=False):
    """Deterministic samples {input_ids, labels}: lengths 3..20, a prompt of 1..5 tokens masked with -100,
    every 7th sample fully masked (all labels -100), every 5th with a masked hole in its response;
    ``empty``: samples 0 and 1 fully masked too."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for i in range(N_SAMPLES):
        T = int(torch.randint(3, 21, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (T,), generator=g)
        labels = ids.clone()
        P = int(torch.randint(1, min(6, T), (1,), generator=g))
        labels[:P] = -100
        if i % 7 == 3 or (empty and i < 2):
            labels[:] = -100
        if i % 5 == 1 and T - P > 3:
            labels[P + 1:P + 3] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def collate(rows):
    """Right-pads input_ids with PAD, labels with -100."""
    L = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), L), PAD, dtype=torch.int64)
    lab = torch.full((len(rows), L), -100, dtype=torch.int64)
    att = torch.zeros((len(rows), L), dtype=torch.int64)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[b, :n] = torch.tensor(r["input_ids"])
        lab[b, :n] = torch.tensor(r["labels"])
        att[b, :n] = 1
    return {"input_ids": ids, "labels": lab, "attention_mask": att}


class RecordingTrainer(Trainer):
    """Keeps what training_step returns: the loss it handed accelerator.backward, detached."""

    def __init__(self, *a, in_order=False, drop_num=False, **k):
        super().__init__(*a, **k)
        self.step_losses = []
        self.in_order = in_order
        self.drop_num = drop_num

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.drop_num:       # a custom compute_loss that forgets num_items_in_batch
            num_items_in_batch = None
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _get_train_sampler(self, train_dataset=None):
        if self.in_order:
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)
        return super()._get_train_sampler(train_dataset)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_losses.append(loss.detach().clone())
        return loss


class GradDump(TrainerCallback):
    """Saves the parameters at a step's start and the gradients the optimizer is about to apply."""

    def __init__(self, out, rank):
        self.out, self.rank = out, rank
        self.model = None

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.model = model
        if state.global_step < STEPS:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                       os.path.join(self.out, f"params-step{state.global_step}-rank{self.rank}.pt"))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step < STEPS:
            torch.save({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                        for n, p in model.named_parameters()},
                       os.path.join(self.out, f"grads-step{state.global_step}-rank{self.rank}.pt"))


def parse(name):
    """(gradient accumulation, model accepts loss kwargs, average_tokens_across_devices, empty variant)."""
    parts = name.split("-")
    return int(parts[0][2:]), parts[1] == "kw", "noavg" not in parts, "empty" in parts


def run(config, out, rank, world, adapter, fail_fast, lossguard_bin):
    ga, kw, avg, empty = parse(config)
    os.makedirs(out, exist_ok=True)
    args = TrainingArguments(
        output_dir=os.path.join(out, "hf-out"), per_device_train_batch_size=BS, gradient_accumulation_steps=ga,
        max_steps=STEPS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", eval_strategy="no", seed=SEED, data_seed=SEED, dataloader_num_workers=0,
        disable_tqdm=True, average_tokens_across_devices=avg, ddp_backend="gloo" if world > 1 else None,
        remove_unused_columns=False, ddp_find_unused_parameters=False)
    model = make_model(kw)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset(empty), data_collator=collate,
                               in_order=empty, drop_num="dropnum" in config)
    dump = GradDump(out, rank)
    trainer.add_callback(dump)
    cb = None
    if adapter:
        cb = lossguard_capture.hf.attach(trainer, os.path.join(out, "captures"), steps=range(STEPS),
                                         fail_fast=fail_fast, lossguard_bin=lossguard_bin, timeout=60)
    try:
        trainer.train()
    except lc.AuditFailed as e:
        start = torch.load(os.path.join(out, f"params-step{trainer.state.global_step}-rank{rank}.pt"))
        unchanged = all(torch.equal(p.detach(), start[n]) for n, p in trainer.model.named_parameters())
        with open(os.path.join(out, f"failfast-rank{rank}.json"), "w") as f:
            json.dump({"global_step": trainer.state.global_step, "exit_code": e.exit_code, "text": e.text,
                       "message": str(e), "params_unchanged": unchanged}, f)
        raise
    finally:
        torch.save(trainer.step_losses, os.path.join(out, f"losses-rank{rank}.pt"))
    meta = {"config": config, "ga": ga, "kwargs": kw, "avg": avg, "empty": empty, "world": world,
            "model_accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "audit": {str(k): v.to_json() for k, v in (cb.results.items() if cb else [])}}
    with open(os.path.join(out, f"meta-rank{rank}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if world > 1:
        torch.distributed.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="", help="comma-separated configs: each run with and without the adapter")
    ap.add_argument("--audit-in-run", default="", help="configs whose adapter run also audits step 0 (fail_fast)")
    ap.add_argument("--fail-fast", default=None, metavar="CONFIG", help="only CONFIG, adapter with fail_fast")
    ap.add_argument("--lossguard-bin", default=None)
    a = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    if a.fail_fast:
        run(a.fail_fast, os.path.join(a.out, a.fail_fast), rank, world, True, True, a.lossguard_bin)
        return
    in_run = set(c for c in a.audit_in_run.split(",") if c)
    for config in [c for c in a.configs.split(",") if c]:
        run(config, os.path.join(a.out, config, "adapter"), rank, world, True, config in in_run, a.lossguard_bin)
        run(config, os.path.join(a.out, config, "plain"), rank, world, False, False, None)


if __name__ == "__main__":
    main()
