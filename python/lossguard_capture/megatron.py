"""Audit captures of a Megatron-core training loop's OWN loss path: its ``loss_func``, the schedule's
scaling of what it returns, ``DistributedDataParallel``'s gradient reduction and ``finalize_model_grads``.

    import lossguard_capture.megatron as lcm

    audit = lcm.attach(config, "captures", model=model, optimizer=optimizer,    # steps=(0,), fail_fast=True;
                       scheduler=opt_param_scheduler)  # after initialize_model_parallel, every rank of every
                                    # stage; wraps config.finalize_model_grads_func, the optimizer's and the
                                    # LR scheduler's step

    def forward_step(data_iterator, model):
        batch = next(data_iterator)                             # the FULL micro-batch rows, before the CP split
        local = get_batch_on_this_cp_rank({k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")})
        output = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        return output, audit.loss_func(partial(loss_func, local["loss_mask"]), tokens=batch["tokens"],
                                       loss_mask=batch["loss_mask"], sample_indices=batch["sample_indices"])

    for it in range(iterations):
        with audit.step(it):
            forward_backward_func(forward_step_func=forward_step, ...)
            update_successful, grad_norm, num_zeros = optimizer.step()
            opt_param_scheduler.step(increment=global_batch_size)

A loss function over LOGITS (a model called without labels) hands its per-token losses over where it forms
them: ``token_loss = audit.per_token(vocab_parallel_cross_entropy(logits, labels))`` (and
``audit.per_token(t, term="entropy")`` for a term declared in ``attach(..., terms=...)``).  With pipeline
parallelism (the 1F1B schedule, or the interleaved one with every model chunk given as ``model=[...]``)
every stage attaches and wraps its forward step's loss_func: the last stage
records the samples and weights, the earlier stages their step records (``grad_scale``, the count
``finalize_model_grads`` broadcast to them, ``skipped``, ``scheduler_stepped``, ``grad_norm``); ``lossguard
audit``'s stages check compares them with the last stage's.  Packed (THD) micro-batches, slime's
per-sample split over CP (and Relax's CP size per micro-batch): ``audit.packed_loss_func(loss_func,
sample_indices=, tokens=, total_lengths=, response_lengths=, loss_masks=, cp_size=)``.

On every rank of each step in ``steps`` it writes ``captures/step{n:06d}/step{n:06d}-rank{r:05d}.safetensors``
(docs/semantics.md §10) when the ``with`` block ends; ``lossguard audit captures/step{n:06d}`` judges it.
``audit.paths``, ``audit.results`` and ``audit.verdicts`` are the results (lossguard_capture.adapter: every
adapter is entered and read this way).

Fail fast (``fail_fast=True``, the audited step ``audit_step``, default the first of ``steps``): with the
optimizer given to ``attach``, the audited step's capture is written when Megatron's optimizer is about to
apply it — its ``step_with_ready_grads`` (optimizer/optimizer.py:1242 [1238], called by ``step()`` once
``prepare_grads`` found no inf/NaN, after the gradient norm) is wrapped — rank 0 audits it, every rank
learns the verdict, and on FAIL every rank raises :class:`lossguard_capture.AuditFailed` from
``optimizer.step()``: the parameters are those of the step's start.  That capture records ``skipped =
False`` and the norm ``get_grad_norm`` / ``clip_grad_norm`` returned in that call (none: omitted);
``MegatronStep.set`` must come before ``optimizer.step()`` to count.  A step the optimizer skips, or a
loop without ``optimizer=``, is audited when its ``with`` block ends (after the optimizer call).

What is measured, and where (megatron-core 0.16.1's line numbers, identical in 0.16.0; 0.15.3's in brackets,
the code the same):

* The per-token losses are the tensor Megatron hands the user's ``loss_func``
  (``forward_step_calc_loss``, pipeline_parallel/schedules.py:256 [235]: ``outputs = loss_func(output_tensor)``;
  a ``GPTModel`` called with labels returns them as ``[b, s/cp]``,
  models/common/language_module/language_module.py:128-171 [120-163]).  The wrapper registers a backward hook on
  that very tensor and calls the user's ``loss_func`` unchanged: the value is the real one bit for bit,
  and ``dL/dl_t`` is measured after everything that follows — the user's own sums and divisions, and the
  schedule's in-place scaling of the loss it returns: a 3-tuple ``(loss, num_tokens, report)`` without
  ``calculate_per_token_loss`` is divided by ``clamp(num_tokens, min=1)`` and by the number of
  micro-batches (schedules.py:257-263 [236-242]), a 2-tuple ``(loss, report)`` is multiplied by the CP size and
  divided by the number of micro-batches (schedules.py:264-269 [243-248]), a 3-tuple with
  ``calculate_per_token_loss`` is backpropagated as returned; ``backward_step`` multiplies it by
  ``config.grad_scale_func`` (the loss scale, schedules.py:477-478 [456-457]).
* ``mb.{k}.loss`` is that backpropagated scalar: the tensor the ``loss_func`` returned, read after the
  schedule's in-place scaling (at ``finalize_model_grads``, when every backward is done), times the loss
  scale (``config.grad_scale_func(1)``, as schedules.py:283-287 [262-266] reads it).  ``mb.{k}.num_tokens`` is the
  3-tuple's count as returned, under ``calculate_per_token_loss`` (the count the schedule sums into N);
  otherwise it is only the micro-batch mean's divisor (slime returns a constant 1 there), whose effect the
  weights show, and a 2-tuple returns none: not written.
* ``grad_scale`` is read from the model, not assumed: ``DistributedDataParallel`` multiplies every
  bucket's gradients by its ``gradient_scaling_factor`` (1 with ``calculate_per_token_loss``, else
  ``1/|DP x CP|``; distributed/distributed_data_parallel.py:254-288 [275-309]) before a SUM all-reduce over the
  DP x CP group (distributed/param_and_grad_buffer.py:388-396 [341-349]; AVG with ``average_in_collective``: a
  further ``1/|group|``), and ``finalize_model_grads`` all-reduces the schedule's ``total_num_tokens``
  over DP x CP and calls ``scale_gradients(1/N)`` when ``N > 0`` (distributed/finalize_model_grads.py:484-497
  [475-488]; schedules.py:677-685 [636-643] passes the count only under ``calculate_per_token_loss``).  The wrapper of
  ``config.finalize_model_grads_func`` records each ``scale_gradients`` call of the model chunks, and
  ``grad_scale = gradient_scaling_factor x (1/|group| if AVG) x (the scalings) / loss scale``; the
  all-reduced count is ``num_tokens_reduced``.
* ``optimizer.step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``
  (optimizer/optimizer.py:1308-1338 [1304-1334] for the ChainedOptimizer ``get_megatron_optimizer`` builds):
  ``skipped = not update_successful``, ``grad_norm`` as returned (omitted when None).  A step whose
  ``with`` block ends without ``optimizer.step()`` (a loop that skips a zero-token step itself) is
  recorded as skipped.  Megatron-core itself skips only on an fp16 overflow.
* TP, CP and DP sizes and this rank's coordinates come from ``megatron.core.parallel_state``; the
  zig-zag positions each CP rank holds are Megatron's own: the wrapper applies
  ``megatron.core.utils.get_batch_on_this_cp_rank`` (utils.py:1994-2038 [1816-1846]: chunk ``r`` then chunk
  ``2cp-1-r`` of each row) to a tensor of positions, and checks that they are lossguard's zig-zag
  (docs/semantics.md §2).

Sample layout: a row of the micro-batch (``tokens`` ``[b, s]``, "bshd") is one sample of ``T = s`` tokens,
prompt length 1 and response length ``s-1``: response index ``j`` is token ``j+1``, whose loss Megatron
computes at position ``j`` (labels are pre-shifted: ``labels[j] = tokens[j+1]``), with mask
``loss_mask[j]``.  The row's last position predicts a token outside the row, which lossguard's sample
model cannot hold (docs/semantics.md §1-2: a sample's last position predicts nothing): its
``loss_mask`` must be 0 (pad rows by one token) — checked.  ``sample_indices`` are the rows' global
indices in the step's batch (the user's data layout: Megatron's sampler gives micro-batch ``k`` of DP rank
``d`` the rows ``(k*dp + d)*b ... + b-1``).

Refused, with the reason (a RuntimeError, nothing recorded): megatron-core outside :data:`SUPPORTED`;
hybrid context parallelism;
a model chunk that is not ``megatron.core.distributed.DistributedDataParallel`` (Megatron FSDP, torch
DDP); several distributed-optimizer instances; buckets with different scaling factors (expert parameters
scaled unlike dense ones); a packed (THD) micro-batch given to the row-wise
:meth:`MegatronAdapter.loss_func` (THD micro-batches go through :meth:`MegatronAdapter.packed_loss_func`,
slime's per-sample split; with ``model=`` a forward called with THD ``packed_seq_params`` is noticed); a
``loss_func`` that does not return a 2- or 3-tuple, or receives logits and hands no ``per_token``; a row
whose last position carries loss; ``mtp_num_layers`` without ``model=`` (or without a GPTModel / MTP block
in it).

Multi-token prediction (``config.mtp_num_layers = D``; docs/semantics.md §11): each depth ``j`` is the loss
term ``mtp`` (D = 1) or ``mtp{j}``, declared ``reduce=per-token``, ``coef = mtp_loss_scaling_factor / D``
(gpt_model.py:653 [574]), ``mask=roll:{j}`` (Megatron's MTP mask: the loss_mask rolled left by ``j``, the last
``j`` positions zeroed, multi_token_prediction.py:158-161 [131-134] — ``m_{t+j}``, not ``m_t m_{t+j}``).  Where:

* ``attach`` wraps the GPTModel's ``compute_language_model_loss`` (an instance attribute): in a captured
  step the forward's per-token losses it returns are kept — the D MTP depths' raw cross entropies
  (gpt_model.py:640 [561], ``[b, s/cp]`` like the main one) and then the main one (:714 [636]).  The wrapped loss_func
  hooks depth ``j``'s as its term, over the main term's owned positions: ``dL/dl_t`` is measured after
  the rolled-mask multiply (:641 [562]), the coefficient, the division by the CP-local rolled count without
  ``calculate_per_token_loss`` (:658-661 [579-582], unclamped: 0/0 = NaN for a shard with no MTP token), and
  ``MTPLossAutoScaler``'s backward scale (loss scale, / M without per-token loss; schedules.py:295-306 [274-285]).
  With ``calculate_per_token_loss`` finalize_model_grads divides the MTP gradient by the MAIN count
  (finalize_model_grads.py:484-497 [475-488]): audit reports that as a uniform ``N_mtp/N`` relative to the MTP
  objective (lossguard contract ``megatron-mtp-per-token``; without per-token loss ``megatron-mtp``).
* During a captured step ``megatron.core.models.gpt.gpt_model.MTPLossAutoScaler`` is a proxy whose
  ``apply`` keeps the tensor GPTModel hands it (``scale * mask * l [/ count]``) and calls the real one; the
  real class is put back when the step ends.  ``mb.{k}.loss`` is the main scalar plus each depth's share of
  the objective, ``MTPLossAutoScaler.main_loss_backward_scale x sum(that tensor)`` (its backward is
  ``ones * scale``, multi_token_prediction.py:573-576 [386-389]): audit's loss check holds every term.
* The model must be called with the ``loss_mask`` (as pretrain_gpt does): without it Megatron's MTP mask is
  all ones (gpt_model.py:615-617 [546-548]) and audit's ``mtp.coverage`` names the masked positions it trains on.
  Each term's own count (roll_tensor's ``num_tokens``) is not recorded (``mtp.counts``: not run).

Releases (:data:`SUPPORTED`, ``megatron-core>=0.15.0,<0.17.0``; verified by tests/trainers on 0.15.3, 0.16.0
and 0.16.1).  0.16.0 and 0.16.1 are the same in every function hooked or cited here.  0.15.3's loss path is
the same code at the bracketed lines; what differs does not reach the adapter: ``get_batch_on_this_cp_rank``
takes no ``cp_group`` (the adapter passes none), ``finalize_model_grads`` has no ``force_all_reduce`` (the
wrapper passes the schedule's arguments through), the MoE auxiliary loss is scaled by ``loss scale / M``
without 0.16's ``x cp`` (schedules.py:271; 0.16.1 :292; not captured, below), and the MTP label roll takes no
``packed_seq_params`` (MTP is captured on ``[b, s]`` rows only).  On a machine without a GPU, 0.15.x must be
imported through :func:`lossguard_capture.megatron_cpu.import_megatron_core` (its import builds a CUDA
allocator).  Refused:
0.14.x and older — no clamp of the token count (0.14.0 schedules.py:239: ``output_tensor /= num_tokens``),
so a CP shard or micro-batch without a loss token divides 0/0 = NaN (the nearest supported release is
0.15.3); 0.17 and later are not verified (they require Python >= 3.12; the adapter's tests run on 3.11).

The MoE auxiliary losses are not captured: Megatron never forms a per-token aux loss.  The load-balancing
loss is ``sum(probs.sum(dim=0) * tokens_per_expert) * E c / (topk T^2)`` (transformer/moe/moe_utils.py:
129-132 [108-111]): the router probabilities ``[T, E]`` are summed over tokens before anything else, so the only
tensor with a token axis carries per-(token, expert) gradients; a per-token ``l_t = E sum_e f_e p_{t,e}``
would have to be built by the adapter, not measured.  (On the CPU without Transformer Engine a MoE router
does not run either: moe_utils.py:1192 [958] reads ``te_general_gemm``, left undefined by its failed TE import at
:22-39 [11-28], a NameError.)
"""

