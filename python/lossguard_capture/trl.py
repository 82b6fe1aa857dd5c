"""Audit captures of TRL's ``GRPOTrainer`` and ``SFTTrainer``, measured on the trainers' OWN per-token loss tensors.

    import lossguard_capture.trl
    run = lossguard_capture.trl.attach(trainer, "captures")   # a GRPOTrainer or an SFTTrainer; every rank
    trainer.train()                                           # run.paths, run.results, run.verdicts

(or ``trainer.add_callback(lossguard_capture.trl.AuditCallback("captures"))``).  The callback is
:class:`lossguard_capture.hf.TrainerAudit`, told only what differs (the trainers it accepts, where the
per-token loss tensor is found, the entropy term, the step's counts).  As :mod:`lossguard_capture.hf`: on
every rank, for each step in ``steps`` (default ``[0]``), it writes
``captures/step{n:06d}/step{n:06d}-rank{r:05d}.safetensors`` (docs/semantics.md §10); after the audited step
rank 0 runs ``lossguard audit``, every rank learns the verdict through the process group's store (bounded
waits, :func:`lossguard_capture.audit.agree`), and every rank raises :class:`lossguard_capture.AuditFailed`
before the optimizer applies that step when the verdict is FAIL.

What is measured, and where (TRL 1.16.0 over transformers 5.24.0; the line numbers below are of those
releases unless a release is named; what differs in the older supported releases: "Releases" below):

**GRPOTrainer** (trl/trainer/grpo_trainer.py).  ``compute_loss`` (:2939) calls ``_compute_loss`` (:3020), which
builds the per-token loss tensor ``per_token_loss`` [B, C] (B completions of the micro-batch, C its padded
completion width): the loss_type's policy term (:3109-3138), times the off-policy mask (:3141), the
high-entropy mask (:3144) and vLLM's importance-sampling ratio (:3147), plus ``beta * per_token_kl`` (:3150).
It is then reduced by the loss_type's normalisation (:3153-3184), all of the form ``sum_t (per_token_loss *
mask)_{i,t} * a_i`` with a per-sample factor ``a_i``.  The ``beta`` KL penalty is added into
``per_token_loss`` before that reduction (:3149-3150): it is part of the main term, normalised exactly as
the policy term, and there is nothing to declare for it.  The adapter does not re-implement any of it: for the
duration of ``_compute_loss`` a profile function (``sys.setprofile``) waits for that frame to return and
reads its locals ``per_token_loss`` and ``mask`` (:3027: the completion mask, times the tool mask); a
backward hook on ``per_token_loss`` itself then receives ``dL/dl_t`` when the Trainer backpropagates —
after every normalisation: the loss_type's, ``/ current_gradient_accumulation_steps`` (the class sets
``loss_is_scaled_for_ga = True``, :285, so transformers' ``Trainer.training_step`` does not divide again,
trainer.py:2111-2119), and DDP's mean (``grad_scale = 1/world``).  Nothing in the computation changes: the
loss and the gradients are bit for bit those of the run without the adapter (tested).  With
``importance_sampling_level="sequence"`` (GSPO, LUSPO) ``per_token_loss`` may be one value per sequence
[B, 1]; the reduction broadcasts it over the sequence's tokens, so each token's copy weighs ``a_i m_t``:
the hook's ``dL/dl_i = a_i m_i`` is recorded split over the sample's masked tokens (``dL/dl_i * m_t / m_i``),
and each token's loss as ``l_i``.

**GRPO's entropy bonus** (``entropy_coef != 0`` or ``use_adaptive_entropy``, :3189-3211) is NOT part of
``per_token_loss``: ``loss = loss - apply_coef * entropy_loss`` with ``entropy_loss = sum_t (H * e)_t /
max(sum_t e_t, 1) / current_gradient_accumulation_steps`` over the micro-batch (``e`` = ``mask`` times the
high-entropy mask, :3192-3201): a per-micro-batch token mean / M for every ``loss_type``.  The capture
declares it as term ``entropy`` (reduce ``per-token`` — the documented objective ``L_policy - coef * H``,
H the mean per-token entropy, grpo_config.py ``entropy_coef`` — coef ``-apply_coef`` as it enters the loss,
mask ``loss``, or ``field`` = ``e`` when ``top_entropy_quantile < 1``), hooks the ``entropies`` [B, C] local
of ``_compute_loss`` (the fused head's entropy, which carries its gradient) with ``term="entropy"`` and
records the count it divides by (``term.entropy.num_tokens``).  ``apply_coef`` is taken at the step's start
as TRL computes it (:3206-3209: ``entropy_coef``, under ``use_adaptive_entropy`` 0 while the last world
entropy is above ``entropy_target``) and checked against every micro-batch's; a step whose coefficient is 0
declares no entropy term.

**SFTTrainer** (trl/trainer/sft_trainer.py).  It does NOT go through ``Trainer.compute_loss`` nor
``torch.nn.functional.cross_entropy`` (so :mod:`lossguard_capture.hf` refuses it: "the loss did not call
cross_entropy"): ``compute_loss`` (:1560) runs the model with TRL's fused LM head (``fused_lm_head=True``,
:1611; trl/trainer/utils.py ``add_fused_lm_head``), takes ``per_token_loss = -outputs.log_probs`` [B, L-1]
(:1612; times ``exp(log_probs).detach()`` for ``loss_type="dft"``, :1615), ``loss = per_token_loss.sum() /
num_items_in_batch`` (:1616-1618) and ``* num_processes`` under ``average_tokens_across_devices`` (:1623-1624).
The same profile function reads ``per_token_loss`` and ``outputs.label_mask`` from ``compute_loss``'s frame.
The positions whose label is -100 hold a constant 0 (``masked_fill``/``masked_scatter`` of the fused head,
utils.py:1658-1660: no gradient reaches the model through them) while the plain ``.sum()`` gives them
``dL/dl_t = 1/N``: their weight in the gradient is 0, and it is recorded as such (``dL/dl_t * m_t``).  The
sample layout is :mod:`lossguard_capture.hf`'s: a row is a sample with prompt length 1 and response length L-1.

GRPO sample layout: each completion is one sample: its tokens are the prompt (``prompt_ids`` where
``prompt_mask`` is 1, i.e. without the left padding) followed by the micro-batch's C completion positions
(right padding included, as masked tokens); response length C; loss mask = ``mask`` (padding and tool-result
tokens 0; all 0 for a truncated completion under ``mask_truncated_completions``).  Micro-batch ``k`` of DP rank
``d`` holds the global samples ``(k*dp + d)*B ... + B-1``, unique within the optimizer step.
``global_batch_size`` is the step's completions over all ranks.  Records: ``mb.num_tokens`` = the
micro-batch's ``mask.sum()`` for ``bnpo`` (the count it divides by, :3159); ``num_tokens_reduced`` =
``inputs["num_items_in_batch"]`` for ``dapo``/``cispo``/``vespo`` (:3170; the count of the *generation* batch,
gathered over ranks, :2498) when the whole step is one generation batch's slices (not when
``steps_per_generation`` < gradient accumulation: each micro-batch then has its own count).

The objective claimed (``reduce=``), by default what TRL's documentation of ``loss_type`` (grpo_config.py
``loss_type``) says the aggregation is: :data:`OBJECTIVES`.

Releases (supported: TRL 1.13.0 to 1.16.x; each verified by tests/trainers/test_trl_trainer.py on 1.13.0,
1.14.2 and 1.16.0, over transformers 5.24.0 and accelerate 1.16.0):

* GRPO: ``_compute_loss`` is the same code on every supported release (1.12.0 too), only at other lines: the
  1.16.0 lines cited above are +71 in 1.14.2 (``_compute_loss`` :3091, mask :3098, ``beta`` KL :3220-3221,
  reduction :3224-3255, entropy bonus :3260-3282, MoE aux loss :3319-3321) and +93 in 1.13.0 (:3113, :3120,
  :3242-3243, :3246-3277, :3282-3304, :3341-3343); 1.15.0: -74 (:2946, reduction :3079-3110).  The generation
  batch's count is gathered at 1.14.2 :2560, 1.13.0 :2520.  What differs before 1.15: (1) the Trainer is kept
  from dividing the loss by gradient accumulation again by ``Trainer.__init__(compute_loss_func="non-None value
  to disable scaling")`` (1.14.2 grpo_trainer.py:974, 1.13.0 :967) and ``model_accepts_loss_kwargs = False``
  (1.14.2 :1137, 1.13.0 :1148) instead of ``loss_is_scaled_for_ga = True`` (1.15.0/1.16.0 :285): with
  transformers 5.24 both leave ``training_step``'s loss undivided, so the weights are the same; (2) the
  log-probabilities and entropies come from full logits (``selective_log_softmax[_and_entropy]``, 1.14.2
  ``_full_logits_logps`` :1491, the model called at :1574; 1.13.0 ``_get_per_token_logps_and_entropies``
  :1452, :1535), not from TRL's fused LM head (1.15+), and without TRL's own ``accelerator.autocast()`` around
  the model call (1.16.0 :1497): under bf16 the only autocast is the one accelerate's ``prepare_model`` wraps
  the model's forward in.  Neither changes what is hooked: ``per_token_loss``, ``mask`` and ``entropies`` are
  the same locals of the same function.  (3) 1.13.x with ``use_liger_kernel``: ``compute_loss`` computes
  the loss with ``compute_liger_loss`` (1.13.0 :3031-3034), not ``_compute_loss``: refused at attach (1.14
  routes liger through ``_compute_loss``, 1.14.2 :3008-3013).  1.13.x imports ``requests`` without declaring
  it (install it).
* SFT: TRL 1.15 changed where SFT's loss is computed, not what it is (``sum / num_items_in_batch`` on every
  release).  Before 1.15 there is no per-token tensor of TRL's to read: ``SFTTrainer.compute_loss`` calls
  ``Trainer.compute_loss`` (1.14.2 sft_trainer.py:1835, 1.13.0 :1803), and the default ``loss_type``
  ``chunked_nll`` (sft_config.py:333-334 in both) sums ``F.nll_loss(reduction="sum")`` per chunk inside a
  patched forward (1.14.2 sft_trainer.py:115 and :232, 1.13.0 :114 and :231).  So an ``SFTTrainer`` below
  :data:`SFT_SINCE` is refused at attach, naming the nearest supported release (1.16.0: 1.15.0's fused LM
  head runs only as a Triton kernel, so it is not verified here on CPU).

Unsupported (an error at attach, naming the reason): TRL or transformers outside their ranges; DeepSpeed,
FSDP, XLA, Megatron; TP/CP/SP; a loss term outside the per-token tensor other than GRPO's entropy bonus — an
MoE aux loss (GRPO :3248-3250, SFT) — unless ``allow_untracked_terms=True`` (then its gradient is not in the
capture, and audit's weights describe the other terms only); SFT with ``compute_loss_func`` or label
smoothing (no per-token tensor of TRL's); SFT on TRL < 1.15 and GRPO's liger loss on TRL < 1.14 (Releases);
an active ``sys.setprofile`` profiler during a captured step.
"""

