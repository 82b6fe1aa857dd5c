"""lossguard-capture: record a trainer's own loss-normalisation numbers for `lossguard audit` (docs/semantics.md §10).

Two ways in, nothing else:

* :mod:`lossguard_capture.hf`, ``.trl``, ``.megatron``, ``.verl`` — the trainer adapters (imported on use), all
  entered the same way, on every rank before training::

      run = lossguard_capture.hf.attach(trainer, "captures", steps=(0,), fail_fast=True)
      trainer.train()          # run.paths, run.results, run.verdicts

  (``attach(target, out_dir, *, steps=..., fail_fast=..., ...)``; :mod:`lossguard_capture.adapter` is their
  shared base).
* :class:`Capture` — any other trainer: one per run; ``with cap.step(n) as s:`` records rank-local step ``n``::

      cap = lossguard_capture.Capture("captures", reduce="per-token", cp=cp)
      with cap.step(n) as s:
          h = s.microbatch(sample_indices=..., tokens=..., total_lengths=..., response_lengths=...,
                           loss_masks=..., cp_size=cp)
          loss = (h.hook(per_token_loss) * mask).sum() / num_tokens
          h.loss(loss)
          loss.backward()
          ...
          s.finish(grad_scale=..., num_tokens_reduced=..., skipped=..., grad_norm=...)

:func:`run_audit` / :class:`AuditFailed` run ``lossguard audit`` from the training job (fail fast).
:class:`Recorder`, the first, positional API, is deprecated (a ``DeprecationWarning``): it is kept so that the
code that wrote older captures still runs; new code uses :class:`Capture`.
"""

from ._version import __version__
from .adapter import Adapter, Spec
from .audit import AuditError, AuditFailed, AuditResult, find_lossguard, run_audit
from .capture import Capture, InactiveStep, coordinates
from .recorder import (
    CP_LAYOUTS,
    REDUCE_CHOICES,
    SCHEMA,
    TERM_MASKS,
    CaptureWarning,
    MicroBatch,
    Recorder,
    StepRecorder,
    capture_filename,
    check_terms,
)
from .zigzag import (
    owned_count,
    zigzag_chunk_size,
    zigzag_local_logit_index,
    zigzag_owned,
    zigzag_owned_logit_positions,
    zigzag_slices,
)

__all__ = [
    "__version__", "Adapter", "Spec",
    "Capture", "StepRecorder", "InactiveStep", "MicroBatch", "Recorder", "coordinates",
    "SCHEMA", "REDUCE_CHOICES", "CP_LAYOUTS", "TERM_MASKS", "CaptureWarning", "capture_filename", "check_terms",
    "AuditFailed", "AuditError", "AuditResult", "run_audit", "find_lossguard",
    "zigzag_owned", "zigzag_slices", "zigzag_chunk_size", "zigzag_owned_logit_positions", "zigzag_local_logit_index",
    "owned_count",
]