from collections.abc import Callable
from typing import Any, Literal

import torch

from .adapter import Adapter, Spec, deprecated_alias, make_attach
from .recorder import MicroBatch, StepRecorder
from .zigzag import zigzag_chunk_size, zigzag_local_logit_index, zigzag_owned_logit_positions, zigzag_slices

__all__ = ["attach", "MegatronAdapter", "MegatronAudit", "MegatronStep", "SPEC", "SUPPORTED", "check_version",
           "megatron_version"]


def megatron_version() -> str:
    """The installed megatron-core's version (``megatron.core.package_info.__version__``)."""
    return str(_mc_info.__version__)


#: megatron-core versions whose loss path this adapter was checked against: [low, high); ``SPEC.verified`` the
#: releases its tests ran on (tests/trainers/test_megatron*.py, test_slime.py, test_relax.py); the module
#: docstring's "Releases" says what differs between them and why 0.14 is refused.  0.17 and later are outside
#: because they were never run (they require Python >= 3.12), not for a known difference.
SPEC = Spec("lossguard_capture.megatron", "megatron-core", ("0.15.0", "0.17.0"), megatron_version,
            "it relies on forward_step_calc_loss, DistributedDataParallel's gradient scaling and finalize_model_grads "
            "as these releases have them", verified=("0.15.3", "0.16.0", "0.16.1"),
            refused=(("0", "0.15.0", "before 0.15 forward_step_calc_loss does not clamp the token count (0.14.0 "
                                     "schedules.py:239: output_tensor /= num_tokens), so a CP shard or micro-batch "
                                     "without a loss token divides 0/0 = NaN; nearest supported: 0.15.3"),
                     ("0.17.0", "999", "not verified: 0.17 and later require Python >= 3.12 and the adapter's "
                                       "tests never ran on them; nearest supported: 0.16.1")),
            loss_site="the loss_func your forward_step returns (schedules.forward_step_calc_loss)")
SUPPORTED, check_version = SPEC.supported, SPEC.check_version       # the range; the gate (adapter.Spec)
# 0.15.x on a machine without a GPU: lossguard_capture.megatron_cpu.import_megatron_core() before this import
SPEC.require("megatron.core", "pip install megatron-core==0.16.1; scripts/setup-trainers.sh")
from megatron.core import package_info as _mc_info  # noqa: E402
from megatron.core import parallel_state as _ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as _MegatronDDP  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank as _get_batch_on_this_cp_rank  # noqa: E402


def _is_float_01(t: torch.Tensor) -> bool:
    return bool(((t == 0) | (t == 1)).all())


class _Unmeasured(RuntimeError):
    """A step the adapter cannot measure where stopping the run is not asked for (fail fast off, or another step
    than the audited one): the step is dropped with a warning and the trainer's own call goes on unwrapped."""


class _MB:
    """One captured micro-batch: the recorder's handle and what is read at finalize / finish."""

    def __init__(self, handle: MicroBatch, loss_mask: torch.Tensor | None):
        self.handle = handle
        self.loss_mask = loss_mask          # [b, s], the full rows (any device; read in finish); None: packed
        self.loss: torch.Tensor | None = None      # the tensor loss_func returned (scaled in place later)
        self.arity = 0
        self.mtp_scaled: list[torch.Tensor] = []      # what GPTModel handed MTPLossAutoScaler, per depth


