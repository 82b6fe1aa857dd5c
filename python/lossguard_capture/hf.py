"""Audit captures of the Hugging Face ``transformers.Trainer``'s OWN loss path (not TRL's SFTTrainer, whose
compute_loss never calls cross_entropy: sft_trainer.py:1612 in trl 1.16.0 — use lossguard_capture.trl).

    import lossguard_capture.hf
    run = lossguard_capture.hf.attach(trainer, "captures")   # capture step 0, audit it, stop on FAIL
    trainer.train()                                          # run.paths, run.results, run.verdicts

(lossguard_capture.adapter: every adapter is entered this way), or
``trainer.add_callback(lossguard_capture.hf.AuditCallback("captures"))`` (the callback finds its trainer
when training begins).  On every rank, for each step in ``steps`` (default ``[0]``), it writes
``captures/step{n:06d}/step{n:06d}-rank{r:05d}.safetensors`` (docs/semantics.md §10); after the audited
step (default: the first captured one) rank 0 runs ``lossguard audit captures/step{n:06d}``, every rank
learns the exit code through the process group's store (bounded waits), and every rank raises
:class:`lossguard_capture.AuditFailed` — before the optimizer applies that step — when the verdict is FAIL.

What is measured, and where (transformers 5.24.0, accelerate 1.16.0; line numbers of that release; the same
code at other lines in every release of :data:`SPEC` ``verified``, 5.19.0 to 5.25.0):

* ``Trainer.training_step`` (trainer.py:2051) calls ``self.compute_loss(model, inputs,
  num_items_in_batch=...)`` (trainer.py:2130).  The adapter wraps that call: for its duration
  ``torch.nn.functional.cross_entropy`` is replaced by a wrapper.  Causal LMs reach it through
  ``model.loss_function`` = ``ForCausalLMLoss`` -> ``fixed_cross_entropy`` (loss/loss_utils.py:51, :34),
  which calls ``nn.functional.cross_entropy(source, target, ignore_index=-100, reduction=R)`` (line 42)
  with ``R = "sum"`` when the Trainer passed ``num_items_in_batch`` (then ``loss / num_items_in_batch``,
  line 47) and ``"mean"`` otherwise.  The wrapper computes the log-softmax over the vocabulary once and
  reads from it both the real call's value ``v`` (``nll_loss(lp, reduction=R)``: torch's cross_entropy is
  exactly that without label smoothing, so ``v`` is the real value bit for bit) and the per-token losses
  ``l = nll_loss(lp, reduction="none")``, which it hooks (with label smoothing it calls the real function
  twice); whether the targets are the labels is decided on the device and read once at the step's end, so
  no micro-batch waits for the host.  Under a TorchFunctionMode torch's own cross_entropy re-enters the
  wrapper through ``handle_torch_function``; that inner call goes to the real function.  It returns
  ``v + (R(l) - R(l).detach())`` with ``R`` the real call's reduction over the non-ignored tokens
  (``(l*m).sum()``, or that ``/ m.sum()``): the value is the real one bit for bit, and the gradient flows
  through the hooked tensor, so ``dL/dl_t`` is measured after everything the Trainer does to the
  value: the division by ``num_items_in_batch``, ``loss *= num_processes`` under
  ``average_tokens_across_devices`` (trainer.py:2214-2215), the ``/ current_gradient_accumulation_steps``
  of a loss not scaled for GA (trainer.py:2115-2119).
* ``Accelerator.backward`` (accelerate accelerator.py:2735) is wrapped to record the scalar the
  Trainer hands it (trainer.py:2126) as ``loss``; accelerate divides it by its own
  ``gradient_accumulation_steps`` (accelerator.py:2757), which the Trainer sets to 1 (trainer.py:825;
  checked).
* DDP averages gradients over the ranks: ``grad_scale = 1/world``.  Gradient clipping is not a
  normalisation and is not in ``grad_scale``; ``grad_norm`` is the Trainer's own, pre-clip
  (``Trainer._get_grad_norm``, trainer.py:2789, wrapped).
* ``num_items_in_batch`` (``Trainer._get_num_items_in_batch``, trainer.py:2306: the accumulated
  batch's count of ``labels[..., 1:] != -100``, summed over ranks under ``average_tokens_across_devices``)
  is the step's count, not a micro-batch's: it is recorded as ``num_tokens_reduced``, and ``mb.num_tokens``
  is not written (the Trainer computes no per-micro-batch count).

Sample layout: a row of ``input_ids`` of (padded) length ``L`` is one sample with prompt length 1 and
response length ``L-1``: response index ``j`` is token ``j+1``, predicted by the logit at position ``j``
(docs/semantics.md §1/§2: a token is owned by its predicting logit), and its loss mask is
``labels[j+1] != -100`` (``shift_labels[j]`` when the collator provides them).  The logit at ``L-1``
predicts nothing (its shifted label is -100; checked).  Micro-batch ``k`` of DP rank ``d`` holds the
global samples ``(k*dp + d)*B ... + B-1`` (``B = per_device_train_batch_size``): accelerate hands rank
``d`` the batches ``d, d+dp, ...``.  ``global_batch_size`` is the step's number of rows over all ranks.

The objective claimed is ``per-token`` (``reduce=``): with a model that accepts loss kwargs the Trainer
normalises by ``num_items_in_batch``; with one that does not (``accepts_loss_kwargs = False``, e.g.
Qwen2.5-VL, Gemma 4 in this release; trainer.py:518) it averages each micro-batch and divides by the
number of micro-batches — the user still means per-token, and ``lossguard audit`` fails that step with
the ``hf-ga`` shape.

The callback (:class:`TrainerAudit`) is shared with :mod:`lossguard_capture.trl`: the wiring into the
Trainer (``compute_loss``, ``Accelerator.backward``, ``_get_grad_norm``, ``on_pre_optimizer_step``), the
sample layout's indices, DDP's ``grad_scale`` and the step's rows are written once; each adapter says how
its trainer's per-token loss is found (:meth:`TrainerAudit._measure`) and what its step records.

Custom losses (``compute_loss_func``, a ``compute_loss`` override) are measured the same way when they call
``torch.nn.functional.cross_entropy`` once per micro-batch (directly or through ``nn.CrossEntropyLoss``):
logits ``[rows, V]`` or ``[B, V, positions]``; the Trainer's own layout (``B x L`` rows against labels
shifted left) or the classic shift (``logits[:, :-1]`` against ``labels[:, 1:]``, ``B x (L-1)`` rows); any
``ignore_index`` (the targets are checked against the batch's labels); ``label_smoothing``; any reduction —
with ``reduction="none"`` the hooked per-token tensor itself is returned, and whatever the user's code
does with it next (a sum over ``num_items_in_batch``, a per-micro-batch mean, a division by the padded
length) is what the hook measures.

Unsupported (an error at attach, naming the reason): transformers outside :data:`SUPPORTED`,
DataParallel (``n_gpu > 1``), DeepSpeed/FSDP/XLA/Megatron, tensor/context/sequence parallelism, the
Trainer's ``label_smoothing_factor`` (its LabelSmoother does not go through cross_entropy).  At the first
captured micro-batch (an error saying what to change): a loss that does not call
``torch.nn.functional.cross_entropy`` or calls it more than once, class ``weight=``, the legacy
``size_average``/``reduce``, targets that are not the batch's labels shifted by one.
"""

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from .adapter import Adapter, CannotMeasure, Spec, make_attach
from .recorder import MicroBatch, StepRecorder

