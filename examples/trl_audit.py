#!/usr/bin/env python3
"""TRL's real GRPOTrainer and SFTTrainer, audited by lossguard with the adapter's one line.

A word-level tokenizer and a tiny Llama built in-process (no download), CPU, gradient accumulation 2.
GRPO's default loss_type ``dapo`` normalises by the generation batch's tokens: PASS. ``--loss-type bnpo``
normalises each micro-batch by its own tokens: the audit of step 0 fails and fail fast stops training
before the optimizer applies it. ``--sft``: SFTTrainer on prompt/completion pairs (completion-only loss).

    python examples/trl_audit.py --out captures [--loss-type bnpo | --sft] [--lossguard-bin build/cli/lossguard]
    lossguard audit captures/step000000

Needs trl 1.16 (scripts/setup-trainers.sh installs it in ~/.cache/lossguard/venv-hf).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))  # if not installed

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import lossguard_capture  # noqa: E402
import lossguard_capture.trl  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>"] + list("abcdefghijklm")


def tokenizer():
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where the captures go (one directory per captured step)")
    ap.add_argument("--loss-type", default="dapo", help="GRPO's loss_type (dapo: PASS; bnpo: FAIL at GA 2)")
    ap.add_argument("--sft", action="store_true", help="SFTTrainer instead of GRPOTrainer")
    ap.add_argument("--lossguard-bin", default=None, help="the lossguard binary (else $LOSSGUARD_BIN or PATH)")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=None))
    common = dict(output_dir=os.path.join(a.out, "trl"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  max_steps=2, learning_rate=0.05, use_cpu=True, report_to=[], save_strategy="no", seed=2,
                  disable_tqdm=True, logging_strategy="no")
    if a.sft:
        pairs = [{"prompt": " ".join(WORDS[3 + (i * 7 + k) % 13] for k in range(1 + i % 4)),
                  "completion": "".join(" " + WORDS[3 + (i * 5 + k) % 13] for k in range(1 + i % 6))} for i in range(16)]
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, max_length=32), processing_class=tokenizer(),
                             train_dataset=Dataset.from_list(pairs))
    else:
        prompts = ["a b", "c d e", "f", "g h i j", "k l", "m a b c d", "e f g", "h"] * 2

        def reward(completions, **kw):          # how many a's and b's the completion holds
            return [float(sum(w in ("a", "b") for w in c.split())) for c in completions]
        trainer = GRPOTrainer(model=model, reward_funcs=reward, processing_class=tokenizer(),
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              args=GRPOConfig(**common, loss_type=a.loss_type, num_generations=2,
                                              max_completion_length=8))

    lossguard_capture.trl.attach(trainer, a.out, lossguard_bin=a.lossguard_bin)  # step 0, fail fast
    try:
        trainer.train()
    except lossguard_capture.AuditFailed as e:
        print(f"training stopped at step {e.step} by lossguard audit (exit {e.exit_code}), before its update")
        sys.exit(1)
    print("training finished; step 0 audited: pass")


if __name__ == "__main__":
    main()