class _Current:
    """The micro-batch whose wrapped loss_func is running: what :meth:`MegatronAdapter.per_token` hooks into."""

    def __init__(self, entry: _MB, index: torch.Tensor, b: int, s_local: int, packed: Any = None):
        self.entry, self.index, self.b, self.s_local = entry, index, b, s_local
        self.packed = packed                # a _Packed micro-batch (THD), or None: [b, s] rows
        self.hooked = False                 # the main term's per-token losses were handed over
        self.terms: set = set()             # the terms handed over (main included)


class _Packed:
    """A packed (THD) micro-batch: its samples whole, and where this CP rank's owned tokens sit in its packed
    stream (zigzag_local_logit_index per sample, offset by the local pieces before it)."""

    def __init__(self, sample_indices: Any, tokens: Any, total_lengths: Any, response_lengths: Any,
                 loss_masks: Any, cp: int, r: int):
        def flat(x: Any) -> torch.Tensor:
            if isinstance(x, (list, tuple)):
                parts = [torch.as_tensor(v).reshape(-1) for v in x]
                return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            return torch.as_tensor(x).reshape(-1)
        self.problem = ""
        self.sample_indices = flat(sample_indices).to(torch.int64)
        self.tokens = flat(tokens).detach().cpu()
        self.T = flat(total_lengths).to(torch.int64).cpu()
        self.R = flat(response_lengths).to(torch.int64).cpu()
        self.masks = flat(loss_masks).detach().cpu()
        n = self.sample_indices.numel()
        if self.T.numel() != n or self.R.numel() != n:
            self.problem = (f"{n} sample_indices but {self.T.numel()} total_lengths and {self.R.numel()} "
                            f"response_lengths")
            return
        if bool((self.R > self.T).any()) or bool((self.R < 0).any()):
            self.problem = "a response_length is negative or exceeds its total_length"
            return
        if self.tokens.numel() != int(self.T.sum()) or self.masks.numel() != int(self.R.sum()):
            self.problem = (f"tokens has {self.tokens.numel()} entries for sum(total_lengths) = {int(self.T.sum())}, "
                            f"loss_masks {self.masks.numel()} for sum(response_lengths) = {int(self.R.sum())}")
            return
        index: list[int] = []
        offset = 0
        for t, rr in zip(self.T.tolist(), self.R.tolist(), strict=True):
            index += [offset + i for i in zigzag_local_logit_index(t, rr, cp, r)]
            offset += t if cp == 1 else 2 * zigzag_chunk_size(t, cp)
        self.stream_index = torch.tensor(index, dtype=torch.int64)
        self.stream_length = offset
        self.owned = len(index)

    def check_stream(self, stream_tokens: Any, cp: int, r: int) -> None:
        """Every real position of each sample's local pieces (chunks r and 2cp-1-r; cp 1: the sample) holds the
        sample's token there; else ``problem`` names the first sample and position that do not."""
        got = torch.as_tensor(stream_tokens).detach().reshape(-1).cpu()
        if got.numel() < self.stream_length:
            self.problem = (f"stream_tokens has {got.numel()} positions, the samples' local pieces "
                            f"{self.stream_length}")
            return
        offset, start = 0, 0
        for k, (t, _rr) in enumerate(zip(self.T.tolist(), self.R.tolist(), strict=True)):
            sample = self.tokens[start:start + t]
            for lo, hi in zigzag_slices(t, cp, r, clip=False):      # cp 1: (0, T) and an empty one
                real = max(0, min(hi, t) - lo)
                if real and not torch.equal(got[offset:offset + real], sample[lo:lo + real].to(got.dtype)):
                    bad = next(i for i in range(real) if int(got[offset + i]) != int(sample[lo + i]))
                    self.problem = (f"sample {int(self.sample_indices[k])} (micro-batch position {k}): the packed "
                                    f"stream holds token {int(got[offset + bad])} at local position {offset + bad} "
                                    f"where the sample's position {lo + bad} is token {int(sample[lo + bad])} (CP "
                                    f"rank {r} of {cp} holds chunks {r} and {2 * cp - 1 - r} of every sample, "
                                    f"docs/semantics.md §2)")
                    return
                offset += hi - lo
            start += t

    def index_for(self, t: Any) -> Any:
        """The hook index for a per-token tensor of this micro-batch: the stream ``[1, L]`` (``L`` at least the
        samples' local lengths) -> the owned positions in it; the owned tokens ``[owned]`` in local order ->
        None (as they are); anything else -> False."""
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return False
        if t.dim() == 2 and t.shape[0] == 1 and t.shape[1] >= self.stream_length:
            return self.stream_index
        if t.dim() == 1 and t.numel() == self.owned:
            return None
        return False