__all__ = ["attach", "AuditCallback", "TrainerAudit", "SPEC", "SUPPORTED", "check_version"]

#: transformers versions whose internals this adapter was checked against: [low, high); ``SPEC.verified`` the
#: releases its tests ran on.  From 5.19.0 to 5.25.0 the hooked functions (Trainer.training_step, compute_loss,
#: _get_num_items_in_batch, _get_grad_norm, loss_utils.fixed_cross_entropy / ForCausalLMLoss) are the same
#: code at other lines (5.19-5.22 divide the TP/CP/SP count with ``//``, fixed in 5.23.0: a path refused here anyway).
SPEC = Spec("lossguard_capture.hf", "transformers", ("5.19.0", "5.26.0"), lambda: transformers.__version__,
            "it hooks Trainer.compute_loss, fixed_cross_entropy and Accelerator.backward as these versions have them",
            verified=("5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0", "5.24.0", "5.25.0"),
            refused=(("0", "5.19.0", "before 5.19 Trainer.training_step divides by gradient accumulation under "
                                     "another condition (trainer.py:2066 in 5.18.0) and has no "
                                     "loss_is_scaled_for_ga, a path the adapter's tests never ran; nearest "
                                     "supported: 5.19.0"),),
            loss_site="transformers Trainer.compute_loss")
