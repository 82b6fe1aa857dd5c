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
  steps), judged by audit's decision check on every pipeline stage;
* every loss type of its ``loss_function`` (loss.py:1615-1640 @36882ca) measured or refused at init: ``policy_loss``
  (the token-global estimators ``reinforce_plus_plus*`` too: their mask-safe reducer,
  ``_get_reinforce_plus_plus_mask_safe_reducer`` L810-827, reduces ``torch.where(mask, x, 0)``, and the entropy and
  KL terms are recognised by the tensor handed to it; Relax runs them at CP 1 only, spec.py:267-297 @53a6045),
  ``sft`` (``-sum_of_sample_mean(log_probs)``; with ``--sft-chunked-logits`` the model returns hidden states and
  ``sft_loss_function_chunked`` L1488-1530 runs the output layer per sub-chunk through ``lm_head_forward``: the
  same reduction of the same log-probs, measured the same), ``custom_loss`` (:func:`per_token`); ``value_loss`` is
  the critic's, not audited; ``dpo``, ``rm``, ``sft`` with ``--task-type seq_cls``, ``--mtp-only-training``,
  ``--recompute-loss-function``, ``--opd-loss-coef`` and ``--custom-tis-function-path`` are refused, each with
  its reason (:func:`refusals`);
* off-policy steps (``true_on_policy_mode`` off, L876-908: the old log-probs are the actor's, the ratio is not 1
  and clipping fires), TIS (``--use-tis``, L997-1044: ``pg_loss x clamp(exp(old - rollout))``, the reducer rebuilt
  with the same masks and denominators) and OPSM (``--use-opsm``, L961-994: ``pg_loss x`` a 0/1 per sample): each
  multiplies the per-token policy loss before its reduction, so it lies inside the measured per-token loss ``l_t``
  and leaves the weights ``w_t`` to the normalisation — measured (tests/trainers/test_relax_source.py, at CP 1
  and 2, with ``main_grad = sum w_t grad l_t`` against the clipped surrogate's own gradient).
"""
from typing import Any

import torch

from . import slime as _slime
from .slime import Trainer

__all__ = ["init", "before_train_step", "install", "per_token", "refusals", "RelaxAdapter", "RELAX"]

def refusals(args: Any) -> list[str]:
    """Relax's loss paths the adapter does not measure (redai-studio/Relax relax/backends/megatron/loss.py
    @36882ca), refused at init naming the flag — never a silent gap."""
    bad = []
    loss_type = str(getattr(args, "loss_type", "policy_loss"))
    if loss_type in ("dpo", "rm"):    # dpo_loss_function L1292, reward_model_loss_function L1369: sum pair losses
        bad.append(f"--loss-type {loss_type} (its loss is a sum of per-pair losses that never reaches the reducer: "
                   f"no per-token loss to weigh)")
    if loss_type == "sft" and getattr(args, "task_type", None) == "seq_cls":     # L1441-1479: one loss per sample
        bad.append("--task-type seq_cls (a loss per sample, not per token)")
    if getattr(args, "mtp_only_training", False):         # mtp_only_loss_function L1533: 0 x hidden states
        bad.append("--mtp-only-training (the MTP loss is not handed to the reducers)")
    if getattr(args, "recompute_loss_function", False):   # L1642-1650: the loss inside a reentrant checkpoint
        bad.append("--recompute-loss-function (the loss runs inside a checkpoint: its per-token tensor is rebuilt "
                   "in backward, where the adapter does not see it)")
    if float(getattr(args, "opd_loss_coef", 0.0) or 0.0) != 0.0:   # L1093-1102: its own micro-batch token mean
        bad.append("--opd-loss-coef != 0 (the on-policy distillation term is reduced per micro-batch outside the "
                   "hooked reducers)")
    if getattr(args, "custom_tis_function_path", None) and (getattr(args, "use_tis", False)
                                                           or getattr(args, "get_mismatch_metrics", False)):
        # L1024-1044: a TIS function returns the response masks the policy reducer is rebuilt with (numerators)
        # over the original denominators; a custom one may reject tokens (rejection sampling) the capture's
        # masks still count. The built-in vanilla_tis_function (L747-775) returns the masks unchanged: measured.
        bad.append("--custom-tis-function-path (its modified response masks become the policy reducer's numerators "
                   "over the original denominators, loss.py:1035-1044: tokens it rejects would read as unweighted "
                   "effective tokens)")
    return bad


RELAX = Trainer("relax", "relax.backends.megatron.model", "relax.backends.megatron.loss",
                "redai-studio/Relax model.py, loss.py, data.py @36882ca, cp_utils.py @55634da",
                index_keys=("sample_indices", "partition"), denoms_key="sample_index_mask_sums",
                micro_batch=lambda b: dict(cp_size=b.get("dynamic_cp_size"), cp_rank=b.get("dynamic_cp_rank"),
                                           dummy=bool(b.get("__is_dummy__", False))),
                sft_loss_types=("sft",), refusals=refusals)


#: Relax is described once, by its :class:`Trainer` record above: its adapter class is the record's, and the
#: per-process audit is slime's own for that record (``RelaxAudit(RELAX, args, out_dir)``: an alias).
RelaxAdapter = RELAX.adapter_class
RelaxAudit = _slime.SlimeAudit


def install(args: Any, out_dir: str | None = None, **options: Any) -> _slime.SlimeAudit:
    """:func:`lossguard_capture.slime.install` for Relax."""
    return _slime.install(args, out_dir, trainer=RELAX, **options)


def init(args: Any) -> None:
    """``--custom-megatron-init-path lossguard_capture.relax.init``."""
    install(args)
    _slime._chain("LOSSGUARD_CHAIN_INIT", args)


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    """``--custom-megatron-before-train-step-hook-path lossguard_capture.relax.before_train_step``."""
    _slime.before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler, trainer=RELAX)


def per_token(t: torch.Tensor, *, term: str | None = None) -> torch.Tensor:
    """In a ``--custom-loss-function-path`` loss: hand lossguard the per-token losses before reducing them."""
    return _slime.per_token(t, term=term)