import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch

from . import hf as _hf
from .adapter import Spec, make_attach
from .hf import CannotMeasure, TrainerAudit
from .recorder import MicroBatch

__all__ = ["attach", "AuditCallback", "SPEC", "SUPPORTED", "SFT_SINCE", "OBJECTIVES", "check_version"]

#: TRL versions whose internals this adapter was checked against: [low, high).  SFTTrainer from
#: :data:`SFT_SINCE` only (module docstring, Releases).
SPEC = Spec("lossguard_capture.trl", "trl", ("1.13.0", "1.17.0"), lambda: trl.__version__,
            "it reads GRPOTrainer._compute_loss's and SFTTrainer.compute_loss's per-token loss tensor as these "
            "versions build it", verified=("1.13.0", "1.14.2", "1.16.0"),
            refused=(("0", "1.13.0", "before 1.13 the adapter's tests never ran (1.12.0's GRPO loss is 1.13.0's by "
                                     "source, not verified); nearest supported: 1.13.0"),
                     ("1.15.0", "1.16.0", "not verified: 1.15's fused LM head runs on Triton only, so the tests "
                                          "cannot run it on CPU (its loss path is 1.16.0's by source); nearest "
                                          "supported: 1.16.0")),
            loss_site="trl GRPOTrainer._compute_loss / SFTTrainer.compute_loss")
