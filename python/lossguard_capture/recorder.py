"""Per-rank, per-step audit capture (lossguard docs/semantics.md §10, schema ``audit/1``).

The step recorder (:class:`StepRecorder`, made by :meth:`lossguard_capture.Capture.step`) and the
older positional :class:`Recorder` write the same file; both are thin fronts over :class:`_Step`::

    cap = Capture(out_dir, cp=2, reduce="per-token")          # rank, world, coordinates found
    with cap.step(n) as s:
        for mb in microbatches:
            h = s.microbatch(sample_indices=mb.sample_indices, tokens=mb.tokens,
                             total_lengths=mb.total_lengths, response_lengths=mb.response_lengths,
                             loss_masks=mb.loss_masks, cp_size=2)
            per_token = ...                   # [owned] per-token losses, local order
            h.hook(per_token)                 # dL/dl_t arrives here during backward
            loss = (per_token * owned_mask).sum()
            h.loss(loss)
            loss.backward()
        s.finish(grad_scale=1.0 / n_global, num_tokens_reduced=n_global, skipped=False, grad_norm=gn)

Nothing here synchronises with the device before ``finish()``: device tensors are kept (detached) as
they are and moved to the CPU only when the file is written.
"""

import os
import tempfile
import warnings
from types import TracebackType
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Type

import torch

from .zigzag import owned_count

__all__ = ["Recorder", "StepRecorder", "MicroBatch", "SCHEMA", "REDUCE_CHOICES", "CP_LAYOUTS",
           "CaptureWarning", "capture_filename"]

SCHEMA = "audit/1"

#: The objectives ``reduce`` may claim (docs/semantics.md §4 and §9); ``lossguard audit`` judges the
#: measured weights against the one the capture names.
REDUCE_CHOICES: Tuple[str, ...] = ("per-token", "sample-mean", "token-mean", "seq-mean-token-sum",
                                   "seq-mean-token-mean", "seq-mean-token-sum-norm")
CP_LAYOUTS: Tuple[str, ...] = ("zigzag", "allgather")

# the per-token loss dtypes the metadata `dtype` may name (docs/semantics.md §10)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64"}


class CaptureWarning(UserWarning):
    """A capture was not written or may not be what the trainer did (e.g. a step left without finish())."""


def capture_filename(step: int, rank: int) -> str:
    """``step{step:06d}-rank{rank:05d}.safetensors``."""
    return f"step{int(step):06d}-rank{int(rank):05d}.safetensors"


def check_reduce(reduce: str) -> str:
    """``reduce`` if it is one of :data:`REDUCE_CHOICES`, else ValueError naming them."""
    if reduce not in REDUCE_CHOICES:
        raise ValueError(f"reduce must be one of {', '.join(REDUCE_CHOICES)}; got {reduce!r}")
    return reduce


