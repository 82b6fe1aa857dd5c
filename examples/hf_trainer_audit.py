#!/usr/bin/env python3
"""The real Hugging Face ``transformers.Trainer``, audited by lossguard with the adapter's lines.

A tiny Llama built from a config (no download), a few token lists with masked prompts and one fully masked
sample, gradient accumulation 2 on CPU. With a model that accepts loss kwargs the Trainer normalises by
``num_items_in_batch`` and the audit passes; ``--no-loss-kwargs`` gives a model that declares
``accepts_loss_kwargs = False`` (as Qwen2.5-VL does in transformers 5.24): the Trainer then averages each
micro-batch, the audit of step 0 fails, and fail fast stops training before the optimizer applies it.

    python examples/hf_trainer_audit.py --out captures [--no-loss-kwargs] [--lossguard-bin build/cli/lossguard]
    lossguard audit captures/step000000

Needs transformers 5.24 and accelerate (scripts/setup-trainers.sh installs them in ~/.cache/lossguard/venv-hf).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # the recorder, when not pip-installed

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import lossguard_capture  # noqa: E402
import lossguard_capture.hf  # noqa: E402


class NoLossKwargsLlama(LlamaForCausalLM):
    accepts_loss_kwargs = False  # the Trainer passes no num_items_in_batch: a mean per micro-batch


def samples():
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        n = int(torch.randint(4, 16, (1,), generator=g))
        ids = torch.randint(3, 64, (n,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, 4, (1,), generator=g))] = -100  # the prompt carries no loss
        if i == 5:
            labels[:] = -100  # a fully masked sample
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    labels = torch.full((len(rows), width), -100, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        labels[b, : len(r["labels"])] = torch.tensor(r["labels"])
        mask[b, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where the captures go (one directory per captured step)")
    ap.add_argument("--no-loss-kwargs", action="store_true", help="a model the Trainer gives no num_items_in_batch")
    ap.add_argument("--lossguard-bin", default=None, help="the lossguard binary (else $LOSSGUARD_BIN or PATH)")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = (NoLossKwargsLlama if args.no_loss_kwargs else LlamaForCausalLM)(config)
    trainer = Trainer(model=model, train_dataset=samples(), data_collator=collate,
                      args=TrainingArguments(output_dir=os.path.join(args.out, "trainer"), use_cpu=True,
                                             per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                             max_steps=2, learning_rate=1e-3, report_to=[],
                                             remove_unused_columns=False, save_strategy="no"))

    lossguard_capture.hf.attach(trainer, args.out, lossguard_bin=args.lossguard_bin)  # step 0, fail fast
    try:
        trainer.train()
    except lossguard_capture.AuditFailed as e:
        print(e)
        print(f"training stopped at step {e.step} by lossguard audit (exit {e.exit_code}), before its update")
        sys.exit(1)
    print("training finished; step 0 audited: pass")


if __name__ == "__main__":
    main()