SUPPORTED, check_version = SPEC.supported, SPEC.check_version       # the range; the gate (adapter.Spec)
#: The first TRL whose SFTTrainer builds the per-token loss tensor read here (its fused LM head's log_probs);
#: below it an SFTTrainer is refused at attach, naming :data:`SFT_NEAREST`, the nearest release verified.
SFT_SINCE, SFT_NEAREST = "1.15.0", "1.16.0"
#: The first TRL whose GRPO compute_loss goes through _compute_loss under use_liger_kernel.
_LIGER_SINCE = "1.14.0"
trl: Any = SPEC.require("trl", "pip install 'trl>=1.13.0,<1.17.0,!=1.15.*' 'transformers>=5.19.0,<5.26.0'; "
                          "scripts/setup-trainers.sh pins them")
try:
    from trl import GRPOTrainer, SFTTrainer
except ImportError as _e:           # trl 1.13.x imports requests without declaring it
    raise ImportError(f"lossguard_capture.trl: importing trl {trl.__version__}'s GRPOTrainer / SFTTrainer failed "
                      f"({_e}); trl 1.13.x needs `pip install requests`, which it does not declare") from _e


def _older(since: str) -> bool:
    """Whether the installed TRL is older than ``since`` (a pre-release of ``since`` counts as older)."""
    from packaging.version import Version
    return Version(SPEC.installed()) < Version(since)