class _MTPScalerProxy:
    """``megatron.core.models.gpt.gpt_model.MTPLossAutoScaler`` during a captured step: ``apply`` remembers
    the ``mtp_loss`` GPTModel hands it (``scale * loss_mask * l [/ num_tokens]``, gpt_model.py:655-661 [0.15.3:
    576-582]) and calls the real one with the same arguments; everything else is the real class's."""

    def __init__(self, audit: "MegatronAdapter", real: Any):
        self.audit = audit
        self.real = real

    def apply(self, hidden_states: Any, mtp_loss: Any, *args: Any) -> Any:
        if self.audit._state is not None and isinstance(mtp_loss, torch.Tensor) and mtp_loss.requires_grad:
            self.audit._mtp_scaled.append(mtp_loss)
        return self.real.apply(hidden_states, mtp_loss, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _StepState:
    def __init__(self, rec: StepRecorder, global_batch_size: Any):
        self.rec = rec
        self.global_batch_size = global_batch_size
        self.mbs: list[_MB] = []
        self.finalized = False
        self.grad_scale: Any = None
        self.num_tokens_reduced: Any = None
        self.optimizer_called = False
        self.update_successful: Any = None
        self.grad_norm: Any = None
        self.skipped_override: Any = None
        self.grad_norm_override: Any = None
        self.seen_grad_norm: Any = None        # what the optimizer's get_grad_norm / clip_grad_norm returned
        self.scheduler_called = False          # the wrapped LR scheduler's step() ran in this step
        self.before_update = False             # written by fail fast before the update (and the scheduler)
        self.current: Any = None               # the micro-batch whose wrapped loss_func is running (per_token)
        self.written = False                   # the capture is written (fail fast: before the update)
        self.metrics: Any = None               # (values, keys) the loop reduced (SPEC §6), when it says so
        self.global_batch_unit: str | None = None   # what global_batch_size counts, when said


class MegatronStep:
    """The context manager :meth:`MegatronAdapter.step` returns; ``with`` it around one iteration (the
    forward-backward call and ``optimizer.step()``).  ``active`` says whether this step is captured.
    Leaving the block normally writes the capture (``path``); by an exception, nothing is written.
    :meth:`set` overrides what the wrapped optimizer would record (``skipped``, ``grad_norm``) for a loop
    that does not pass its optimizer to :func:`attach`."""

    def __init__(self, audit: "MegatronAdapter", step: int, global_batch_size: Any):
        self.audit = audit
        self.step = int(step)
        self.global_batch_size = global_batch_size
        self.active = audit.should_capture(step)
        self.path: str | None = None
        self._state: _StepState | None = None

    def __enter__(self) -> "MegatronStep":
        if self.audit._state is not None:
            raise RuntimeError(f"lossguard_capture.megatron: step {self.step} opened inside step "
                               f"{self.audit._state.rec.step}")
        if self.active:
            rec = self.audit._recorder(self.step)
            self._state = _StepState(rec, self.global_batch_size)
            self.audit._state = self._state
            self.audit._mtp_begin()
        return self

    def set(self, *, skipped: Any = None, grad_norm: Any = None) -> None:
        """Record the step's skip decision / gradient norm yourself (overrides the optimizer wrapper's)."""
        if self._state is not None:
            if skipped is not None:
                self._state.skipped_override = skipped
            if grad_norm is not None:
                self._state.grad_norm_override = grad_norm

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        st = self._state
        self._state = None
        if st is None:
            return False
        self.audit._state = None
        self.audit._mtp_end()
        if st.written:                 # fail fast wrote (and audited) it before the optimizer's update
            self.path = st.rec.path
            return False
        if exc_type is not None:
            st.rec.abort()
            return False
        try:
            self.path = self.audit._write(st)
        except _Unmeasured as e:
            self.audit._dropped(e)
        return False


class MegatronAdapter(Adapter):
    """Captures ``steps`` of a Megatron-core training loop for ``lossguard audit`` (module docstring); made by
    :func:`attach`.

    TP, CP, DP and this rank's coordinates are read from ``parallel_state`` (initialised before).
    ``reduce`` is the objective claimed (``per-token``: every effective token weighs ``1/N`` — what
    ``calculate_per_token_loss`` computes; without it Megatron's per-micro-batch mean is judged against it
    and fails with the ``megatron-mean`` shape).  The other options (``steps``, ``fail_fast``, ...) and the
    results (``paths``, ``results``, ``verdicts``) are :class:`lossguard_capture.adapter.Adapter`'s."""

    spec = SPEC

    def __init__(self, out_dir: str, *, terms: dict[str, dict[str, Any]] | None = None, **options: Any):
        super().__init__(out_dir, **options)
        #: the terms besides the main one the user's loss function hands over with per_token(term=...)
        #: (SPEC §11: name -> reduce, coef, mask), then the MTP depths' when mtp_num_layers is set
        self.user_terms: dict[str, dict[str, Any]] = {str(k): dict(v) for k, v in (terms or {}).items()}
        if not _ps.model_parallel_is_initialized():
            raise RuntimeError("lossguard_capture.megatron: megatron.core.parallel_state is not initialised "
                               "(call initialize_model_parallel first)")
        pp = _ps.get_pipeline_model_parallel_world_size()
        import torch.distributed as dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.pp, self.pp_rank = pp, _ps.get_pipeline_model_parallel_rank()
        #: the stage that computes the loss (forward_step_calc_loss calls loss_func there only,
        #: pipeline_parallel/schedules.py:251-255 [0.15.3: 232-235]); the others record their step records only
        self.last_stage = bool(_ps.is_pipeline_last_stage(ignore_virtual=True))
        self.tp = _ps.get_tensor_model_parallel_world_size()
        self.cp = _ps.get_context_parallel_world_size()
        self.dp = _ps.get_data_parallel_world_size(with_context_parallel=False)
        self.tp_rank = _ps.get_tensor_model_parallel_rank()
        self.cp_rank = _ps.get_context_parallel_rank()
        self.dp_rank = _ps.get_data_parallel_rank(with_context_parallel=False)
        if self.tp * self.cp * self.dp * self.pp != self.world_size:
            raise RuntimeError(f"lossguard_capture.megatron: TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp} "
                               f"!= world {self.world_size} (expert or partial data parallelism are not supported)")
        self.config: Any = None
        self._state: _StepState | None = None
        self._index_cache: dict[tuple[int, int], torch.Tensor] = {}
        self._optimizer_wrapped = False
        self._scheduler_wrapped = False
        self.mtp_layers = 0                 # config.mtp_num_layers (0: no MTP loss)
        self.mtp_terms: dict[str, dict[str, Any]] = {}      # the declared MTP terms, depth order
        self._lm_losses: list[torch.Tensor] = []            # compute_language_model_loss outputs, this forward
        self._mtp_scaled: list[torch.Tensor] = []           # MTPLossAutoScaler.apply's mtp_loss, this forward
        self._mtp_saved: Any = None                         # gpt_model.MTPLossAutoScaler while the proxy is in
        self._thd_forward = False       # the last GPTModel forward of a captured step had THD packed_seq_params

    # -- wiring ---------------------------------------------------------------------------------
    # Narrower than Adapter._attach's **where on purpose: Megatron's wiring takes these three only
    def _attach(self, config: Any, *, model: Any = None, optimizer: Any = None,  # type: ignore[override]
                scheduler: Any = None) -> None:
        """Wrap ``config.finalize_model_grads_func`` (required: it is where DP x CP reduce the gradients and
        the count) and, when given, the optimizer's ``step`` (its result: the skip decision and the norm) and,
        with fail fast, ``step_with_ready_grads`` / ``get_grad_norm`` / ``clip_grad_norm`` (instance
        attributes; the classes are untouched).  ``model``: the model chunks (or one), checked now rather than
        at the first captured step.  ``scheduler``: the LR scheduler (Megatron's ``OptimizerParamScheduler``,
        or anything with ``step``): whether its ``step`` ran in a captured step is ``scheduler_stepped``."""
        chunks = [] if model is None else list(model) if isinstance(model, (list, tuple)) else [model]
        mtp = getattr(config, "mtp_num_layers", None)
        language_models = self._check_attach(config, chunks, mtp)
        self.config = config
        if mtp:
            self.mtp_layers = int(mtp)
            coef = config.mtp_loss_scaling_factor / config.mtp_num_layers     # gpt_model.py:653 [0.15.3: 574]
            names = ["mtp"] if self.mtp_layers == 1 else [f"mtp{j}" for j in range(1, self.mtp_layers + 1)]
            self.mtp_terms = {name: dict(reduce="per-token", coef=coef, mask=f"roll:{j}")
                              for j, name in enumerate(names, start=1)}
            for lm in language_models:
                self._wrap_language_model_loss(lm)
        for chunk in chunks:          # every GPTModel: a forward called with THD packed_seq_params is noticed
            lm = self._gpt_model(chunk)
            if lm is not None:
                self._wrap_forward(lm)
        clash = sorted(set(self.mtp_terms) & set(self.user_terms))
        if clash:
            raise RuntimeError(f"lossguard_capture.megatron: terms {clash} are the MTP depths' names")
        self.wrap_finalize(config)
        if optimizer is not None:
            self._wrap_optimizer_step(optimizer)
        if scheduler is not None:
            self._wrap_scheduler_step(scheduler)

    def _check_attach(self, config: Any, chunks: list[Any], mtp: Any) -> list[Any]:
        """The GPTModels whose MTP loss is hooked (``mtp``: config.mtp_num_layers); RuntimeError naming every
        part of ``config`` and ``chunks`` the adapter does not support (nothing is wrapped then)."""
        bad = []
        if getattr(config, "finalize_model_grads_func", None) is None:
            bad.append("config.finalize_model_grads_func is None (set it to megatron.core.distributed."
                       "finalize_model_grads, as Megatron-LM's training loop does)")
        if getattr(config, "hybrid_context_parallel", False):
            bad.append("hybrid_context_parallel")
        if getattr(config, "overlap_moe_expert_parallel_comm", False):
            bad.append("overlap_moe_expert_parallel_comm (the combined 1F1B schedule)")
        for chunk in chunks:
            why = self._check_chunk(chunk)
            if why:
                bad.append(why)
        language_models = []
        if mtp:
            if not chunks:
                bad.append(f"mtp_num_layers = {mtp} without model=: the MTP loss is hooked on the GPTModel "
                           f"(pass model= to attach)")
            for chunk in chunks:
                lm = self._gpt_model(chunk)
                if lm is None:
                    bad.append(f"mtp_num_layers = {mtp} but no megatron.core GPTModel was found in a model chunk "
                               f"of type {type(chunk).__name__} (its MTP loss is hooked there)")
                elif getattr(lm, "mtp", None) is None:
                    bad.append(f"mtp_num_layers = {mtp} but the GPTModel has no MTP block (mtp_block_spec)")
                else:
                    language_models.append(lm)
        if bad:
            raise RuntimeError("lossguard_capture.megatron does not support: " + "; ".join(bad))
        return language_models

    def _wrap_optimizer_step(self, optimizer: Any) -> None:
        """``optimizer.step`` (an instance attribute) noting, in a captured step, that it ran and what it
        returned (the skip decision and the norm); with fail fast, the update itself too (_wrap_update)."""
        audit = self
        orig_step = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            out = orig_step(*args, **kwargs)
            st = audit._state
            if st is not None:
                st.optimizer_called = True
                if isinstance(out, tuple) and len(out) >= 2:
                    st.update_successful, st.grad_norm = out[0], out[1]
                elif isinstance(out, bool):
                    st.update_successful = out
            return out
        optimizer.step = step
        self._optimizer_wrapped = True
        if self.fail_fast:
            self._wrap_update(optimizer)

    def _wrap_scheduler_step(self, scheduler: Any) -> None:
        """``scheduler.step`` (an instance attribute) noting that it ran in a captured step."""
        audit = self
        orig_sched = scheduler.step

        def sched_step(*args: Any, **kwargs: Any) -> Any:
            if audit._state is not None:
                audit._state.scheduler_called = True
            return orig_sched(*args, **kwargs)
        scheduler.step = sched_step
        self._scheduler_wrapped = True

    def wrap_finalize(self, config: Any) -> None:
        """Wrap ``config.finalize_model_grads_func`` (where DP x CP reduce the gradients and the count), unless it
        is wrapped already.  A loop that sets it anew before each training call (slime's ``train`` does,
        slime/backends/megatron_utils/model.py) calls this again after setting it."""
        orig = config.finalize_model_grads_func
        if getattr(orig, "__lossguard__", None) is self:
            return
        audit = self

        def finalize_model_grads(model: Any, num_tokens: Any = None, *args: Any, **kwargs: Any) -> Any:
            ran: list[Any] = []

            def orig_once(*a: Any, **k: Any) -> Any:
                ran.append(orig(*a, **k))
                return ran[-1]
            try:
                return audit._finalize(orig_once, model, num_tokens, *args, **kwargs)
            except _Unmeasured as e:        # the gradients are finalized once, whatever the adapter made of them
                audit._dropped(e)
                return ran[0] if ran else orig(model, num_tokens, *args, **kwargs)
        finalize_model_grads.__wrapped__ = orig           # type: ignore[attr-defined]
        finalize_model_grads.__lossguard__ = self         # type: ignore[attr-defined]
        config.finalize_model_grads_func = finalize_model_grads

    def _wrap_update(self, optimizer: Any) -> None:
        """Fail fast before the update: the optimizer's ``step_with_ready_grads`` (reached once ``prepare_grads``
        found no inf/NaN, after the norm) writes and audits the audited step first; ``get_grad_norm`` and
        ``clip_grad_norm`` keep the norm for that capture."""
        audit = self
        for name in ("get_grad_norm", "clip_grad_norm"):
            orig_norm = getattr(optimizer, name, None)
            if orig_norm is None:
                continue

            def norm(*args: Any, _orig: Any = orig_norm, **kwargs: Any) -> Any:
                out = _orig(*args, **kwargs)
                if audit._state is not None:
                    audit._state.seen_grad_norm = out
                return out
            setattr(optimizer, name, norm)
        orig_update = optimizer.step_with_ready_grads

        def step_with_ready_grads(*args: Any, **kwargs: Any) -> Any:
            st = audit._state
            if st is not None and not st.written and st.rec.step == audit.audit_step:
                st.optimizer_called, st.update_successful = True, True      # no inf/NaN: it is about to update
                st.grad_norm = st.seen_grad_norm
                st.before_update = True          # the LR scheduler has not run yet: not recorded
                audit._write(st)                                             # AuditFailed: no update
            return orig_update(*args, **kwargs)
        optimizer.step_with_ready_grads = step_with_ready_grads

    def _describe(self) -> str:
        return (f"reduce={self.reduce}; TP {self.tp} CP {self.cp} DP {self.dp} PP {self.pp}; calculate_per_token_loss="
                f"{getattr(self.config, 'calculate_per_token_loss', None)}"
                + (f"; MTP terms {', '.join(self.mtp_terms)}" if self.mtp_terms else ""))

    @staticmethod
    def _gpt_model(chunk: Any) -> Any:
        """The megatron.core GPTModel inside a model chunk (DDP, Float16Module: ``.module`` down), or None."""
        from megatron.core.models.gpt.gpt_model import GPTModel
        m = chunk
        for _ in range(8):
            if isinstance(m, GPTModel):
                return m
            m = getattr(m, "module", None)
            if m is None:
                return None
        return None

    def _wrap_forward(self, lm: Any) -> None:
        """Wrap the GPTModel's ``forward`` (an instance attribute; the class is untouched): in a captured step it
        notes whether the model was called with THD ``packed_seq_params`` (gpt_model.py:478 [0.15.3: 421]), so
        that a packed micro-batch handed to the row-wise :meth:`loss_func` is refused instead of read as rows."""
        orig = lm.forward
        audit = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            if audit._state is not None:
                psp = kwargs.get("packed_seq_params")
                audit._thd_forward = psp is not None and getattr(psp, "qkv_format", None) == "thd"
            return orig(*args, **kwargs)
        forward.__wrapped__ = orig        # type: ignore[attr-defined]
        lm.forward = forward

    def _wrap_language_model_loss(self, lm: Any) -> None:
        """Wrap the GPTModel's ``compute_language_model_loss`` (an instance attribute; the class is untouched):
        during a captured step each per-token loss it returns with a gradient is remembered for the wrapped
        loss_func — with MTP, the MTP depths' (gpt_model.py:640 [0.15.3: 561]) and then the main one (:714
        [0.15.3: 636])."""
        orig = lm.compute_language_model_loss
        audit = self

        def compute_language_model_loss(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if audit._state is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                audit._lm_losses.append(out)
            return out
        compute_language_model_loss.__wrapped__ = orig    # type: ignore[attr-defined]
        lm.compute_language_model_loss = compute_language_model_loss

    def _mtp_begin(self) -> None:
        """A captured step starts: gpt_model's ``MTPLossAutoScaler`` becomes a recording proxy (restored by
        :meth:`_mtp_end`, whatever ends the step)."""
        self._lm_losses, self._mtp_scaled = [], []
        if self.mtp_layers and self._mtp_saved is None:
            from megatron.core.models.gpt import gpt_model
            self._mtp_saved = gpt_model.MTPLossAutoScaler
            gpt_model.MTPLossAutoScaler = _MTPScalerProxy(self, self._mtp_saved)

    def _mtp_end(self) -> None:
        self._lm_losses, self._mtp_scaled = [], []
        if self._mtp_saved is not None:
            from megatron.core.models.gpt import gpt_model
            if isinstance(gpt_model.MTPLossAutoScaler, _MTPScalerProxy) and gpt_model.MTPLossAutoScaler.audit is self:
                gpt_model.MTPLossAutoScaler = self._mtp_saved
            self._mtp_saved = None

    @staticmethod
    def _check_chunk(chunk: Any) -> str | None:
        if not isinstance(chunk, _MegatronDDP):
            return (f"a model chunk of type {type(chunk).__name__}, not megatron.core.distributed."
                    f"DistributedDataParallel (its gradient reduction is what grad_scale reads)")
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
            return "num_distributed_optimizer_instances > 1"
        return None

    def step(self, step: int, *, global_batch_size: Any = None) -> MegatronStep:
        """The context manager of iteration ``step`` (captured when in ``steps``).  ``global_batch_size``:
        the step's rows over all DP ranks, recorded when given."""
        if self.config is None:
            raise RuntimeError("lossguard_capture.megatron: call attach(config, ...) before step()")
        return MegatronStep(self, step, global_batch_size)

    def _recorder(self, step: int) -> StepRecorder:
        return self.recorder(step, rank=self.rank, world_size=self.world_size, tp=self.tp, pp=self.pp, cp=self.cp,
                             dp=self.dp, tp_rank=self.tp_rank, pp_rank=self.pp_rank, cp_rank=self.cp_rank,
                             dp_rank=self.dp_rank,
                             cp_layout="zigzag", terms=self.all_terms or None)

    @property
    def all_terms(self) -> dict[str, dict[str, Any]]:
        """The declared terms besides main: the user's (``terms=``), then the MTP depths'."""
        return {**self.user_terms, **self.mtp_terms}

    # -- micro-batches --------------------------------------------------------------------------
    def loss_func(self, loss_func: Callable[..., Any], *, tokens: torch.Tensor, loss_mask: torch.Tensor,
                  sample_indices: Any, packed_seq_params: Any = None) -> Callable[..., Any]:
        """``loss_func`` wrapped for the running step: the forward step returns it in place of its own.

        ``tokens`` and ``loss_mask`` are the micro-batch's full rows ``[b, s]`` before the CP split
        (``loss_mask[j]``: whether the loss Megatron computes at position ``j`` — of ``labels[j] =
        tokens[j+1]`` — counts); ``sample_indices`` ``[b]`` the rows' global indices in the step's batch.
        Outside a captured step (or for a forward-only pass) ``loss_func`` itself is returned / called."""
        try:
            return self._guarded(self._loss_func(loss_func, tokens=tokens, loss_mask=loss_mask,
                                                 sample_indices=sample_indices, packed_seq_params=packed_seq_params),
                                 loss_func)
        except _Unmeasured as e:
            self._dropped(e)
            return loss_func

    def _loss_func(self, loss_func: Callable[..., Any], *, tokens: torch.Tensor, loss_mask: torch.Tensor,
                   sample_indices: Any, packed_seq_params: Any = None) -> Callable[..., Any]:
        """loss_func's measuring wrapper (raises _Unmeasured where the step cannot be measured)."""
        st = self._state
        if st is None:
            return loss_func
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "thd") == "thd":
            self._fail(st, "THD packed sequences (packed_seq_params) are not [b, s] rows: wrap the loss function "
                           "with audit.packed_loss_func(...) and give the packed samples")

        def shape(x: Any) -> Any:
            return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            self._fail(st, f"tokens must be the micro-batch's [b, s] rows, got {shape(tokens)}")
        b, s = tokens.shape
        if not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape) != (b, s):
            self._fail(st, f"loss_mask must be the full rows' [b, s] = {(b, s)} mask (before the CP split), got "
                           f"{shape(loss_mask)}")
        idx = torch.as_tensor(sample_indices).reshape(-1)
        if idx.numel() != b:
            self._fail(st, f"{idx.numel()} sample_indices for {b} rows")
        index = self._local_index(st, b, s)
        cp, s_local = self.cp, s // self.cp
        audit = self

        def wrapped(output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or audit._state is not st or not isinstance(output_tensor, torch.Tensor) \
                    or not output_tensor.requires_grad:
                audit._lm_losses, audit._mtp_scaled = [], []
                return loss_func(output_tensor, *args, **kwargs)          # non-loss data, eval, another step
            if audit._thd_forward:
                audit._fail(st, "the model was called with THD packed_seq_params but the micro-batch was given as "
                                "[b, s] rows (audit.loss_func): wrap the loss function with audit.packed_loss_func("
                                "...) and give the packed samples")
            per_token_input = tuple(output_tensor.shape) == (b, s_local) and output_tensor.is_floating_point()
            # response index j of a row is position j (prompt length 1): the mask's first s-1 entries
            mb = st.rec.microbatch(sample_indices=idx, tokens=tokens.reshape(-1),
                                   total_lengths=torch.full((b,), s, dtype=torch.int64),
                                   response_lengths=torch.full((b,), s - 1, dtype=torch.int64),
                                   loss_masks=loss_mask[:, : s - 1].reshape(-1), cp_size=cp)
            entry = _MB(mb, loss_mask)
            st.mbs.append(entry)
            if audit.mtp_layers:
                if not per_token_input:
                    audit._fail(st, f"with mtp_num_layers the model must be called with labels (loss_func receives "
                                    f"the per-token losses [b, s/cp] = {(b, s_local)}, got "
                                    f"{tuple(output_tensor.shape)})")
                entry.mtp_scaled = audit._hook_mtp(st, mb, index, b, s_local)
            cur = _Current(entry, index, b, s_local)
            st.current = cur
            no_per_token = (f"loss_func received {tuple(output_tensor.shape)} {output_tensor.dtype} (logits?) and "
                            f"handed lossguard no per-token losses: call audit.per_token(token_losses) where your "
                            f"loss function forms them ([b, s/cp] = {(b, s_local)}, before any sum or mean); a "
                            f"GPTModel called with labels hands loss_func the per-token losses themselves (hooked "
                            f"without a call)")
            try:
                outputs = loss_func(output_tensor)
            except Exception as e:
                if per_token_input or cur.hooked or audit._state is not st:
                    raise
                audit._fail(st, f"{no_per_token}; it raised {type(e).__name__}: {e}")
            finally:
                st.current = None
            if not cur.hooked:
                if not per_token_input:
                    audit._fail(st, no_per_token)
                mb.hook(output_tensor, index=index)
            return audit._take_outputs(st, entry, outputs)
        return wrapped

    def _take_outputs(self, st: _StepState, entry: _MB, outputs: Any) -> Any:
        """What a wrapped loss_func returned: a 2- or 3-tuple (else the step fails); keeps the loss tensor (read
        at finalize, after the schedule's in-place scaling) and, under ``calculate_per_token_loss``, the count."""
        if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
            self._fail(st, f"loss_func returned {type(outputs).__name__}"
                           f"{'' if not isinstance(outputs, (tuple, list)) else ' of ' + str(len(outputs))}; "
                           f"Megatron expects (loss, num_tokens, report) or (loss, report)")
        entry.arity = len(outputs)
        entry.loss = outputs[0]
        if len(outputs) == 3 and getattr(self.config, "calculate_per_token_loss", False):
            # the count the schedule sums into N (schedules.py:2175 [0.15.3: 2151], finalize_model_grads); without
            # calculate_per_token_loss it is only the micro-batch mean's divisor (slime returns a constant
            # 1 there), whose effect the weights show: not recorded as a count
            entry.handle.set(num_tokens=outputs[1])
        return outputs

    def per_token(self, token_losses: torch.Tensor, *, term: str | None = None) -> torch.Tensor:
        """Inside a wrapped ``loss_func`` (one that receives logits and forms its own per-token losses): hand
        lossguard the per-token tensor ``[b, s/cp]`` (this rank's CP-local positions of the micro-batch's
        rows, as the model returned them) where the loss function forms it, before any sum or mean; returns
        it unchanged.  ``term``: another term of the objective (``"entropy"``, ``"kl"``; declare it in
        ``attach(..., terms=...)``); ``None``: the main (policy / cross-entropy) term.  Each at most once per
        micro-batch.  Outside a captured step's wrapped loss_func it does nothing."""
        st = self._state
        if st is None or st.current is None:
            return token_losses
        cur = st.current
        name = "main" if term is None else str(term)
        index: Any = cur.index
        if cur.packed is not None:
            index = cur.packed.index_for(token_losses)
            if index is False:
                got = (tuple(token_losses.shape), token_losses.dtype) if isinstance(token_losses, torch.Tensor) \
                    else type(token_losses).__name__
                self._fail(st, f"per_token({name}): a packed micro-batch's per-token losses are the rank's packed "
                               f"stream [1, L] (L >= {cur.packed.stream_length}, the samples' local lengths) or "
                               f"its owned response tokens in local order [{cur.packed.owned}], got {got}")
        elif not isinstance(token_losses, torch.Tensor) or tuple(token_losses.shape) != (cur.b, cur.s_local) \
                or not token_losses.is_floating_point():
            got = (tuple(token_losses.shape), token_losses.dtype) if isinstance(token_losses, torch.Tensor) \
                else type(token_losses).__name__
            self._fail(st, f"per_token({name}): expected the per-token losses [b, s/cp] = {(cur.b, cur.s_local)} "
                           f"of this micro-batch, got {got}")
        if name in cur.terms:
            self._fail(st, f"per_token({name}) called twice for micro-batch {len(st.mbs) - 1}")
        if term is not None and name not in self.all_terms:
            self._fail(st, f"per_token(term={name!r}): the term is not declared (attach(..., terms={{{name!r}: "
                           f"dict(reduce=..., coef=...)}}); declared: {sorted(self.all_terms) or 'none'})")
        cur.terms.add(name)
        if term is None:
            cur.hooked = True
            cur.entry.handle.hook(token_losses, index=index)
        else:
            cur.entry.handle.hook(token_losses, index=index, term=name)
        return token_losses

    def packed_loss_func(self, loss_func: Callable[..., Any], *, sample_indices: Any, tokens: Any,
                         total_lengths: Any, response_lengths: Any, loss_masks: Any, cp_size: int | None = None,
                         cp_rank: int | None = None, dummy: bool = False, sample_denoms: Any = None,
                         stream_tokens: Any = None) -> Callable[..., Any]:
        """``loss_func`` wrapped for a PACKED (THD) micro-batch, slime's layout: each sample is padded to a
        multiple of ``2*cp`` and cut into ``2*cp`` chunks, this CP rank holding chunks ``r`` and ``2cp-1-r`` of
        every sample, the samples' local pieces concatenated (at CP 1 the samples themselves, unpadded);
        anything after the last sample's piece (the stream's padding) is ignored.

        The samples whole, before the split: ``tokens`` ``[sum T]`` (or a list, one tensor per sample; slime's
        ``unconcat_tokens``), ``total_lengths`` / ``response_lengths`` ``[n]``, ``loss_masks`` ``[sum R]`` (or
        a list) over the response tokens, ``sample_indices`` their global indices.  ``cp_size`` / ``cp_rank``:
        this micro-batch's CP size and this rank's place in it, for a CP size chosen per micro-batch (Relax's
        ``dynamic_cp_size``; consecutive CP ranks form a sub-group: ``cp_rank`` must be the static CP rank
        modulo ``cp_size``); default the static ones.  ``dummy``: a padding micro-batch that carries no loss
        (Relax's ``__is_dummy__``).  The loss function hands its per-token losses over with
        :meth:`per_token`: the packed stream ``[1, L]`` as the model's output is laid out, or the owned
        response tokens in local order (per sample, owned response indices ascending: slime's ``pg_loss``).
        ``stream_tokens``: the packed tokens the model was given (``[1, L]``); when given, every real position
        of every sample's local pieces is checked against the samples' tokens (a split that is off is refused
        here, naming the sample and position, instead of being weighed)."""
        try:
            return self._guarded(self._packed_loss_func(
                loss_func, sample_indices=sample_indices, tokens=tokens, total_lengths=total_lengths,
                response_lengths=response_lengths, loss_masks=loss_masks, cp_size=cp_size, cp_rank=cp_rank, dummy=dummy,
                sample_denoms=sample_denoms, stream_tokens=stream_tokens), loss_func)
        except _Unmeasured as e:
            self._dropped(e)
            return loss_func

    def _packed_loss_func(self, loss_func: Callable[..., Any], *, sample_indices: Any, tokens: Any,
                          total_lengths: Any, response_lengths: Any, loss_masks: Any, cp_size: int | None = None,
                          cp_rank: int | None = None, dummy: bool = False, sample_denoms: Any = None,
                          stream_tokens: Any = None) -> Callable[..., Any]:
        """packed_loss_func's measuring wrapper (raises _Unmeasured where the step cannot be measured)."""
        st = self._state
        if st is None:
            return loss_func
        cp = self.cp if cp_size is None else int(cp_size)
        if cp < 1 or self.cp % cp:
            self._fail(st, f"cp_size {cp} does not divide the CP group of {self.cp}")
        r = self.cp_rank % cp
        if cp_rank is not None and int(cp_rank) != r:
            self._fail(st, f"cp_rank {cp_rank} of a micro-batch with CP size {cp}: the static CP rank {self.cp_rank} "
                           f"places this rank at {r} (sub-groups of consecutive CP ranks)")
        packed = _Packed(sample_indices, tokens, total_lengths, response_lengths, loss_masks, cp, r)
        if not packed.problem and stream_tokens is not None:
            packed.check_stream(stream_tokens, cp, r)
        if packed.problem:
            self._fail(st, packed.problem)
        audit = self

        def wrapped(output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or audit._state is not st or not isinstance(output_tensor, torch.Tensor) \
                    or not output_tensor.requires_grad:
                return loss_func(output_tensor, *args, **kwargs)
            mb = st.rec.microbatch(sample_indices=packed.sample_indices, tokens=packed.tokens,
                                   total_lengths=packed.T, response_lengths=packed.R, loss_masks=packed.masks,
                                   cp_size=cp, dummy=bool(dummy), sample_denoms=sample_denoms)
            entry = _MB(mb, None)
            st.mbs.append(entry)
            cur = _Current(entry, packed.stream_index, 1, packed.stream_length, packed)
            st.current = cur
            try:
                outputs = loss_func(output_tensor)
            finally:
                st.current = None
            if not cur.hooked and not dummy:
                auto = packed.index_for(output_tensor) if output_tensor.dim() == 2 else False
                if auto is False:
                    audit._fail(st, f"a packed micro-batch's loss_func received {tuple(output_tensor.shape)} and "
                                    f"handed lossguard no per-token losses: call audit.per_token(token_losses) "
                                    f"where your loss function forms them")
                mb.hook(output_tensor, index=auto)
            return audit._take_outputs(st, entry, outputs)
        return wrapped

    def _hook_mtp(self, st: _StepState, mb: MicroBatch, index: torch.Tensor, b: int,
                  s_local: int) -> list[torch.Tensor]:
        """Hook this forward's MTP per-token losses (one term per depth) and return what GPTModel handed
        MTPLossAutoScaler (read at finalize for ``mb.{k}.loss``)."""
        D = self.mtp_layers
        lm, scaled = self._lm_losses, self._mtp_scaled
        self._lm_losses, self._mtp_scaled = [], []
        if len(lm) != D + 1 or len(scaled) != D:
            self._fail(st, f"with mtp_num_layers = {D} a GPTModel forward computes {D} MTP per-token loss(es) and "
                           f"then the main one (gpt_model.py:640, 714; 0.15.3: 561, 636) and hands "
                           f"MTPLossAutoScaler {D} tensor(s) (:655-661; 0.15.3: 576-582); this forward step made "
                           f"{len(lm)} compute_language_model_loss and {len(scaled)} MTPLossAutoScaler call(s) (one "
                           f"model call with labels per forward step)")
        for j, (name, l) in enumerate(zip(self.mtp_terms, lm[:D], strict=True), start=1):
            if tuple(l.shape) != (b, s_local) or not l.is_floating_point():
                self._fail(st, f"the MTP depth-{j} per-token loss is {tuple(l.shape)} {l.dtype}, not [b, s/cp] = "
                               f"{(b, s_local)}")
            # the raw cross entropy, before gpt_model.py:641 [0.15.3: 562] multiplies it by the rolled loss_mask:
            # dL/dl_t holds the mask, the coefficient and every division
            mb.hook(l, index=index, term=name)
        return scaled

    def _local_index(self, st: _StepState, b: int, s: int) -> torch.Tensor:
        """Index of the owned tokens (local order) in the flattened [b, s/cp] per-token tensor, from
        Megatron's own CP split applied to positions; checked against lossguard's zig-zag."""
        key = (b, s)
        if key in self._index_cache:
            return self._index_cache[key]
        cp, r = self.cp, self.cp_rank
        if cp > 1 and s % (2 * cp):
            self._fail(st, f"sequence length {s} is not a multiple of 2*cp = {2 * cp}")
        pos = torch.arange(s, dtype=torch.int64).expand(b, s).contiguous()
        local = _get_batch_on_this_cp_rank({"position_ids": pos})["position_ids"]    # [b, s/cp]
        if tuple(local.shape) != (b, s // cp):
            self._fail(st, f"megatron's CP split gave {tuple(local.shape)} for rows {(b, s)} at cp {cp}")
        want = zigzag_owned_logit_positions(s, s - 1, cp, r)          # response j <-> logit j (prompt 1)
        rows = local.tolist()
        row = rows[0]
        if any(other != row for other in rows[1:]):
            self._fail(st, "megatron's CP split differs between rows")
        got = sorted(p for p in row if p < s - 1)
        if got != want:
            self._fail(st, f"megatron's CP split holds positions {sorted(row)} on CP rank {r} of {cp}; "
                           f"lossguard's zig-zag (docs/semantics.md §2) owns {want}")
        slot = {p: i for i, p in enumerate(row)}
        per_row = [slot[p] for p in want]
        n_local = s // cp
        index = (torch.arange(b, dtype=torch.int64)[:, None] * n_local
                 + torch.tensor(per_row, dtype=torch.int64)[None, :]).reshape(-1)
        self._index_cache[key] = index
        return index

    def _fail(self, st: _StepState, why: str) -> None:
        """Abort the open step (nothing is recorded) and raise: RuntimeError, which stops the run, only where
        fail fast audits this step; otherwise _Unmeasured, which the entry points (the wrapped loss functions,
        finalize, the step's end) turn into a warning and the trainer's own call — an adapter never stops a run
        it cannot measure unless asked to."""
        st.rec.abort()
        if self._state is st:
            self._state = None
            self._mtp_end()
        msg = f"lossguard_capture.megatron: step {st.rec.step}: {why}"
        if self.stops_at(st.rec.step):
            raise RuntimeError(msg)
        raise _Unmeasured(msg)

    def _dropped(self, e: _Unmeasured) -> None:
        self.say_unmeasured(str(e))

    def _guarded(self, wrapped: Callable[..., Any], loss_func: Callable[..., Any]) -> Callable[..., Any]:
        """``wrapped`` (a loss function the adapter measures through), falling back on ``loss_func`` itself when
        the step cannot be measured (_Unmeasured)."""
        if wrapped is loss_func:
            return loss_func
        audit = self

        def guarded(output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return wrapped(output_tensor, *args, **kwargs)
            except _Unmeasured as e:
                audit._dropped(e)
                return loss_func(output_tensor, *args, **kwargs)
        guarded.__wrapped__ = loss_func        # type: ignore[attr-defined]
        return guarded

    # -- finalize ---------------------------------------------------------------------------------
    def _finalize(self, orig: Callable[..., Any], model: Any, num_tokens: Any, *args: Any, **kwargs: Any) -> Any:
        st = self._state
        if st is None:
            return orig(model, num_tokens, *args, **kwargs)
        if st.finalized:
            self._fail(st, "finalize_model_grads_func was called twice in one step")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        factors = set()
        avg_sizes = set()
        for chunk in chunks:
            why = self._check_chunk(chunk)
            if why:
                self._fail(st, "unsupported " + why)
            for group in list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups):
                for bucket in group.buckets:
                    factors.add(float(bucket.gradient_scaling_factor))
                if group.ddp_config.average_in_collective:
                    comm = (group.intra_distributed_optimizer_instance_group
                            if group.ddp_config.use_distributed_optimizer else group.data_parallel_group)
                    avg_sizes.add(comm.size())
                else:
                    avg_sizes.add(1)
        if len(factors) > 1 or len(avg_sizes) > 1:
            self._fail(st, f"gradient buckets are scaled differently ({sorted(factors)}, AVG over "
                           f"{sorted(avg_sizes)}): one grad_scale cannot describe them")
        pre = (factors.pop() if factors else 1.0) / (avg_sizes.pop() if avg_sizes else 1)
        scalings: list[list[Any]] = [[] for _ in chunks]
        originals = []
        for i, chunk in enumerate(chunks):
            orig_scale = chunk.scale_gradients

            def scale_gradients(scaling_factor: Any, _orig: Any = orig_scale,
                                _log: list[Any] = scalings[i]) -> Any:
                _log.append(scaling_factor)
                return _orig(scaling_factor)
            originals.append((chunk, "scale_gradients" in vars(chunk), orig_scale))
            chunk.scale_gradients = scale_gradients
        try:
            out = orig(model, num_tokens, *args, **kwargs)
        finally:
            for chunk, had, orig_scale in originals:
                if had:
                    chunk.scale_gradients = orig_scale
                else:
                    del chunk.scale_gradients
        # kept on the device (no host sync here): a 0-dim CPU float64 times the recorded factors
        scale: Any = torch.tensor(pre, dtype=torch.float64)
        per_chunk = []
        for log in scalings:
            f: Any = torch.tensor(1.0, dtype=torch.float64)
            for x in log:
                f = f * (x.detach().to(torch.float64).reshape(()) if isinstance(x, torch.Tensor) else float(x))
            per_chunk.append(f)
        if len(per_chunk) > 1 and any(not torch.equal(f, per_chunk[0]) for f in per_chunk[1:]):
            self._fail(st, f"finalize_model_grads scaled the model chunks differently "
                           f"({[float(f) for f in per_chunk]})")
        if per_chunk:
            scale = scale * per_chunk[0]
        loss_scale = self._loss_scale(st)
        st.grad_scale = scale / loss_scale
        st.num_tokens_reduced = None if num_tokens is None else num_tokens.detach().clone()
        mtp_scale: Any = None
        if self.mtp_layers:
            # what MTPLossAutoScaler.backward multiplies its ones by (multi_token_prediction.py:573-576 [0.15.3:
            # 386-389]): the loss scale, / M without calculate_per_token_loss (schedules.py:295-306 [0.15.3:
            # 274-285], the same every micro-batch)
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
            mtp_scale = torch.as_tensor(MTPLossAutoScaler.main_loss_backward_scale).detach().reshape(-1)[0]
        for e in st.mbs:
            if e.loss is not None:
                total = e.loss.detach().to(torch.float64) * loss_scale
                for x in e.mtp_scaled:          # the MTP terms' share of the backpropagated objective
                    total = total + x.detach().to(torch.float64).sum() * mtp_scale.to(total.device, torch.float64)
                e.handle.loss(total)
        st.finalized = True
        return out

    def _loss_scale(self, st: _StepState) -> torch.Tensor:
        """``config.grad_scale_func(1)``, as forward_step_calc_loss reads the loss scale (schedules.py:283-287; 0.15.3:
        262-266)."""
        f = getattr(self.config, "grad_scale_func", None)
        if f is None:
            return torch.tensor(1.0, dtype=torch.float64)
        dev = next((e.loss.device for e in st.mbs if isinstance(e.loss, torch.Tensor)), torch.device("cpu"))
        v = f(torch.ones(1, dtype=torch.float32, device=dev))
        return v.detach().reshape(-1)[0].to(torch.float64)

    # -- finish ---------------------------------------------------------------------------------
    def _finish(self, st: _StepState) -> str:
        if not self.last_stage:
            if st.mbs:
                self._fail(st, f"pipeline stage {self.pp_rank} of {self.pp} computed a loss: Megatron calls loss_func "
                               f"on the last stage only")
        elif not st.mbs:
            self._fail(st, "no micro-batch reached a wrapped loss_func (return audit.loss_func(...) from the "
                           "forward step)")
        if not st.finalized:
            self._fail(st, "finalize_model_grads_func was not called (forward_only?): grad_scale is unknown")
        for k, e in enumerate(st.mbs):
            if e.loss_mask is None:         # a packed (THD) micro-batch: its samples are whole, nothing to check
                continue
            m = e.loss_mask.detach().cpu()
            if not _is_float_01(m):
                self._fail(st, f"micro-batch {k}: loss_mask holds values other than 0 and 1")
            if bool((m[:, -1] != 0).any()):
                rows = [int(i) for i in torch.nonzero(m[:, -1] != 0).reshape(-1)]
                self._fail(st, f"micro-batch {k}: the last position of row(s) {rows} carries loss: Megatron "
                               f"computes a loss for a label outside the row, which lossguard's sample model "
                               f"(docs/semantics.md §1-2: a sample's last position predicts nothing) cannot "
                               f"hold; pad every row by one position whose loss_mask is 0")
        if st.skipped_override is not None:
            skipped: Any = bool(st.skipped_override)
        elif st.optimizer_called:
            skipped = None if st.update_successful is None else not bool(st.update_successful)
        else:           # the loop did not step the wrapped optimizer: it skipped the step
            skipped = True if self._optimizer_wrapped else None
        grad_norm = st.grad_norm_override if st.grad_norm_override is not None else st.grad_norm
        if grad_norm is not None and not isinstance(grad_norm, torch.Tensor):
            grad_norm = torch.tensor(float(grad_norm), dtype=torch.float64)
        scheduler_stepped = st.scheduler_called if self._scheduler_wrapped and not st.before_update else None
        path = st.rec.finish(grad_scale=st.grad_scale, num_tokens_reduced=st.num_tokens_reduced, skipped=skipped,
                             grad_norm=grad_norm, global_batch_size=st.global_batch_size,
                             scheduler_stepped=scheduler_stepped,
                             metrics_values=None if st.metrics is None else st.metrics[0],
                             metrics_keys=None if st.metrics is None else st.metrics[1],
                             global_batch_unit=st.global_batch_unit if st.global_batch_size is not None else None)
        return path

    def _write(self, st: _StepState) -> str:
        """Write the step's capture (nothing on an error), keep its path and, fail fast, audit it."""
        def finish() -> str:
            path = self._finish(st)
            st.written = True
            return path
        return self.write_step(st.rec.step, finish, st.rec.abort)


attach = make_attach(MegatronAdapter, """
    Capture ``steps`` of a Megatron-core loop (every rank of every pipeline stage, after
    ``initialize_model_parallel``) into ``out_dir/step{n:06d}/``: wraps ``config.finalize_model_grads_func``
    and, given, ``optimizer``'s and ``scheduler``'s (the LR scheduler's) step; ``model``: the model chunks
    (checked now; needed for MTP).  With ``fail_fast`` a FAIL of the audited step
    raises AuditFailed from ``optimizer.step()`` before the update (module docstring).  Then in the loop:
    ``with audit.step(it):`` around each iteration and ``audit.loss_func(...)`` in the forward step.
    ``options``: :class:`MegatronAdapter`'s.  Returns the adapter: ``paths``, ``results``, ``verdicts``.""")


#: The first entry (a constructor, then ``.attach(config, model=, optimizer=)``), without fail fast.
MegatronAudit = deprecated_alias(MegatronAdapter, "MegatronAudit",
                                 "lossguard_capture.megatron.attach(config, out_dir, ...)", fail_fast=False)