def dtype_name(dtype: torch.dtype) -> str:
    """The metadata name of a per-token loss dtype: ``bfloat16``, ``float16``, ``float32``, ``float64``
    (any other float, e.g. fp8, by torch's own name without ``torch.``)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _as_tensor(x: Any) -> torch.Tensor:
    """A tensor for a tensor, a number, or a (possibly nested / ragged) list of numbers or tensors.

    Ragged input (a list of per-sample tensors or lists) is concatenated, on the tensors' device;
    no values are read, so no host synchronisation happens.
    """
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            return torch.zeros(0, dtype=torch.int64)
        if any(isinstance(e, (torch.Tensor, list, tuple)) for e in x):
            parts = [_as_tensor(e).reshape(-1) for e in x]
            devs = {p.device for p in parts if p.numel() > 0} or {parts[0].device}
            dev = next(iter(devs))
            return torch.cat([p.to(dev) for p in parts]) if len(devs) == 1 else torch.cat([p.cpu() for p in parts])
        return _from_python(x)
    return _from_python(x)


def _from_python(x: Any) -> torch.Tensor:
    """A tensor from Python numbers; floats become float64 (never torch's default float32)."""
    t = torch.tensor(x)
    if t.is_floating_point():
        t = torch.tensor(x, dtype=torch.float64)
    return t


def _float_out(t: torch.Tensor) -> torch.Tensor:
    """float32/float64 kept, any other float (bf16, fp16, fp8) written as float32."""
    if t.dtype in (torch.float32, torch.float64):
        return t
    return t.to(torch.float32)


def _int_or_float64(t: torch.Tensor, name: str) -> torch.Tensor:
    """An integer record: int64; a float that holds integers becomes int64; a non-integral float stays
    float64 with a warning (the trainer's count was not an integer — a finding for audit to show)."""
    if not t.dtype.is_floating_point and t.dtype != torch.bool:
        return t.to(torch.int64)
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    if torch.all(torch.isfinite(t)) and torch.equal(t, torch.round(t)):
        return t.to(torch.int64)
    warnings.warn(f"lossguard_capture: {name} is not integral ({t.tolist()}); written as float64", CaptureWarning)
    return t.to(torch.float64)


class MicroBatch:
    """One micro-batch's records; returned by ``microbatch()`` of a step recorder."""

    def __init__(self, step: "_Step", index: int, fields: Dict[str, Any], dummy: bool):
        self._step = step
        self.index = index
        self.dummy = bool(dummy)
        self._fields = fields                # name -> tensor (any device) or python value
        self._hooked: Optional[torch.Tensor] = None    # the hooked tensor (for its shape/dtype)
        self._grads: List[torch.Tensor] = []          # grads seen by the hook (detached, device)
        self._token_loss: Optional[torch.Tensor] = None
        self._loss: Optional[torch.Tensor] = None
        self._handle: Any = None
        self._index: Optional[torch.Tensor] = None

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The hooked per-token loss tensor's own dtype (``None`` before hook())."""
        return None if self._hooked is None else self._hooked.dtype

    # -- per-token loss -------------------------------------------------------------------------
    def hook(self, token_loss: torch.Tensor, record_token_loss: bool = True, index: Any = None) -> torch.Tensor:
        """Register a backward hook on the per-token loss tensor (the rank's owned tokens, local order:
        per sample, owned response indices ascending).  The gradient ``dL/dl_t`` that reaches it is kept
        (detached, on its device) as ``token_weight``; if the hook fires several times (several backward
        passes through it) the gradients are summed.  A tensor that does not require grad, or one the
        backward never reaches, gets weight 0 for every token.  With ``record_token_loss`` its value is
        kept as ``token_loss``.  Returns ``token_loss`` so calls can be chained.

        ``index`` (optional): when the tensor holds more than the owned tokens (Megatron's per-token
        losses of every local position), the owned tokens in local order are ``token_loss.reshape(-1)[index]``;
        a LongTensor index (any device) is applied in ``finish()``, so it costs no sync (a bool mask
        works too, but selecting with it reads its values).

        The loss must be computed *from this tensor* (for masked tokens too: ``(l * mask).sum()``), so
        that ``dL/dl_t`` is the weight with which ``grad(l_t)`` enters the gradient.  The tensor's dtype
        is written as the metadata ``dtype`` (bf16/fp16 values themselves are written as float32)."""
        self._step._check_open()
        if self._hooked is not None:
            raise RuntimeError(f"micro-batch {self.index}: a per-token loss tensor is already hooked")
        if not isinstance(token_loss, torch.Tensor):
            raise TypeError("hook() takes the per-token loss tensor")
        if not token_loss.is_floating_point():
            raise TypeError(f"micro-batch {self.index}: the per-token loss must be a float tensor, got {token_loss.dtype}")
        if index is None and token_loss.dim() != 1:
            raise ValueError(f"micro-batch {self.index}: per-token loss must be 1-D [owned] (or give index=), "
                             f"got {tuple(token_loss.shape)}")
        self._hooked = token_loss
        self._index = None if index is None else _as_tensor(index)
        if record_token_loss:
            self._token_loss = token_loss.detach()
        if token_loss.requires_grad:
            def _keep(grad: torch.Tensor) -> None:
                self._grads.append(grad.detach())
                return None
            self._handle = token_loss.register_hook(_keep)
        return token_loss

    def loss(self, scalar_loss: Any) -> Any:
        """Record the scalar this micro-batch backpropagates (detached).  Returns it."""
        self._step._check_open()
        if isinstance(scalar_loss, torch.Tensor):
            if scalar_loss.numel() != 1:
                raise ValueError(f"micro-batch {self.index}: loss must be a scalar, got {tuple(scalar_loss.shape)}")
            self._loss = scalar_loss.detach().reshape(())
        else:
            self._loss = torch.tensor(float(scalar_loss), dtype=torch.float64)
        return scalar_loss

    def set(self, num_tokens: Any = None, sample_denoms: Any = None) -> None:
        """Set ``num_tokens`` / ``sample_denoms`` once the loss function has computed them."""
        self._step._check_open()
        if num_tokens is not None:
            self._fields["num_tokens"] = num_tokens
        if sample_denoms is not None:
            self._fields["sample_denoms"] = sample_denoms

    # -- writing --------------------------------------------------------------------------------
    def _tensors(self, cp_rank: int, layout: str, strict: bool) -> Dict[str, torch.Tensor]:
        k = f"mb.{self.index}."
        f = self._fields
        out: Dict[str, torch.Tensor] = {}
        for name in ("sample_indices", "total_lengths", "response_lengths"):
            out[k + name] = _as_tensor(f[name]).cpu().reshape(-1).to(torch.int64)
        out[k + "tokens"] = _as_tensor(f["tokens"]).cpu().reshape(-1).to(torch.int64)
        masks = f["loss_masks"]
        if masks is None:      # absent mask = all ones (docs/semantics.md §1)
            n_mask = int(out[k + "response_lengths"].sum())
            out[k + "loss_masks"] = torch.ones(n_mask, dtype=torch.int64)
        else:
            out[k + "loss_masks"] = _as_tensor(masks).cpu().reshape(-1).to(torch.int64)
        cp_size = int(_as_tensor(f["cp_size"]).cpu().reshape(()))
        out[k + "cp_size"] = torch.tensor(cp_size, dtype=torch.int64)
        if f.get("num_tokens") is not None:
            out[k + "num_tokens"] = _int_or_float64(_as_tensor(f["num_tokens"]).cpu().reshape(()), k + "num_tokens")
        if self._loss is not None:
            out[k + "loss"] = self._loss.cpu().to(torch.float64).reshape(())
        out[k + "dummy"] = torch.tensor(1 if self.dummy else 0, dtype=torch.int64)
        if f.get("sample_denoms") is not None:
            out[k + "sample_denoms"] = _int_or_float64(_as_tensor(f["sample_denoms"]).cpu().reshape(-1), k + "sample_denoms")

        # consistency of the packed fields (values are on the host now)
        n = out[k + "sample_indices"].numel()
        T = out[k + "total_lengths"]
        R = out[k + "response_lengths"]
        problems: List[str] = []
        if T.numel() != n or R.numel() != n:
            problems.append(f"{n} sample_indices but {T.numel()} total_lengths and {R.numel()} response_lengths")
        elif bool((R > T).any()) or bool((R < 0).any()):
            problems.append("a response_length is negative or exceeds its total_length")
        else:
            if out[k + "tokens"].numel() != int(T.sum()):
                problems.append(f"tokens has {out[k + 'tokens'].numel()} entries, sum(total_lengths) = {int(T.sum())}")
            if out[k + "loss_masks"].numel() != int(R.sum()):
                problems.append(f"loss_masks has {out[k + 'loss_masks'].numel()} entries, sum(response_lengths) = {int(R.sum())}")

        # expected owned count (zig-zag only; for the shape checks below)
        expected_owned = None
        if not problems and layout == "zigzag" and not self.dummy:
            r = cp_rank % cp_size
            expected_owned = sum(owned_count(int(t), int(rr), cp_size, r) for t, rr in zip(T.tolist(), R.tolist()))

        if self._hooked is not None:
            dt = self._hooked.dtype
            if self._grads:
                g = self._grads[0]
                for extra in self._grads[1:]:
                    g = g + extra
                w = g.cpu().reshape(-1)
            else:
                w = torch.zeros(self._hooked.numel(), dtype=dt)
            tl = None if self._token_loss is None else self._token_loss.cpu().reshape(-1)
            if self._index is not None:
                ix = self._index.cpu().reshape(-1)
                if ix.dtype != torch.bool:
                    ix = ix.to(torch.int64)
                w = w[ix]
                tl = None if tl is None else tl[ix]
            shape_n = w.numel()
            out[k + "token_weight"] = _float_out(w).contiguous()
            if tl is not None:
                out[k + "token_loss"] = _float_out(tl).contiguous()
            if expected_owned is not None and shape_n != expected_owned:
                problems.append(f"the hooked per-token loss has {shape_n} entries but the rank owns "
                                f"{expected_owned} response tokens of these samples (docs/semantics.md §2, cp rank {cp_rank % cp_size} of {cp_size})")
        elif self.dummy or expected_owned == 0:
            out[k + "token_weight"] = torch.zeros(0, dtype=torch.float32)
        else:
            problems.append("no per-token loss tensor was hooked (call handle.hook(per_token_loss))")
        if problems:
            msg = f"lossguard_capture: micro-batch {self.index}: " + "; ".join(problems)
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, CaptureWarning)
        return out

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class _Step:
    """One rank's records of one optimizer step; writes ``<out_dir>/step{step:06d}-rank{rank:05d}.safetensors``.

    The shared core of :class:`StepRecorder` (keyword-only, a context manager) and :class:`Recorder`
    (positional, the first API)."""

    def __init__(self, out_dir: str, step: int, rank: int, world_size: int, *, tp: int = 1, pp: int = 1,
                 cp: int = 1, dp: int = 1, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0,
                 cp_layout: str = "zigzag", reduce: str = "per-token", strict: bool = True):
        if tp * pp * cp * dp != world_size:
            raise ValueError(f"tp*pp*cp*dp = {tp * pp * cp * dp} != world_size {world_size}")
        for name, c, size in (("tp", tp_rank, tp), ("pp", pp_rank, pp), ("cp", cp_rank, cp), ("dp", dp_rank, dp)):
            if not 0 <= c < size:
                raise ValueError(f"{name}_rank {c} outside [0, {size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be 'zigzag' or 'allgather', got {cp_layout!r}")
        check_reduce(reduce)
        self.out_dir = out_dir
        self.step, self.rank, self.world_size = int(step), int(rank), int(world_size)
        self.tp, self.pp, self.cp, self.dp = int(tp), int(pp), int(cp), int(dp)
        self.tp_rank, self.pp_rank, self.cp_rank, self.dp_rank = int(tp_rank), int(pp_rank), int(cp_rank), int(dp_rank)
        self.cp_layout, self.reduce = cp_layout, reduce
        self.strict = strict
        self.microbatches: List[MicroBatch] = []
        self.path: Optional[str] = None        # set by a successful finish()
        self.aborted = False                   # set by abort(): nothing was, or will be, written

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def closed(self) -> bool:
        """finish() wrote the file, or abort() dropped the step."""
        return self.path is not None or self.aborted

    def _check_open(self) -> None:
        if self.path is not None:
            raise RuntimeError(f"step {self.step}: finish() was already called")
        if self.aborted:
            raise RuntimeError(f"step {self.step}: the step was aborted (nothing is written)")

    def abort(self) -> None:
        """Drop the step: remove every hook, write nothing.  Idempotent; a no-op after finish()."""
        for mb in self.microbatches:
            mb._remove_hook()
        if self.path is None:
            self.aborted = True

    def _microbatch(self, sample_indices: Any, tokens: Any, total_lengths: Any, response_lengths: Any,
                    loss_masks: Any, cp_size: Any, num_tokens: Any, sample_denoms: Any, dummy: bool) -> MicroBatch:
        self._check_open()
        fields = {
            "sample_indices": sample_indices, "tokens": tokens, "total_lengths": total_lengths,
            "response_lengths": response_lengths, "loss_masks": loss_masks, "cp_size": cp_size,
            "num_tokens": num_tokens, "sample_denoms": sample_denoms,
        }
        # ragged input is concatenated now (on device, no sync) so the caller may reuse its lists
        for name in ("tokens", "loss_masks", "sample_indices", "total_lengths", "response_lengths"):
            if fields[name] is not None:
                fields[name] = _as_tensor(fields[name])
        mb = MicroBatch(self, len(self.microbatches), fields, dummy)
        self.microbatches.append(mb)
        return mb

    def _loss_dtype(self) -> Optional[str]:
        """The metadata ``dtype``: the hooked per-token loss tensors' own dtype.  If micro-batches hooked
        different dtypes, the least precise one (the widest tolerance) with a warning; ``None`` when
        nothing was hooked (audit then assumes float32)."""
        dts = {mb.dtype for mb in self.microbatches if mb.dtype is not None}
        if not dts:
            return None
        if len(dts) > 1:
            worst = max(dts, key=lambda d: torch.finfo(d).eps)
            warnings.warn(f"lossguard_capture: step {self.step}: the hooked per-token losses have different dtypes "
                          f"({', '.join(sorted(dtype_name(d) for d in dts))}); metadata dtype = {dtype_name(worst)}",
                          CaptureWarning)
            return dtype_name(worst)
        return dtype_name(next(iter(dts)))

    def _tensors(self, grad_scale: Any, num_tokens_reduced: Any, skipped: Any, grad_norm: Any,
                 global_batch_size: Any, metrics_values: Any,
                 metrics_keys: Optional[Sequence[str]],
                 l_norm: Any = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
        out: Dict[str, torch.Tensor] = {}
        for mb in self.microbatches:
            out.update(mb._tensors(self.cp_rank, self.cp_layout, self.strict))
        if grad_scale is None:
            raise ValueError("grad_scale is required (1 for a plain sum, 1/|G| for DDP's mean, 1/N for "
                             "Megatron's per-token finalisation)")
        out["grad_scale"] = _as_tensor(grad_scale).cpu().reshape(()).to(torch.float64)
        if num_tokens_reduced is not None:
            out["num_tokens_reduced"] = _int_or_float64(_as_tensor(num_tokens_reduced).cpu().reshape(()), "num_tokens_reduced")
        if skipped is not None:
            out["skipped"] = torch.tensor(1 if bool(_as_tensor(skipped).cpu().reshape(())) else 0, dtype=torch.int64)
        if grad_norm is not None:
            out["grad_norm"] = _as_tensor(grad_norm).cpu().reshape(()).to(torch.float64)
        if global_batch_size is not None:
            out["global_batch_size"] = _as_tensor(global_batch_size).cpu().reshape(()).to(torch.int64)
        if l_norm is not None:
            # seq-mean-token-sum-norm's L_norm as the trainer used it (TRL dr_grpo's max_completion_length,
            # verl's loss_scale_factor); without it audit takes the step's longest response
            out["l_norm"] = _as_tensor(l_norm).cpu().reshape(()).to(torch.float64)
        meta: Dict[str, Any] = {
            "lossguard.schema": SCHEMA, "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp,
            "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "cp_rank": self.cp_rank, "dp_rank": self.dp_rank,
            "cp_layout": self.cp_layout, "reduce": self.reduce, "num_microbatches": len(self.microbatches),
        }
        dtype = self._loss_dtype()
        if dtype is not None:
            meta["dtype"] = dtype
        if metrics_values is not None:
            v = _as_tensor(metrics_values).cpu().reshape(-1)
            out["metrics.values"] = v if v.dtype in (torch.float32, torch.float64) else v.to(torch.float64)
        if metrics_keys is not None:
            keys = [str(x) for x in metrics_keys]
            bad = [x for x in keys if "," in x]
            if bad:
                raise ValueError(f"metric names may not contain ',': {bad}")
            meta["metrics.keys"] = ",".join(keys)
        return {n: t.contiguous().clone() for n, t in out.items()}, {k: str(v) for k, v in meta.items()}

    def _finish(self, grad_scale: Any, num_tokens_reduced: Any, skipped: Any, grad_norm: Any,
                global_batch_size: Any, metrics_values: Any, metrics_keys: Optional[Sequence[str]],
                l_norm: Any = None) -> str:
        from safetensors.torch import save_file

        self._check_open()
        tensors, meta = self._tensors(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                                      metrics_values, metrics_keys, l_norm)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, capture_filename(self.step, self.rank))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=self.out_dir)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        for mb in self.microbatches:
            mb._remove_hook()
        self.path = path
        return path


