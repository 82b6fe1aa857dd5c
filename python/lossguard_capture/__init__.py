"""lossguard-capture: record a trainer's own loss-normalisation numbers for `lossguard audit` (docs/semantics.md §10).

* :class:`Capture` — one per run; ``with cap.step(n) as s:`` records rank-local step ``n``.
* :mod:`lossguard_capture.hf`, ``.trl``, ``.megatron``, ``.verl`` — the trainer adapters (imported on use), all
  entered the same way: ``attach(target, out_dir, *, steps=(0,), fail_fast=True, ...)``, returning the
  written ``paths`` and the audit ``verdicts`` (:mod:`lossguard_capture.adapter`, their shared base).
* :class:`Recorder` — the first, positional API (one object per step, coordinates given).
* :func:`run_audit` / :class:`AuditFailed` — run ``lossguard audit`` from the training job (fail fast).
"""

from ._version import __version__
from .adapter import Adapter, Spec
from .audit import AuditError, AuditFailed, AuditResult, find_lossguard, run_audit
from .capture import Capture, InactiveStep, coordinates
from .recorder import (CP_LAYOUTS, REDUCE_CHOICES, SCHEMA, TERM_MASKS, CaptureWarning, MicroBatch, Recorder,
                       StepRecorder, capture_filename, check_terms)
from .zigzag import (owned_count, zigzag_chunk_size, zigzag_local_logit_index, zigzag_owned,
                     zigzag_owned_logit_positions, zigzag_slices)

__all__ = [
    "__version__", "Adapter", "Spec",
    "Capture", "StepRecorder", "InactiveStep", "MicroBatch", "Recorder", "coordinates",
    "SCHEMA", "REDUCE_CHOICES", "CP_LAYOUTS", "TERM_MASKS", "CaptureWarning", "capture_filename", "check_terms",
    "AuditFailed", "AuditError", "AuditResult", "run_audit", "find_lossguard",
    "zigzag_owned", "zigzag_slices", "zigzag_chunk_size", "zigzag_owned_logit_positions", "zigzag_local_logit_index",
    "owned_count",
]
