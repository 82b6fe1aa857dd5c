"""An audited Relax run, switched on by Relax's own plug-in flags (it keeps slime's): no edit to Relax's source.

    LOSSGUARD_OUT=captures LOSSGUARD_STEPS=0 python train.py ...  \\
        --custom-megatron-init-path lossguard_capture.relax.init \\
        --custom-megatron-before-train-step-hook-path lossguard_capture.relax.before_train_step

The mechanism is :mod:`lossguard_capture.slime`'s (its docstring: the names hooked, the environment), on
Relax's modules ``relax.backends.megatron.model`` / ``.loss`` (read at redai-studio/Relax model.py, loss.py
and data.py @36882ca, cp_utils.py @55634da, initialize.py @78973a5, misc.py @b71db72), with what Relax adds:

* ``loss_function(args, batch, num_microbatches, logits, *, lm_head_forward=None)`` (no
  step_global_batch_size: ``batch["dynamic_global_batch_size"]`` or ``args.global_batch_size``);
* a CP size chosen per micro-batch: ``batch["dynamic_cp_size"]`` / ``["dynamic_cp_rank"]`` (the sub-group of
  consecutive CP ranks that trains the micro-batch's share of samples; the samples a sub-group keeps are
  matched to the iterator's rows by their tokens);
* dummy micro-batches (``__is_dummy__``: recorded as dummy, their loss x 0) and ``__loss_scale__`` (its
  effect is in the measured weights);
* the samples' global indices from the rollout's ``sample_indices``; the sample-mean denominators
  ``sample_index_mask_sums``;
* the zero-token skip of PR #285 (``_is_global_zero_token_step``: neither the optimizer nor the LR scheduler
  steps), judged by audit's decision check on every pipeline stage.
"""
from typing import Any

import torch

from . import megatron as _lcm
from . import slime as _slime
from .slime import Trainer

__all__ = ["init", "before_train_step", "install", "per_token", "RelaxAdapter", "RELAX"]

RELAX = Trainer("relax", "relax.backends.megatron.model", "relax.backends.megatron.loss",
                "redai-studio/Relax model.py, loss.py, data.py @36882ca, cp_utils.py @55634da",
                index_keys=("sample_indices", "partition"), denoms_key="sample_index_mask_sums",
                micro_batch=lambda b: dict(cp_size=b.get("dynamic_cp_size"), cp_rank=b.get("dynamic_cp_rank"),
                                           dummy=bool(b.get("__is_dummy__", False))))


class RelaxAdapter(_lcm.MegatronAdapter):
    """The Megatron adapter under Relax's plug-in points (its captures say ``trainer: relax``)."""

    spec = _slime._spec(RELAX)


class RelaxAudit(_slime.SlimeAudit):
    adapter_class = RelaxAdapter


def install(args: Any, out_dir: str | None = None, **options: Any) -> _slime.SlimeAudit:
    """:func:`lossguard_capture.slime.install` for Relax."""
    return _slime.install(args, out_dir, trainer=RELAX, audit_class=RelaxAudit, **options)


def init(args: Any) -> None:
    """``--custom-megatron-init-path lossguard_capture.relax.init``."""
    install(args)
    _slime._chain("LOSSGUARD_CHAIN_INIT", args)


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    """``--custom-megatron-before-train-step-hook-path lossguard_capture.relax.before_train_step``."""
    _slime.before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler, trainer="relax")


def per_token(t: torch.Tensor, *, term: str | None = None) -> torch.Tensor:
    """In a ``--custom-loss-function-path`` loss: hand lossguard the per-token losses before reducing them."""
    return _slime.per_token(t, term=term)