#: The objective each GRPO ``loss_type`` claims (the ``reduce`` written into the capture), from TRL's own
#: documentation of ``loss_type`` (grpo_config.py) and docs/semantics.md §4/§9:
#:
#: * ``grpo`` "normalizing over sequence length": each completion's token mean, averaged over the
#:   completions: ``sample-mean`` (``m_t / (B m_i)``).  ``sapo`` shares its reduction (:3153).
#: * ``dr_grpo`` "normalizing with a global constant ... max_completion_length": ``seq-mean-token-sum-norm``
#:   (``m_t / (B L_norm)``, L_norm = max_completion_length).
#: * ``dapo`` / ``cispo`` "normalizing with the number of active tokens in the global accumulated batch":
#:   ``per-token`` (``m_t / N``); ``vespo`` shares their reduction (:3168).
#: * ``bnpo`` "normalizing with the number of active token in the local batch" — TRL documents that this
#:   makes the result depend on the local batch size; the objective that batch normalisation approximates
#:   is ``per-token``, and audit reports the local normalisation against it.
#: * ``luspo`` "scales each sequence's loss by its length": ``(per_token_loss * mask).sum(-1).mean()``,
#:   ``seq-mean-token-sum`` (``m_t / B``).
OBJECTIVES: dict[str, str] = {
    "grpo": "sample-mean", "sapo": "sample-mean", "bnpo": "per-token", "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "per-token", "cispo": "per-token", "vespo": "per-token", "luspo": "seq-mean-token-sum",
}


def _code(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):          # profiling_decorator and the like (functools.wraps)
        fn = fn.__wrapped__
    return fn.__code__


#: The frames whose locals are read: GRPOTrainer._compute_loss, SFTTrainer.compute_loss.
_GRPO_CODE = _code(GRPOTrainer._compute_loss)
_SFT_CODE = _code(SFTTrainer.compute_loss)