SUPPORTED, check_version = SPEC.supported, SPEC.check_version       # the range; the gate (adapter.Spec)
transformers: Any = SPEC.require("transformers", "pip install 'lossguard-capture[hf]'")
from transformers import TrainerCallback  # noqa: E402


class _CEState:
    """The cross_entropy wrapper's view of one micro-batch's compute_loss: ``labels`` the batch's labels as
    the logits predict them ``[B, L]`` (position j's target, -100 where none)."""

    def __init__(self, mb: MicroBatch, labels: torch.Tensor, real: Callable[..., torch.Tensor]):
        self.mb, self.labels, self.real = mb, labels, real
        self.calls = 0
        self.problems: list[str] = []
        #: checks whose answer lives on the device, read once at the step's end (no host sync per micro-batch):
        #: a 0-d bool tensor, True when the targets are not the batch's labels as the logits predict them
        self.target_mismatch: torch.Tensor | None = None
        #: inside the wrapper: a call now is torch's own cross_entropy re-dispatching through
        #: handle_torch_function under an active TorchFunctionMode (``with torch.device(...)``, a FLOP counter)
        #: by its module-global name, which is the wrapper — passed to the real function, not counted
        self.inside = False

    def index_for(self, rows: int) -> torch.Tensor | None:
        """Where the owned positions (each row's first L-1) are among ``rows`` flattened targets: B x L rows
        (the Trainer's own ``logits.view(-1, V)`` against labels shifted left) or B x (L-1) rows
        (``logits[:, :-1]`` against ``labels[:, 1:]``, the classic custom loss); None otherwise."""
        B, L = self.labels.shape
        if rows == B * L:
            return (torch.arange(B, dtype=torch.int64)[:, None] * L
                    + torch.arange(L - 1, dtype=torch.int64)[None, :]).reshape(-1)
        if rows == B * (L - 1):
            return torch.arange(B * (L - 1), dtype=torch.int64)
        return None

    def expected_targets(self, rows: int) -> torch.Tensor:
        B, L = self.labels.shape
        return (self.labels if rows == B * L else self.labels[:, : L - 1]).reshape(-1)


_WHAT_TO_DO = ("lossguard measures one torch.nn.functional.cross_entropy call per compute_loss (the Trainer's own, "
               "or yours: any reduction, logits [rows, V] or [B, V, positions], labels shifted by one position, "
               "any ignore_index, label_smoothing, through nn.CrossEntropyLoss too); compute the per-token losses "
               "in one call and reduce them yourself")


def _unplaceable(state: _CEState, input: torch.Tensor, target: torch.Tensor, legacy_or_weight: bool,
                 reduction: str, rows: int, index: Any) -> str | None:
    """Why a cross_entropy call cannot be measured as the micro-batch's per-token loss, or None."""
    # [B, V, d] logits with [B, d] targets (the class dimension second): the same per-token losses
    flat = (input.dim() == 3 and target.dim() == 2 and tuple(target.shape) == (input.shape[0], input.shape[2]))
    if state.calls > 1:
        return f"cross_entropy called {state.calls} times in one compute_loss"
    if legacy_or_weight:
        return ("cross_entropy called with weight= / size_average= / reduce= (class weights change what a "
                "token weighs: multiply reduction='none' losses by them yourself)")
    if reduction not in ("sum", "mean", "none"):
        return f"cross_entropy called with reduction={reduction!r}"
    if not (input.dim() == 2 and target.dim() == 1 or flat) or target.is_floating_point():
        return (f"cross_entropy called with input {tuple(input.shape)} and target {tuple(target.shape)} "
                f"{target.dtype} (expected [rows, vocab] logits and [rows] class indices, or [B, vocab, d] "
                f"and [B, d])")
    if index is None:
        B, L = state.labels.shape
        return (f"cross_entropy got {rows} targets; the micro-batch's {B} x {L} positions are placed from "
                f"{B * L} (the Trainer's logits.view(-1, V), labels shifted left) or {B * (L - 1)} "
                f"(logits[:, :-1] against labels[:, 1:])")
    if not torch.is_grad_enabled() or not input.requires_grad:
        return "cross_entropy called without autograd"
    return None


