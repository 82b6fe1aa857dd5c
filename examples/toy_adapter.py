#!/usr/bin/env python3
"""Write an adapter: a whole one for a small training loop, in the shape every adapter of lossguard_capture has
(docs/adapters/write-an-adapter.md walks through it).

The loop (``ToyLoop``) is what a trainer looks like to an adapter: a model, an optimizer, a per-token loss
function, a reduction, and ``train_step(step, micro_batches)`` that runs forward and backward per micro-batch
and then ``optimizer.step()``. The adapter (``ToyAdapter``) says only what differs from every other adapter:

* a :class:`lossguard_capture.adapter.Spec` — the package it was checked against and what it relies on;
* ``_attach(loop)`` — where the loop's per-token loss, its step and its update are (instance attributes of the
  loop are wrapped; its class is untouched);
* per micro-batch: the samples it holds and the per-token loss tensor, hooked
  (``StepRecorder.microbatch(...).hook(per_token_loss)``);
* at the step's end, before the update: ``write_step`` (write the capture, or drop it) — the base class then
  keeps the path and, with fail fast, audits the step and raises ``AuditFailed`` on every rank before
  ``optimizer.step()`` applies it.

The module's ``attach`` is the base's, bound in one line: ``attach = make_attach(ToyAdapter, doc)``.

    python examples/toy_adapter.py --out captures [--bug] [--lossguard-bin build/cli/lossguard]

The loop's reduction is the sum over the step's effective tokens divided by their count (per-token): the audit
passes and the step is applied. ``--bug`` divides each micro-batch by its own count (a mean per micro-batch):
the audit of step 0 fails and the update never happens. Exit 0 when what happened is what was expected.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # the recorder, when not pip-installed

import torch  # noqa: E402

import lossguard_capture  # noqa: E402
from lossguard_capture.adapter import Adapter, Spec, make_attach  # noqa: E402

VOCAB, WIDTH = 32, 16


# ---- the trainer ------------------------------------------------------------------------------------------
class ToyLoop:
    """A language model's loop: rows of token ids, each row one sample whose first token is its prompt (a
    label at every later position, some masked). ``per_micro_batch_mean``: the bug (each micro-batch divided by
    its own count instead of the step's)."""

    def __init__(self, per_micro_batch_mean=False):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.per_micro_batch_mean = per_micro_batch_mean

    def per_token_loss(self, ids):
        """[B, L-1]: the cross entropy of each position's next token."""
        logits = self.model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                                 reduction="none").view(ids.shape[0], -1)

    def train_step(self, step, micro_batches):
        n = sum(int(mb["mask"].sum()) for mb in micro_batches)          # the step's effective tokens
        for mb in micro_batches:
            losses = self.per_token_loss(mb["ids"])
            count = mb["mask"].sum() if self.per_micro_batch_mean else n
            ((losses * mb["mask"]).sum() / max(float(count), 1.0)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


# ---- the adapter ------------------------------------------------------------------------------------------
SPEC = Spec("toy_adapter", "torch", ("2.0", "3.0"), lambda: torch.__version__.split("+")[0],
            "ToyLoop.per_token_loss, train_step and optimizer.step", loss_site="ToyLoop.train_step")


class ToyAdapter(Adapter):
    """Captures ``steps`` of a ToyLoop (what every adapter's ``attach`` returns: ``paths``, ``results``,
    ``verdicts``)."""

    spec = SPEC

    def _attach(self, loop, /, **where):
        self._rec, self._first = None, 0
        orig_step, orig_loss, orig_update = loop.train_step, loop.per_token_loss, loop.optimizer.step

        def train_step(step, micro_batches):
            # a step to record: open its recorder (world 1 here; a distributed loop passes its coordinates)
            self._rec = self.recorder(step, rank=0, world_size=1, dp=1, dp_rank=0) if self.should_capture(step) \
                else None
            self._first, self._masks = 0, iter([mb["mask"] for mb in micro_batches])
            try:
                return orig_step(step, micro_batches)
            finally:
                if self._rec is not None:       # the step never reached its update (an error): drop it
                    self._rec.abort()
                    self._rec = None

        def per_token_loss(ids):
            losses = orig_loss(ids)
            if self._rec is None:
                return losses
            B, L = ids.shape
            mask = next(self._masks)
            mb = self._rec.microbatch(sample_indices=torch.arange(self._first, self._first + B), tokens=ids.reshape(-1),
                                      total_lengths=torch.full((B,), L), response_lengths=torch.full((B,), L - 1),
                                      loss_masks=mask.reshape(-1), cp_size=1)
            self._first += B
            return mb.hook(losses.reshape(-1)).view(B, L - 1)          # the loop reduces the hooked tensor

        def update(*args, **kwargs):
            rec = self._rec
            if rec is not None:                 # every backward is done, the update not yet applied
                self._rec = None
                self.write_step(rec.step, lambda: rec.finish(grad_scale=1.0, skipped=False), rec.abort)
            return orig_update(*args, **kwargs)

        loop.train_step, loop.per_token_loss, loop.optimizer.step = train_step, per_token_loss, update


# the entry, ``attach(loop, out_dir, *, steps=(0,), fail_fast=True, **options)``: the base's, named after
# ``_attach``'s parameter; ``options`` are the Adapter's (lossguard_bin, audit_step, timeout...)
attach = make_attach(ToyAdapter, """
    Capture ``steps`` of ``loop`` into ``out_dir/step{n:06d}/``; with ``fail_fast`` audit the first and stop on
    FAIL before its update.""")


# ---- a run ------------------------------------------------------------------------------------------------
def micro_batches(step):
    """Two micro-batches of 2 and 3 rows of 8 tokens; row 0 of the first fully masked, the others partly."""
    g = torch.Generator().manual_seed(step)
    out = []
    for rows in (2, 3):
        ids = torch.randint(0, VOCAB, (rows, 8), generator=g)
        mask = (torch.rand(rows, 7, generator=g) > 0.3).float()
        out.append({"ids": ids, "mask": mask})
    out[0]["mask"][0] = 0
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bug", action="store_true", help="each micro-batch divided by its own count")
    ap.add_argument("--lossguard-bin", default=None)
    a = ap.parse_args()
    loop = ToyLoop(per_micro_batch_mean=a.bug)
    run = attach(loop, a.out, lossguard_bin=a.lossguard_bin)
    before = [p.detach().clone() for p in loop.model.parameters()]
    try:
        for step in range(2):
            loop.train_step(step, micro_batches(step))
    except lossguard_capture.AuditFailed as e:
        unchanged = all(torch.equal(p, q) for p, q in zip(loop.model.parameters(), before, strict=True))
        print(f"training stopped at step {e.step} by lossguard audit (exit {e.exit_code}); parameters "
              f"{'unchanged' if unchanged else 'CHANGED'}")
        return 0 if a.bug and unchanged else 1
    print(f"training finished; step 0 audited: {run.verdicts[0]}")
    return 0 if not a.bug and run.verdicts[0] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