class _ReturnLocals:
    """For the duration of a ``with`` block, a profile function (``sys.setprofile``, this thread) that keeps
    the named locals of the frame running ``code`` when that frame returns.  Reading a frame's locals changes
    nothing in the computation."""

    def __init__(self, code: Any, names: Sequence[str]):
        self.code, self.names = code, tuple(names)
        self.found: dict[str, Any] | None = None
        self.returns = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is self.code:
            loc = frame.f_locals
            self.found = {n: loc.get(n) for n in self.names}
            self.returns += 1

    def __enter__(self) -> "_ReturnLocals":
        prev = sys.getprofile()
        if prev is not None:
            raise RuntimeError(f"lossguard_capture.trl: a profiler is active (sys.getprofile() = {prev!r}); the "
                               f"adapter needs sys.setprofile during the captured step's loss (capture another "
                               f"step, or profile without sys.setprofile)")
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)


class _Spread:
    """Records, on a leaf proxy hooked by the recorder, per-token weights derived from the gradient of the
    trainer's own tensor ``X``: ``dL/dX * share`` (``share`` broadcast against ``X``'s gradient).

    Used where ``X``'s own gradient is not yet the per-token weight: a per-sequence ``X`` [B, 1] that the
    reduction broadcasts over the tokens (``share = m_t / m_i``), and SFT's per-position ``X`` whose ignored
    positions are constants (``share = m_t``).  The proxy holds ``X``'s values broadcast to the token layout
    (the recorded ``token_loss``); when ``X``'s hook fires it backpropagates ``g * share`` into the proxy (a
    reentrant backward of a leaf: nothing of the model's graph is touched), where the recorder's hook keeps it."""

    def __init__(self, mb: MicroBatch, X: torch.Tensor, share: torch.Tensor):
        self.proxy = X.detach().expand(share.shape).clone().requires_grad_(True)
        self.share = share.detach().to(X.dtype)
        numel = self.proxy.numel()
        mb.hook(self.proxy, index=torch.arange(numel, dtype=torch.int64))
        self.handle = X.register_hook(self._fire)

    def _fire(self, g: torch.Tensor) -> None:
        self.proxy.backward(g.detach() * self.share)
        return None

    def remove(self) -> None:
        self.handle.remove()


