#!/usr/bin/env python3
"""verl's own actor loss (``losses.ppo_loss``) audited without an FSDP engine: one step of two micro-batches,
called as verl's engine calls it — ``loss_fn(model_output={"log_probs": ...}, data=micro_batch)`` after
``partial(ppo_loss, config=...)`` (workers/engine_workers.py:643); ``data`` a TensorDict of nested per-sample
fields with the step's numbers as non-tensor data (``dp_size``, ``batch_num_tokens``: the mini-batch's mask
total over DP, ``global_batch_size``). ``token-mean`` passes; ``--mode seq-mean-token-sum-norm`` (each
micro-batch over its own longest response) fails and fail fast stops before the update.

    python examples/verl_audit.py --out captures [--mode seq-mean-token-sum-norm] [--lossguard-bin ...]

Needs verl 0.9.1 (scripts/setup-trainers.sh verl installs it in ~/.cache/lossguard/venv-verl).
"""
import argparse, functools, os, sys  # noqa: E401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))  # if not installed
os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")

import torch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import lossguard_capture.verl  # noqa: E402

V = 32
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Tanh(), torch.nn.Linear(16, V))


def nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def micro_batch(samples, n_tokens, batch_size):
    """What verl's engine hands the loss: nested per-sample fields and the step's numbers."""
    fields = {"prompts": nested(p for p, r, m in samples), "responses": nested(r for p, r, m in samples),
              "input_ids": nested(torch.cat([p, r]) for p, r, m in samples),
              "response_mask": nested(m for p, r, m in samples),
              "old_log_probs": nested(torch.zeros(len(r)) - 3.0 for p, r, m in samples),   # an older policy's
              "advantages": nested(torch.full((len(r),), 1.0 - i % 2) for i, (p, r, m) in enumerate(samples))}
    return tu.get_tensordict(fields, dict(dp_size=1, batch_num_tokens=n_tokens, global_batch_size=batch_size))


def log_probs(input_ids):                       # per position: log p(next token), packed (verl's layout)
    ids = input_ids.values()
    lp = torch.log_softmax(model(ids), -1).gather(-1, torch.roll(ids, -1)[:, None])[:, 0]
    return torch.nested.nested_tensor_from_jagged(lp, offsets=input_ids.offsets())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="token-mean", help="loss_agg_mode")
    ap.add_argument("--lossguard-bin", default=None)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    samples = [(torch.randint(1, V, (3,), generator=g), torch.randint(1, V, (n,), generator=g),
                torch.tensor([1] * n if n != 2 else [0, 0])) for n in (7, 2, 4, 5)]     # sample 1 fully masked
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                             loss_agg_mode=a.mode, policy_loss=PolicyLossConfig(loss_mode="vanilla"))
    cap = lossguard_capture.verl.VerlAdapter(a.out, lossguard_bin=a.lossguard_bin)           # step 0, fail fast
    loss_fn = cap.wrap(functools.partial(ppo_loss, config))                                 # as the worker sets it
    n_tokens = int(sum(m.sum() for _, _, m in samples))
    cap.begin_step(0, dp=1, dp_rank=0, global_batch_size=len(samples))
    for mb in (samples[:2], samples[2:]):
        data = micro_batch(mb, n_tokens, len(samples))
        loss, _ = loss_fn(model_output={"log_probs": log_probs(data["input_ids"])}, data=data)
        loss.backward()
    try:
        cap.finish_step(grad_scale=1.0)         # 1/dp: FSDP's mean over DP
    except lossguard_capture.AuditFailed as e:
        print(f"stopped at step {e.step} by lossguard audit (exit {e.exit_code}), before the update")
        sys.exit(1)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    print("step 0 audited: pass; the update applied")


if __name__ == "__main__":
    main()