def _make_cross_entropy(state: _CEState) -> Callable[..., torch.Tensor]:
    real = state.real

    def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                      size_average: bool | None = None, ignore_index: int = -100, reduce: bool | None = None,
                      reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
        if state.inside:
            return real(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        state.inside = True
        try:
            return measured(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        finally:
            state.inside = False

    def measured(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, size_average: bool | None,
                 ignore_index: int, reduce: bool | None, reduction: str, label_smoothing: float) -> torch.Tensor:
        state.calls += 1
        rows = int(target.numel())
        index = state.index_for(rows)
        why = _unplaceable(state, input, target, weight is not None or size_average is not None
                           or reduce is not None, reduction, rows, index)
        if why is None:
            # the targets are the batch's labels as the logits predict them: decided on the device, read at the
            # step's end (TrainerAudit._step_records), so the micro-batch never waits for the host
            want = state.expected_targets(rows).to(target.device)
            got = target.reshape(-1)
            keep = got != ignore_index
            state.target_mismatch = ((keep != (want != -100)) | (keep & (got != want))).any()
        if why is not None:
            state.problems.append(why)
            return real(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        # per-token losses [rows] (or [B, d] for 3-D logits, row-major: the same order as the targets). Without
        # label smoothing torch's cross_entropy is nll_loss(log_softmax(input, class dim)) (LossNLL.cpp
        # cross_entropy_loss): the log-softmax over the vocabulary, the one costly part, is computed once and
        # both the per-token losses and the real reduced value are read from it — the value bit for bit the
        # real call's (the same two kernels on the same numbers).
        if label_smoothing == 0.0:
            lp = torch.log_softmax(input, dim=1)
            l = torch.nn.functional.nll_loss(lp, target, ignore_index=ignore_index, reduction="none")
        else:
            lp = None
            l = real(input, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
        state.mb.hook(l, index=index)
        if reduction == "none":
            # the user's own arithmetic follows, measured by the hook; an ignored target's loss is 0 by the call
            # itself whatever follows (it weighs 0: x 0, exact), a kept one is returned x 1 (exact)
            return l * (target != ignore_index).to(l.dtype).reshape(l.shape)
        # The real call's value: what the trainer gets (bit for bit).
        with torch.no_grad():
            if lp is not None:
                v = torch.nn.functional.nll_loss(lp, target, ignore_index=ignore_index, reduction=reduction)
            else:
                v = real(input, target, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
        # R(l): the real call's reduction over the non-ignored tokens, so d v / d input == d R(l) / d input and
        # the hook sees d L / d l_t.
        m = (target != ignore_index).to(l.dtype)
        r = (l * m).sum()
        if reduction == "mean":
            # the count as the real call's total weight; clamped so that a micro-batch with no target (real
            # value 0/0 = NaN, real gradient 0) gets gradient 0 here too, not 0 * inf = NaN.  For a count
            # >= 1 the clamp changes nothing, and the division's backward (grad / count) is the real
            # nll_loss mean backward's, bit for bit.
            r = r / m.sum().clamp_min(1)
        return v + (r - r.detach())

    return cross_entropy


def _find_trainer(callback: "TrainerAudit") -> Any:
    """The Trainer whose callback handler holds ``callback``: a caller's ``self`` up the stack (the
    callback handler calls on_train_begin from Trainer.train)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, transformers.Trainer) and callback in getattr(obj.callback_handler, "callbacks", ()):
            return obj
        f = f.f_back
    return None


class TrainerAudit(Adapter, TrainerCallback):
    """The one ``TrainerCallback`` of the transformers-based adapters (this module's and
    :mod:`lossguard_capture.trl`'s): captures ``steps`` and, with ``fail_fast``, audits ``audit_step`` and
    raises :class:`lossguard_capture.AuditFailed` on every rank before that step's optimizer update (the
    options and results are :class:`lossguard_capture.adapter.Adapter`'s).

    Written once here: the wiring (``compute_loss``, ``accelerator.backward`` and ``_get_grad_norm`` wrapped
    on the instance; finish and fail fast at ``on_pre_optimizer_step``), the refusals every Trainer shares, a
    row's global sample index, DDP's ``grad_scale = 1/world`` and the step's rows.  A subclass says what
    differs: :meth:`_bind` (the trainer it accepts), :meth:`_refusals`, :meth:`_measure` (where the per-token
    loss is found, one micro-batch), :meth:`_begin_step` (the step's declared terms), :meth:`_step_records`
    (what the step's counts are)."""

    def __init__(self, out_dir: str, **options: Any):
        super().__init__(out_dir, **options)
        self._step: StepRecorder | None = None
        self._unmeasured: set[int] = set()             # steps dropped as unmeasurable (the run went on)
        self._k = 0                                   # micro-batches of the open step
        self._rows = 0                                # rows (samples) of the open step on this rank
        self._num_items: Any = None                   # the Trainer's num_items_in_batch (compute_loss's argument)
        self._pending: MicroBatch | None = None    # compute_loss done, backward not yet
        self._handles: list[Any] = []                 # hooks of the open step (removed when it ends)
        self._grad_norm: Any = None

    # -- what each Trainer adapter says ---------------------------------------------------------
    def _bind(self, trainer: Any) -> None:
        """Accept ``trainer`` (or raise RuntimeError), and settle what depends on its type."""

    def _refusals(self, trainer: Any) -> list[str]:
        """What of ``trainer``'s configuration this adapter cannot measure, besides the shared refusals."""
        return []

    def _measure(self, orig: Callable[..., Any], model: Any, inputs: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> "tuple[Any, MicroBatch, int]":
        """Run ``orig(model, inputs, *args, **kwargs)`` (the Trainer's compute_loss) measuring one micro-batch:
        return its output, the recorder's micro-batch (hooked) and its number of rows.  CannotMeasure when the
        loss path is not the one this adapter reads."""
        raise NotImplementedError

    def _begin_step(self, step: int) -> dict[str, Any] | None:
        """A captured step opens: reset per-step state; return the step's declared terms (or None)."""
        return None

    def _step_records(self, step: int) -> dict[str, Any]:
        """The step's own records for ``finish`` (``num_tokens_reduced``, ``l_norm``); may raise."""
        return {"num_tokens_reduced": self._num_items}

    # -- wiring ---------------------------------------------------------------------------------
    @property
    def trainer(self) -> Any:
        return self.target

    def _attach(self, trainer: Any, /, **where: Any) -> None:
        """Checks the trainer and its configuration, wraps ``trainer.compute_loss``,
        ``trainer.accelerator.backward`` and ``trainer._get_grad_norm`` (instance attributes; the classes are
        untouched), and adds the callback if it is not there yet."""
        self._bind(trainer)
        self._check_config(trainer)
        cb = self

        orig_compute_loss = trainer.compute_loss

        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            return cb._compute_loss(orig_compute_loss, model, inputs, *args, **kwargs)
        trainer.compute_loss = compute_loss

        acc = trainer.accelerator
        orig_backward = acc.backward

        def backward(loss: Any, **kwargs: Any) -> Any:
            if cb._pending is not None:
                cb._pending.loss(loss)
                cb._pending = None
            return orig_backward(loss, **kwargs)
        acc.backward = backward

        if hasattr(trainer, "_get_grad_norm"):
            orig_grad_norm = trainer._get_grad_norm

            def get_grad_norm(*args: Any, **kwargs: Any) -> Any:
                r = orig_grad_norm(*args, **kwargs)
                if cb._step is not None:
                    cb._grad_norm = r
                return r
            trainer._get_grad_norm = get_grad_norm

        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)

    def _check_config(self, trainer: Any) -> None:
        args = trainer.args
        bad = []
        if getattr(args, "n_gpu", 1) > 1:
            bad.append(f"torch.nn.DataParallel (n_gpu = {args.n_gpu}); launch one process per device instead")
        dt = str(getattr(trainer.accelerator.distributed_type, "value", trainer.accelerator.distributed_type))
        if dt in ("DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM"):
            bad.append(f"distributed type {dt} (only plain DDP: its gradient mean is grad_scale = 1/world)")
        pc = getattr(trainer.accelerator, "parallelism_config", None)
        if pc is not None:
            sizes = {n: getattr(pc, n + "_size", 1) or 1 for n in ("tp", "cp", "sp")}
            if any(v > 1 for v in sizes.values()):
                bad.append(f"parallelism_config {sizes} (only data parallelism)")
        if getattr(trainer.accelerator, "gradient_accumulation_steps", 1) != 1:
            bad.append(f"accelerator.gradient_accumulation_steps = {trainer.accelerator.gradient_accumulation_steps} "
                       f"(the Trainer sets 1 and divides itself)")
        bad += self._refusals(trainer)
        if bad:
            raise RuntimeError(f"{self.spec.module} does not support: " + "; ".join(bad))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            trainer = _find_trainer(self)
            if trainer is None:
                raise RuntimeError(f"{type(self).__name__} could not find its Trainer: use "
                                   f"{self.spec.module}.attach(trainer, out_dir) instead of add_callback")
            self.attach(trainer)

    # -- capture --------------------------------------------------------------------------------
    def _compute_loss(self, orig: Callable[..., Any], model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.trainer.state.global_step
        if not (model.training and self.should_capture(step)):
            return orig(model, inputs, *args, **kwargs)
        if self._step is not None and self._step.step != step:     # not finished (should not happen)
            self._abort()
        if step in self._unmeasured:            # dropped earlier in this step: the trainer's own loss
            return orig(model, inputs, *args, **kwargs)
        if self._step is None:
            self._open(step)
        ran: list[Any] = []

        def orig_once(*a: Any, **k: Any) -> Any:
            ran.append(orig(*a, **k))
            return ran[-1]
        try:
            out, mb, rows = self._measure(orig_once, model, inputs, args, kwargs)
        except CannotMeasure as e:
            self._abort()
            self._cannot_measure(step, f"micro-batch {self._k}: cannot measure the trainer's loss: {e}")
            return ran[0] if ran else orig(model, inputs, *args, **kwargs)     # its value, computed once
        except BaseException:
            self._abort()
            raise
        self._k += 1
        self._rows += rows
        self._num_items = kwargs.get("num_items_in_batch", args[1] if len(args) > 1 else None)
        self._pending = mb
        return out

    def _cannot_measure(self, step: int, why: str) -> None:
        """The step cannot be measured (it is dropped already): stop the run only where fail fast audits it."""
        msg = f"{self.spec.module}: step {step} {why}"
        if self.stops_at(step):
            raise RuntimeError(msg)
        self._unmeasured.add(step)
        self.say_unmeasured(msg)

    def _open(self, step: int) -> None:
        self._k = 0
        self._rows = 0
        self._num_items = None
        self._pending = None
        self._handles = []
        self._grad_norm = None
        terms = self._begin_step(step)
        args = self.trainer.args
        self._step = self.recorder(step, rank=args.process_index, world_size=args.world_size, dp=args.world_size,
                                   dp_rank=args.process_index, terms=terms)

    def _release(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _abort(self) -> None:
        self._release()
        if self._step is not None:
            self._step.abort()
        self._step = None

    def _first_index(self, B: int) -> int:
        """The global sample index of this micro-batch's first row: micro-batch ``k`` of DP rank ``d`` holds
        rows ``(k*dp + d)*bs ...`` (accelerate hands rank ``d`` the batches ``d, d+dp, ...``)."""
        args = self.trainer.args
        bs = args.per_device_train_batch_size
        if B > bs:
            raise CannotMeasure(f"a micro-batch of {B} rows > per_device_train_batch_size {bs}")
        return (self._k * args.world_size + args.process_index) * bs

    def _row_microbatch(self, ids: torch.Tensor, mask: torch.Tensor, **records: Any) -> MicroBatch:
        """A micro-batch whose rows ``ids`` [B, L] are one sample each: prompt length 1, response length
        ``L-1`` (response index ``j`` is token ``j+1``), loss mask ``mask`` [B, L-1]."""
        B, L = ids.shape
        first = self._first_index(B)
        assert self._step is not None
        return self._step.microbatch(
            sample_indices=torch.arange(first, first + B, dtype=torch.int64), tokens=ids.reshape(-1),
            total_lengths=torch.full((B,), L, dtype=torch.int64),
            response_lengths=torch.full((B,), L - 1, dtype=torch.int64), loss_masks=mask.reshape(-1), cp_size=1,
            **records)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        s = self._step
        if s is None or s.step != state.global_step:
            return

        def finish() -> str:
            path = self._finish(s)
            self._release()
            self._step = None
            return path
        try:
            self.write_step(s.step, finish, self._abort)     # fail fast: before the optimizer applies the step
        except CannotMeasure as e:
            self._cannot_measure(s.step, str(e))

    def _finish(self, s: StepRecorder) -> str:
        trainer = self.trainer
        args = trainer.args
        if self._pending is not None:
            raise RuntimeError(f"{self.spec.module}: step {s.step}: a micro-batch's loss never reached "
                               f"accelerator.backward")
        records = self._step_records(s.step)
        world = args.world_size
        rows = torch.tensor(self._rows, dtype=torch.int64)
        grad_scale = 1.0
        if world > 1:
            import torch.distributed as dist
            ddp = trainer.model_wrapped
            if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                raise RuntimeError(f"{self.spec.module}: {world} processes but the model is wrapped in "
                                   f"{type(ddp).__name__}, not DistributedDataParallel")
            # DDP averages the gradients over its process group
            grad_scale = 1.0 / dist.get_world_size(ddp.process_group)
            t = rows.to(args.device)
            dist.all_reduce(t)
            rows = t.cpu()
        # Without a grad scaler the Trainer always steps (it has no zero-token skip): skipped is known.
        skipped = False if getattr(trainer.accelerator, "scaler", None) is None else None
        grad_norm = self._grad_norm
        if grad_norm is not None and not isinstance(grad_norm, torch.Tensor):
            grad_norm = torch.tensor(float(grad_norm), dtype=torch.float64)
        return s.finish(grad_scale=grad_scale, skipped=skipped, grad_norm=grad_norm, global_batch_size=rows,
                        **records)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._step is not None:           # a captured step that never reached the optimizer
            self._abort()


class AuditCallback(TrainerAudit):
    """Captures ``steps`` of a ``transformers.Trainer`` run, measured on its own loss path (the module
    docstring), for ``lossguard audit``; with ``fail_fast`` audits ``audit_step`` and raises
    :class:`lossguard_capture.AuditFailed` on every rank before that step's optimizer update.  ``reduce``:
    the objective claimed (per-token: what the Trainer's ``num_items_in_batch`` normalisation means).  The
    other options and the results (``paths``, ``results``, ``verdicts``) are
    :class:`lossguard_capture.adapter.Adapter`'s."""

    spec = SPEC

    def __init__(self, out_dir: str, **options: Any):
        super().__init__(out_dir, **options)
        self._last_col: list[torch.Tensor] = []       # shifted labels of each row's last logit (must be ignored)
        self._mismatch: list[torch.Tensor] = []       # per micro-batch: its targets are not its labels (device)

    def _refusals(self, trainer: Any) -> list[str]:
        if getattr(trainer, "label_smoother", None) is not None:
            return ["label_smoothing_factor != 0 (the LabelSmoother does not go through cross_entropy)"]
        return []

    def _describe(self) -> str:
        mode = ("normalises by num_items_in_batch" if self.trainer.model_accepts_loss_kwargs else
                "averages each micro-batch (the model does not accept loss kwargs: the hf-ga shape)")
        return f"reduce={self.reduce}; the Trainer {mode}"

    def _begin_step(self, step: int) -> dict[str, Any] | None:
        self._last_col = []
        self._mismatch = []
        return None

    def _measure(self, orig: Callable[..., Any], model: Any, inputs: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> "tuple[Any, MicroBatch, int]":
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if ids is None or ids.dim() != 2:
            raise CannotMeasure("the batch has no 2-D input_ids [batch, seq]")
        if inputs.get("shift_labels") is not None:
            shifted = inputs["shift_labels"]
        elif inputs.get("labels") is not None:
            # the shift of ForCausalLMLoss (loss/loss_utils.py:65-66): logit j predicts labels[j+1]
            shifted = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[..., 1:]
        else:
            raise CannotMeasure("the batch has no labels (the Trainer computes no loss)")
        B, L = ids.shape
        if tuple(shifted.shape) != (B, L):
            raise CannotMeasure(f"labels {tuple(shifted.shape)} do not match input_ids {(B, L)}")
        mb = self._row_microbatch(ids, (shifted[:, : L - 1] != -100).to(torch.int64))
        self._last_col.append(shifted[:, L - 1].detach())
        # the hooked tensor holds every position of the [B, L] batch (row-major, as ForCausalLMLoss's
        # logits.view(-1, vocab)) or, for logits[:, :-1] against labels[:, 1:], each row's first L-1: the
        # owned ones (_CEState.index_for)
        nn_f = torch.nn.functional
        ce = _CEState(mb, shifted.detach(), nn_f.cross_entropy)
        wrapper = _make_cross_entropy(ce)
        nn_f.cross_entropy = wrapper
        try:
            out = orig(model, inputs, *args, **kwargs)
        finally:
            replaced = nn_f.cross_entropy is not wrapper
            nn_f.cross_entropy = ce.real
        problems = list(ce.problems)
        if replaced:
            problems.append("torch.nn.functional.cross_entropy was replaced by someone else during compute_loss")
        if ce.calls == 0:
            problems.append("the loss did not call torch.nn.functional.cross_entropy (a fused or custom "
                            "loss kernel, or a model without labels)")
        if problems:
            raise CannotMeasure("; ".join(problems) + f". {_WHAT_TO_DO}")
        if ce.target_mismatch is not None:
            self._mismatch.append(ce.target_mismatch)
        return out, mb, B

    def _step_records(self, step: int) -> dict[str, Any]:
        # The checks each micro-batch left on the device, read here with one host synchronisation per step.
        k = len(self._mismatch)
        flags = [m.reshape(1) for m in self._mismatch] + [(c != -100).any().reshape(1) for c in self._last_col]
        bad = torch.cat([f.to(flags[0].device) for f in flags]).tolist() if flags else []
        if any(bad[:k]):
            first = bad.index(True)
            raise CannotMeasure(f"micro-batch {first}: cannot measure the trainer's loss: cross_entropy's targets "
                                f"are not the batch's labels as the logits predict them (logit j against token "
                                f"j+1, -100 where the labels are ignored): a different shift or masking cannot be "
                                f"placed. {_WHAT_TO_DO}")
        if any(bad[k:]):
            raise CannotMeasure("a row's last logit has a label (shift_labels without -100 at the end): the "
                                "prompt-1 layout cannot hold it")
        return {"num_tokens_reduced": self._num_items}


attach = make_attach(AuditCallback, """
    Capture ``steps`` of ``trainer`` (a ``transformers.Trainer``; every rank, before ``trainer.train()``)
    into ``out_dir/step{n:06d}/`` and, with ``fail_fast``, stop on a FAIL before the optimizer applies the
    audited step.  ``options``: :class:`AuditCallback`'s.  Returns the callback: ``paths``, ``results``,
    ``verdicts``.""")