class AuditCallback(TrainerAudit):
    """Captures ``steps`` of a TRL ``GRPOTrainer`` or ``SFTTrainer`` run for ``lossguard audit`` and, with
    ``fail_fast``, audits ``audit_step`` (default the first of ``steps``) from rank 0 and raises
    :class:`lossguard_capture.AuditFailed` on every rank when it FAILS, before that step's optimizer update.

    ``reduce``: the objective claimed; ``None`` takes :data:`OBJECTIVES` of the GRPO ``loss_type``
    (``per-token`` for SFT).  GRPO's entropy bonus is recorded as the declared term ``entropy``.
    ``allow_untracked_terms``: capture even when an MoE aux loss is active (its gradient is then not in the
    capture).  The other options and the results (``paths``, ``results``, ``verdicts``) are
    :class:`lossguard_capture.adapter.Adapter`'s; ``kind`` (``"grpo"`` or ``"sft"``) and ``loss_type`` are
    set at attach."""

    spec = SPEC
    requires = (_hf.SPEC,)

    def __init__(self, out_dir: str, *, reduce: str | None = None, allow_untracked_terms: bool = False,
                 **options: Any):
        super().__init__(out_dir, reduce=reduce, **options)
        self.allow_untracked_terms = allow_untracked_terms
        self.kind: str | None = None              # "grpo" or "sft", set at attach
        self.loss_type: str | None = None
        self._generation_counts: list[Any] = []       # GRPO: each micro-batch's inputs["num_items_in_batch"]
        self._entropy_coef: float | None = None    # GRPO: the step's applied entropy coefficient (term declared)
        self._entropy_field = False                   # ... over the high-entropy mask (top_entropy_quantile < 1)

    def _bind(self, trainer: Any) -> None:
        if isinstance(trainer, GRPOTrainer):
            self.kind, self.loss_type = "grpo", trainer.loss_type
            if self.loss_type not in OBJECTIVES:
                raise RuntimeError(f"lossguard_capture.trl: GRPO loss_type {self.loss_type!r} is not one this adapter "
                                   f"knows ({', '.join(OBJECTIVES)})")
            if self.reduce is None:
                self.reduce = OBJECTIVES[self.loss_type]
        elif isinstance(trainer, SFTTrainer):
            self.kind, self.loss_type = "sft", trainer.args.loss_type
            if self.reduce is None:
                self.reduce = "per-token"
        else:
            raise RuntimeError(f"lossguard_capture.trl supports GRPOTrainer and SFTTrainer, not "
                               f"{type(trainer).__name__} (a plain transformers.Trainer: lossguard_capture.hf)")

    def _refusals(self, trainer: Any) -> list[str]:
        bad, untracked = [], []
        if self.kind == "grpo":
            # the entropy bonus (grpo_trainer.py:3189-3211) is recorded as the declared term `entropy`
            if getattr(trainer, "aux_loss_enabled", False):
                untracked.append("the MoE aux loss (grpo_trainer.py:3248-3250)")
            if getattr(trainer, "use_liger_kernel", False) and _older(_LIGER_SINCE):
                bad.append(f"use_liger_kernel on trl {SPEC.installed()} (TRL < 1.14 computes GRPO's loss with "
                           f"compute_liger_loss, 1.13.0 grpo_trainer.py:3031-3034, without a per-token tensor)")
        else:
            if _older(SFT_SINCE):
                bad.append(f"SFTTrainer on trl {SPEC.installed()}: TRL < 1.15 computes SFT's loss without a per-token "
                           f"tensor (loss_type chunked_nll, the default, sums F.nll_loss per chunk in a patched "
                           f"forward, 1.14.2 sft_trainer.py:115/:232; nll and dft go through Trainer.compute_loss); "
                           f"nearest supported: {SFT_NEAREST}")
            if getattr(trainer, "compute_loss_func", None) is not None:
                bad.append("compute_loss_func (the loss is the user's function, not TRL's per-token tensor; "
                           "lossguard_capture.hf measures one that calls torch.nn.functional.cross_entropy)")
            if getattr(trainer, "label_smoother", None) is not None:
                bad.append("label_smoothing_factor != 0 (the LabelSmoother, not TRL's per-token tensor)")
            if getattr(trainer, "aux_loss_enabled", False):
                untracked.append("the MoE aux loss (sft_trainer.py:1619-1629)")
        if untracked and not self.allow_untracked_terms:
            bad.append("a loss term outside the per-token loss tensor: " + ", ".join(untracked) +
                       " (pass allow_untracked_terms=True to capture the per-token term alone)")
        return bad

    def _describe(self) -> str:
        what = "GRPOTrainer" if self.kind == "grpo" else "SFTTrainer"
        return f"the {what} loss_type={self.loss_type}; reduce={self.reduce}"

    def _begin_step(self, step: int) -> dict[str, Any] | None:
        # The beta KL penalty is inside per_token_loss (grpo_trainer.py:3149-3150): part of the main term, nothing
        # to declare.  The entropy bonus is a term of its own (:3189-3211): declared with the coefficient this
        # step applies (:3206-3209), as it enters the loss (`loss - apply_coef * entropy_loss`, :3211).
        trainer = self.trainer
        self._generation_counts = []
        self._entropy_coef, self._entropy_field = None, False
        if self.kind != "grpo" or not getattr(trainer, "_entropy_bonus_enabled", False):
            return None
        coef = float(trainer.entropy_coef)
        if trainer.use_adaptive_entropy and not trainer._last_world_entropy <= trainer.args.entropy_target:
            coef = 0.0
        if coef == 0.0:
            return None
        self._entropy_coef = coef
        self._entropy_field = trainer.top_entropy_quantile < 1.0
        return {"entropy": dict(reduce="per-token", coef=-coef, mask="field" if self._entropy_field else "loss")}

    def _measure(self, orig: Callable[..., Any], model: Any, inputs: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> "tuple[Any, MicroBatch, int]":
        if self.kind == "grpo":
            grab = _ReturnLocals(_GRPO_CODE, ("per_token_loss", "mask", "entropies", "effective_mask", "apply_coef"))
        else:
            grab = _ReturnLocals(_SFT_CODE, ("per_token_loss", "outputs"))
        with grab:
            out = orig(model, inputs, *args, **kwargs)
        if grab.returns != 1 or grab.found is None:
            where = "GRPOTrainer._compute_loss" if self.kind == "grpo" else "SFTTrainer.compute_loss"
            raise CannotMeasure(f"{where} ran {grab.returns} times in one compute_loss (expected once)")
        if self.kind == "grpo":
            mb, rows = self._grpo_microbatch(inputs, grab.found)
        else:
            mb, rows = self._sft_microbatch(inputs, grab.found)
        return out, mb, rows

    def _grpo_microbatch(self, inputs: Any, found: dict[str, Any]) -> "tuple[MicroBatch, int]":
        X, mask = found["per_token_loss"], found["mask"]
        comp = inputs["completion_ids"]
        B, C = comp.shape
        if not isinstance(X, torch.Tensor) or not isinstance(mask, torch.Tensor):
            raise CannotMeasure("GRPOTrainer._compute_loss has no per_token_loss / mask tensor (another loss path?)")
        if tuple(mask.shape) != (B, C):
            raise CannotMeasure(f"mask {tuple(mask.shape)} does not match completion_ids {(B, C)}")
        if not X.is_floating_point() or X.dim() != 2 or X.shape[0] != B or X.shape[1] not in (1, C):
            raise CannotMeasure(f"per_token_loss {tuple(X.shape)} {X.dtype} is neither [B, C] = {[B, C]} nor [B, 1]")
        if not X.requires_grad:
            raise CannotMeasure("per_token_loss does not require grad (no autograd in compute_loss?)")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"].bool()
        m = mask.detach().to(torch.int64)
        first = self._first_index(B)
        tokens = [torch.cat([prompt_ids[i][prompt_mask[i]], comp[i]]) for i in range(B)]
        P = prompt_mask.sum(-1).to(torch.int64)
        num_tokens = m.sum() if self.loss_type == "bnpo" else None
        assert self._step is not None
        mb = self._step.microbatch(
            sample_indices=torch.arange(first, first + B, dtype=torch.int64), tokens=tokens,
            total_lengths=P + C, response_lengths=torch.full((B,), C, dtype=torch.int64),
            loss_masks=m.reshape(-1), cp_size=1, num_tokens=num_tokens)
        if X.shape[1] == C:
            # the trainer's own [B, C] tensor, row-major = per sample, response index ascending
            mb.hook(X, index=torch.arange(B * C, dtype=torch.int64))
        else:
            # one loss per sequence, broadcast by `per_token_loss * mask` over the tokens: each token's copy
            # weighs a_i m_t, and dL/dl_i = a_i m_i
            mf = mask.detach().to(X.dtype)
            self._handles.append(_Spread(mb, X, mf / mf.sum(-1, keepdim=True).clamp(min=1)))
        self._grpo_entropy(mb, found, B, C)
        if "num_items_in_batch" in inputs:
            self._generation_counts.append(inputs["num_items_in_batch"])
        return mb, B

    def _grpo_entropy(self, mb: MicroBatch, found: dict[str, Any], B: int, C: int) -> None:
        """The entropy bonus's per-token entropies [B, C] hooked as term ``entropy`` (see the module docstring),
        with the count the micro-batch divides them by."""
        applied = found.get("apply_coef")
        if self._entropy_coef is None:
            if applied is not None and float(applied) != 0.0:
                raise CannotMeasure(f"the entropy bonus applies coefficient {float(applied)} but the step began with "
                                     f"none (use_adaptive_entropy state changed within the step?)")
            return
        H, e = found.get("entropies"), found.get("effective_mask")
        if applied is None or float(applied) != self._entropy_coef:
            raise CannotMeasure(f"the entropy bonus applies coefficient {applied} but the step declared "
                                 f"{self._entropy_coef} (grpo_trainer.py:3206-3209)")
        if not isinstance(H, torch.Tensor) or tuple(H.shape) != (B, C) or not H.requires_grad:
            raise CannotMeasure(f"the entropies of the entropy bonus are not a [B, C] = {[B, C]} tensor that "
                                 f"requires grad (got {None if H is None else (tuple(H.shape), H.requires_grad)})")
        if not isinstance(e, torch.Tensor) or tuple(e.shape) != (B, C):
            raise CannotMeasure("the entropy bonus has no [B, C] effective_mask")
        e = e.detach()
        mb.hook(H, index=torch.arange(B * C, dtype=torch.int64), term="entropy",
                mask=e.reshape(-1) if self._entropy_field else None)
        mb.set(num_tokens=e.sum(), term="entropy")          # the micro-batch's count it divides by (:3200)

    def _sft_microbatch(self, inputs: Any, found: dict[str, Any]) -> "tuple[MicroBatch, int]":
        X, outputs = found["per_token_loss"], found["outputs"]
        if X is None or outputs is None:
            raise CannotMeasure("SFTTrainer.compute_loss did not build per_token_loss from the fused LM head "
                                "(compute_loss_func, label smoothing or sequence parallelism take another path)")
        label_mask = getattr(outputs, "label_mask", None)
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if ids is None or ids.dim() != 2:
            raise CannotMeasure("the batch has no 2-D input_ids [batch, seq]")
        B, L = ids.shape
        if label_mask is None or tuple(label_mask.shape) != (B, L - 1) or tuple(X.shape) != (B, L - 1):
            raise CannotMeasure(f"per_token_loss {tuple(X.shape)} / label_mask "
                                f"{None if label_mask is None else tuple(label_mask.shape)} are not [B, L-1] = "
                                f"{[B, L - 1]} (shift_labels / padding-free batches are not supported)")
        if not X.requires_grad:
            raise CannotMeasure("per_token_loss does not require grad (no autograd in compute_loss?)")
        mb = self._row_microbatch(ids, label_mask.detach().to(torch.int64))
        # positions with label -100 are constant zeros of the fused head: weight dL/dl_t * m_t
        self._handles.append(_Spread(mb, X, label_mask.detach()))
        return mb, B

    def _step_records(self, step: int) -> dict[str, Any]:
        if self.kind != "grpo":
            return {"num_tokens_reduced": self._num_items}
        # one generation batch for the whole step (its micro-batches are slices of one buffered batch and share
        # the very tensor): the count it divided by.  Not with steps_per_generation < GA: each micro-batch then
        # has its own generation batch's count.
        n0 = self._generation_counts[0] if self._generation_counts else None
        num_tokens_reduced = None
        if self.loss_type in ("dapo", "cispo", "vespo") and n0 is not None and \
                all(v is n0 for v in self._generation_counts):
            num_tokens_reduced = n0
        # dr_grpo divides by max_completion_length (grpo_trainer.py:3163-3167): recorded, so audit's L_norm is the
        # trainer's, not the step's longest completion
        l_norm = self.trainer.args.max_completion_length if self.loss_type == "dr_grpo" else None
        return {"num_tokens_reduced": num_tokens_reduced, "l_norm": l_norm}


attach = make_attach(AuditCallback, """
    Capture ``steps`` of ``trainer`` (a ``GRPOTrainer`` or an ``SFTTrainer``; every rank, before
    ``trainer.train()``) into ``out_dir/step{n:06d}/`` and, with ``fail_fast``, stop on a FAIL before the
    optimizer applies the audited step.  ``options``: :class:`AuditCallback`'s.  Returns the callback:
    ``paths``, ``results``, ``verdicts``.""")