class StepRecorder(_Step):
    """One rank's step, as :meth:`lossguard_capture.Capture.step` makes it: keyword-only and a context
    manager.

    ``with cap.step(n) as s:`` yields it.  Leaving the block:

    * after :meth:`finish` — nothing more happens (the file was written by finish());
    * by an exception — every hook is removed, nothing is written, the exception propagates;
    * normally but without finish() — every hook is removed, nothing is written, and a
      :class:`CaptureWarning` says so (``lossguard audit`` would report this rank's capture as missing;
      a warning, not an error, so that a diagnostic never stops a training run by itself).
    """

    active = True      #: a real recorder (a step not selected by ``Capture(steps=...)`` gives an inactive one)

    def microbatch(self, *, sample_indices: Any, tokens: Any, total_lengths: Any, response_lengths: Any,
                   loss_masks: Any = None, cp_size: Any = 1, num_tokens: Any = None, sample_denoms: Any = None,
                   dummy: bool = False) -> MicroBatch:
        """Start micro-batch ``k`` (0, 1, ...): its samples by global index, their packed ``tokens``
        ``[sum T]`` and ``loss_masks`` ``[sum R]`` (a list of per-sample tensors/lists is concatenated;
        ``None`` = all ones), lengths ``[n]``, the CP size it was sharded with, and optionally the count
        the trainer computed for it (``num_tokens``) and per-sample denominators (``sample_denoms``).  A
        ``dummy`` micro-batch carries no loss (its tokens are neither owned nor counted).  Inputs may be
        device tensors; nothing is read from them here."""
        return self._microbatch(sample_indices, tokens, total_lengths, response_lengths, loss_masks, cp_size,
                                num_tokens, sample_denoms, dummy)

    def tensors(self, *, grad_scale: Any, num_tokens_reduced: Any = None, skipped: Any = None,
                grad_norm: Any = None, global_batch_size: Any = None, metrics_values: Any = None,
                metrics_keys: Optional[Sequence[str]] = None,
                l_norm: Any = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
        """The (tensors, metadata) that :meth:`finish` writes, for inspection."""
        return self._tensors(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                             metrics_values, metrics_keys, l_norm)

    def finish(self, *, grad_scale: Any, num_tokens_reduced: Any = None, skipped: Any = None,
               grad_norm: Any = None, global_batch_size: Any = None, metrics_values: Any = None,
               metrics_keys: Optional[Sequence[str]] = None, l_norm: Any = None) -> str:
        """Write the step's capture file (atomically) and return its path.  ``grad_scale`` is the factor
        this rank applied to its gradients after backward; the rest are optional step records (§10);
        ``l_norm``: seq-mean-token-sum-norm's L_norm as the trainer used it."""
        return self._finish(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                            metrics_values, metrics_keys, l_norm)

    def __enter__(self) -> "StepRecorder":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> "Literal[False]":
        if self.closed:
            return False
        self.abort()
        if exc_type is None:
            warnings.warn(f"lossguard_capture: step {self.step} on rank {self.rank} left its `with` block without "
                          f"finish(): nothing was written (lossguard audit will report this rank's capture as "
                          f"missing)", CaptureWarning, stacklevel=2)
        return False


class Recorder(_Step):
    """The first, positional API (kept for existing trainers; new code: :class:`lossguard_capture.Capture`).

    ``Recorder(out_dir, step, rank, world_size, tp=.., pp=.., cp=.., dp=.., tp_rank=.., ...)`` records
    one rank's step; the coordinates are given, not found.  Same file as :class:`StepRecorder`."""

    def __init__(self, out_dir: str, step: int, rank: int, world_size: int, *, tp: int = 1, pp: int = 1,
                 cp: int = 1, dp: int = 1, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0,
                 cp_layout: str = "zigzag", reduce: str = "per-token", strict: bool = True):
        super().__init__(out_dir, step, rank, world_size, tp=tp, pp=pp, cp=cp, dp=dp, tp_rank=tp_rank,
                         pp_rank=pp_rank, cp_rank=cp_rank, dp_rank=dp_rank, cp_layout=cp_layout, reduce=reduce,
                         strict=strict)

    def microbatch(self, sample_indices: Any, tokens: Any, total_lengths: Any, response_lengths: Any,
                   loss_masks: Any, cp_size: Any, num_tokens: Any = None, sample_denoms: Any = None,
                   dummy: bool = False) -> MicroBatch:
        """As :meth:`StepRecorder.microbatch`, positional."""
        return self._microbatch(sample_indices, tokens, total_lengths, response_lengths, loss_masks, cp_size,
                                num_tokens, sample_denoms, dummy)

    def tensors(self, grad_scale: Any, num_tokens_reduced: Any = None, skipped: Any = None,
                grad_norm: Any = None, global_batch_size: Any = None, metrics_values: Any = None,
                metrics_keys: Optional[Sequence[str]] = None,
                l_norm: Any = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
        """The (tensors, metadata) that :meth:`finish` writes, for inspection."""
        return self._tensors(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                             metrics_values, metrics_keys, l_norm)

    def finish(self, grad_scale: Any, num_tokens_reduced: Any = None, skipped: Any = None,
               grad_norm: Any = None, global_batch_size: Any = None, metrics_values: Any = None,
               metrics_keys: Optional[Sequence[str]] = None, l_norm: Any = None) -> str:
        """As :meth:`StepRecorder.finish`, positional."""
        return self._finish(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                            metrics_values, metrics_keys, l_norm)
