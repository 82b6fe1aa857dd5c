"""Per-rank, per-step audit capture (lossguard docs/semantics.md §10, schema ``audit/1``).

The step recorder (:class:`StepRecorder`, made by :meth:`lossguard_capture.Capture.step`) writes it; the
deprecated positional :class:`Recorder` (kept for the code that wrote older captures) writes the same file.
Both are thin fronts over :class:`_Step`::

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

An objective of several terms (a KL penalty, an MTP head, an auxiliary z-loss) declares the terms other
than the main per-token loss and hooks each separately, over the same owned tokens in the same order::

    cap = Capture(out_dir, cp=2, terms={"kl": dict(coef=0.1), "aux": dict(coef=0.01, mask="all")})
    ...
            h.hook(per_token)                        # the main term: mb.{k}.token_weight
            h.hook(kl_per_token, term="kl")          # mb.{k}.term.kl.token_weight
            h.set(num_tokens=n_kl, term="kl")        # mb.{k}.term.kl.num_tokens

Nothing here synchronises with the device before ``finish()``: device tensors are kept (detached) as
they are and moved to the CPU only when the file is written.
"""

import math
import numbers
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import torch

from .zigzag import owned_count

__all__ = ["Recorder", "StepRecorder", "MicroBatch", "SCHEMA", "REDUCE_CHOICES", "CP_LAYOUTS",
           "TERM_MASKS", "CaptureWarning", "capture_filename", "check_terms"]

SCHEMA = "audit/1"

#: The objectives ``reduce`` may claim (docs/semantics.md §4 and §9); ``lossguard audit`` judges the
#: measured weights against the one the capture names.
REDUCE_CHOICES: tuple[str, ...] = ("per-token", "sample-mean", "token-mean", "seq-mean-token-sum",
                                   "seq-mean-token-mean", "seq-mean-token-sum-norm")
CP_LAYOUTS: tuple[str, ...] = ("zigzag", "allgather")

# the per-token loss dtypes the metadata `dtype` may name (docs/semantics.md §10)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64"}


class CaptureWarning(UserWarning):
    """A capture was not written or may not be what the trainer did (e.g. a step left without finish())."""


def capture_filename(step: int, rank: int) -> str:
    """``step{step:06d}-rank{rank:05d}.safetensors``."""
    return f"step{int(step):06d}-rank{int(rank):05d}.safetensors"


def check_reduce(reduce: str | None) -> str:
    """``reduce`` if it is one of :data:`REDUCE_CHOICES`, else ValueError naming them."""
    if reduce is None or reduce not in REDUCE_CHOICES:
        raise ValueError(f"reduce must be one of {', '.join(REDUCE_CHOICES)}; got {reduce!r}")
    return reduce


#: The token masks a declared loss term may use (``J`` an integer >= 1): the loss mask ``m_t``; every
#: response token; ``shift:J`` = ``m_t * m_{t+J}`` within the sample (0 where ``t+J >= R``); ``roll:J`` =
#: ``m_{t+J}`` within the sample (0 where ``t+J >= R``: Megatron-core's MTP mask at depth J, the loss mask
#: rolled left by J, multi_token_prediction.py:158-161, 0.16.1); a mask the trainer gives per micro-batch
#: (``hook(..., mask=)``, written as ``mb.{k}.term.NAME.mask``).
TERM_MASKS: tuple[str, ...] = ("loss", "all", "shift:J", "roll:J", "field")

_TERM_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_SHIFT_MASK = re.compile(r"(?:shift|roll):([1-9][0-9]*)")
_TERM_KEYS = ("reduce", "coef", "mask")


def check_declared_scales(scales: Mapping[str, float] | None) -> dict[str, float]:
    """Validate ``{NAME: factor}``: names without ``=`` or ``,``, finite non-zero factors."""
    out: dict[str, float] = {}
    for name, value in (scales or {}).items():
        name = str(name)
        if not name or "=" in name or "," in name:
            raise ValueError(f"declared scale name {name!r}: non-empty, without '=' or ','")
        v = float(value)
        if not math.isfinite(v) or v == 0.0:
            raise ValueError(f"declared scale {name!r}: a finite, non-zero factor; got {value!r}")
        out[name] = v
    return out


def check_term_name(name: Any) -> str:
    """``name`` if it names a loss term (``[a-z][a-z0-9_-]*``, not ``main``), else ValueError."""
    if not isinstance(name, str) or not _TERM_NAME.fullmatch(name):
        raise ValueError(f"loss term name {name!r}: must match [a-z][a-z0-9_-]*")
    if name == "main":
        raise ValueError("loss term name 'main' is the unnamed main term (hook it with term=None; do not declare it)")
    return name


def check_terms(terms: Mapping[str, Any] | None, reduce: str) -> dict[str, dict[str, str]]:
    """Validate loss-term declarations ``{NAME: {"reduce": R, "coef": C, "mask": M}}`` (every key optional;
    ``None`` for a term = all defaults) and return them normalised to their metadata text, in the given
    order: ``reduce`` (default: the capture's ``reduce``), ``coef`` (``repr(float)``, default ``"1.0"``),
    ``mask`` (``loss`` default, ``all``, ``shift:J`` or ``roll:J`` with J >= 1, ``field``).  ValueError naming the term
    and the field."""
    if terms is None:
        return {}
    if not isinstance(terms, Mapping):
        raise ValueError(f"terms must be a dict NAME -> dict(reduce=, coef=, mask=); got {type(terms).__name__}")
    out: dict[str, dict[str, str]] = {}
    for name, decl in terms.items():
        check_term_name(name)
        if decl is None:
            decl = {}
        if not isinstance(decl, Mapping):
            raise ValueError(f"loss term {name!r}: its declaration must be a dict(reduce=, coef=, mask=); "
                             f"got {type(decl).__name__}")
        unknown = [k for k in decl if k not in _TERM_KEYS]
        if unknown:
            raise ValueError(f"loss term {name!r}: unknown field(s) {', '.join(map(repr, unknown))} "
                             f"(fields: {', '.join(_TERM_KEYS)})")
        r = decl.get("reduce", None)
        r = reduce if r is None else r
        if r not in REDUCE_CHOICES:
            raise ValueError(f"loss term {name!r}: reduce must be one of {', '.join(REDUCE_CHOICES)}; got {r!r}")
        c = decl.get("coef", None)
        c = 1.0 if c is None else c
        if isinstance(c, torch.Tensor) and c.numel() == 1 and c.is_floating_point():
            c = float(c)
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(float(c)):
            raise ValueError(f"loss term {name!r}: coef must be a finite number; got {c!r}")
        mk = decl.get("mask", None)
        mk = "loss" if mk is None else mk
        if not isinstance(mk, str) or not (mk in ("loss", "all", "field") or _SHIFT_MASK.fullmatch(mk)):
            raise ValueError(f"loss term {name!r}: mask must be 'loss', 'all', 'shift:J', 'roll:J' (integer J >= 1) "
                             f"or 'field'; got {mk!r}")
        out[name] = {"reduce": r, "coef": repr(float(c)), "mask": mk}
    return out


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
    warnings.warn(f"lossguard_capture: {name} is not integral ({t.tolist()}); written as float64", CaptureWarning,
                  stacklevel=2)
    return t.to(torch.float64)


class _Hook:
    """One loss term's hook state in one micro-batch: the hooked tensor, the gradients the hook saw, the
    per-token values, the owned-token index, and (named terms) the field mask and the trainer's count."""

    def __init__(self) -> None:
        self.hooked: torch.Tensor | None = None     # the hooked tensor (for its shape/dtype)
        self.grads: list[torch.Tensor] = []           # grads seen by the hook (detached, device)
        self.token_loss: torch.Tensor | None = None
        self.handle: Any = None
        self.index: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None       # a field-mask term's [sum R] mask
        self.num_tokens: Any = None                    # a named term's count (set(term=))

    def attach(self, token_loss: torch.Tensor, record_token_loss: bool, index: Any) -> None:
        self.hooked = token_loss
        self.index = None if index is None else _as_tensor(index)
        if record_token_loss:
            self.token_loss = token_loss.detach()
        if token_loss.requires_grad:
            def _keep(grad: torch.Tensor) -> None:
                self.grads.append(grad.detach())
                return None
            self.handle = token_loss.register_hook(_keep)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(token_weight, token_loss) on the host, owned tokens in local order, in the written dtypes."""
        assert self.hooked is not None
        if self.grads:
            g = self.grads[0]
            for extra in self.grads[1:]:
                g = g + extra
            w = g.cpu().reshape(-1)
        else:
            w = torch.zeros(self.hooked.numel(), dtype=self.hooked.dtype)
        tl = None if self.token_loss is None else self.token_loss.cpu().reshape(-1)
        if self.index is not None:
            ix = self.index.cpu().reshape(-1)
            if ix.dtype != torch.bool:
                ix = ix.to(torch.int64)
            w = w[ix]
            tl = None if tl is None else tl[ix]
        return _float_out(w).contiguous(), None if tl is None else _float_out(tl).contiguous()

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class MicroBatch:
    """One micro-batch's records; returned by ``microbatch()`` of a step recorder."""

    def __init__(self, step: "_Step", index: int, fields: dict[str, Any], dummy: bool):
        self._step = step
        self.index = index
        self.dummy = bool(dummy)
        self._fields = fields                # name -> tensor (any device) or python value
        self._main = _Hook()                 # the unnamed `main` term
        self._terms: dict[str, _Hook] = {}   # named terms, in the order first hooked or set
        self._loss: torch.Tensor | None = None

    # the main term's state, under the names it always had
    @property
    def _hooked(self) -> torch.Tensor | None:
        return self._main.hooked

    @property
    def _grads(self) -> list[torch.Tensor]:
        return self._main.grads

    @property
    def _token_loss(self) -> torch.Tensor | None:
        return self._main.token_loss

    @property
    def dtype(self) -> torch.dtype | None:
        """The hooked (main) per-token loss tensor's own dtype (``None`` before hook())."""
        return None if self._main.hooked is None else self._main.hooked.dtype

    @property
    def dtypes(self) -> list[torch.dtype]:
        """The own dtypes of every hooked tensor: the main term's and each named term's."""
        return [h.hooked.dtype for h in [self._main, *self._terms.values()] if h.hooked is not None]

    def _term(self, term: str | None) -> "_Hook":
        if term is None:
            return self._main
        check_term_name(term)
        if term not in self._terms:
            self._terms[term] = _Hook()
        return self._terms[term]

    # -- per-token loss -------------------------------------------------------------------------
    def hook(self, token_loss: torch.Tensor, record_token_loss: bool = True, index: Any = None, *,
             term: str | None = None, mask: Any = None) -> torch.Tensor:
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
        is written as the metadata ``dtype`` (bf16/fp16 values themselves are written as float32).

        ``term`` (optional): the name of another term of the objective (a KL penalty, an MTP head, an
        auxiliary loss), hooked separately over the same owned tokens in the same order; written as
        ``mb.{k}.term.NAME.token_weight`` / ``.token_loss``.  One hook per term per micro-batch.  A term
        not declared in ``Capture(terms=...)`` is still written (audit reports it as undeclared).
        ``mask``: the ``[sum R]`` per-response-token mask of the micro-batch's samples, required for (and
        only for) a term declared with ``mask="field"``."""
        self._step._check_open()
        what = "a per-token loss tensor" if term is None else f"term {term!r}: a per-token loss tensor"
        h = self._term(term)
        if h.hooked is not None:
            raise RuntimeError(f"micro-batch {self.index}: {what} is already hooked")
        if not isinstance(token_loss, torch.Tensor):
            raise TypeError("hook() takes the per-token loss tensor")
        if not token_loss.is_floating_point():
            raise TypeError(f"micro-batch {self.index}: the per-token loss must be a float tensor, "
                            f"got {token_loss.dtype}")
        if index is None and token_loss.dim() != 1:
            raise ValueError(f"micro-batch {self.index}: per-token loss must be 1-D [owned] (or give index=), "
                             f"got {tuple(token_loss.shape)}")
        field = term is not None and self._step.terms.get(term, {}).get("mask") == "field"
        if mask is not None and not field:
            if term is None:
                raise ValueError(f"micro-batch {self.index}: mask= is for a term declared with mask='field'; "
                                 f"the main term's mask is the micro-batch's loss_masks")
            raise ValueError(f"micro-batch {self.index}: term {term!r} is not declared with mask='field' "
                             f"(declared: {self._step.terms.get(term, {}).get('mask', 'nothing')}); mask= is not taken")
        if field and mask is None:
            raise ValueError(f"micro-batch {self.index}: term {term!r} is declared with mask='field': "
                             f"hook(..., term={term!r}, mask=[sum R] mask of the micro-batch's samples)")
        if mask is not None:
            h.mask = _as_tensor(mask)
        h.attach(token_loss, record_token_loss, index)
        return token_loss

    def loss(self, scalar_loss: Any) -> Any:
        """Record the scalar this micro-batch backpropagates (detached): the whole loss, every term.
        Returns it."""
        self._step._check_open()
        if isinstance(scalar_loss, torch.Tensor):
            if scalar_loss.numel() != 1:
                raise ValueError(f"micro-batch {self.index}: loss must be a scalar, got {tuple(scalar_loss.shape)}")
            self._loss = scalar_loss.detach().reshape(())
        else:
            self._loss = torch.tensor(float(scalar_loss), dtype=torch.float64)
        return scalar_loss

    def set(self, num_tokens: Any = None, sample_denoms: Any = None, *, term: str | None = None) -> None:
        """Set ``num_tokens`` / ``sample_denoms`` once the loss function has computed them; with ``term``,
        that term's ``num_tokens`` (``mb.{k}.term.NAME.num_tokens``)."""
        self._step._check_open()
        if term is not None:
            if sample_denoms is not None:
                raise ValueError(f"micro-batch {self.index}: term {term!r}: sample_denoms is recorded for the "
                                 f"main term only")
            if num_tokens is not None:
                self._term(term).num_tokens = num_tokens
            return
        if num_tokens is not None:
            self._fields["num_tokens"] = num_tokens
        if sample_denoms is not None:
            self._fields["sample_denoms"] = sample_denoms

    # -- writing --------------------------------------------------------------------------------
    def _tensors(self, cp_rank: int, layout: str, strict: bool) -> dict[str, torch.Tensor]:
        """The micro-batch's ``mb.{k}.*`` tensors: its fields, then the hooked weights of the main term and of
        each other term; what does not fit (docs/semantics.md §1-2) raises with ``strict``, else warns."""
        k = f"mb.{self.index}."
        out = self._field_tensors(k)
        cp_size = int(out[k + "cp_size"])
        T = out[k + "total_lengths"]
        R = out[k + "response_lengths"]
        problems = self._packed_problems(out, k)

        # expected owned count (zig-zag only; for the shape checks below)
        packed_ok = not problems
        expected_owned = None
        if packed_ok and layout == "zigzag" and not self.dummy:
            r = cp_rank % cp_size
            expected_owned = sum(owned_count(int(t), int(rr), cp_size, r)
                                 for t, rr in zip(T.tolist(), R.tolist(), strict=True))

        def shape_check(n_hooked: int, what: str) -> None:
            if expected_owned is not None and n_hooked != expected_owned:
                problems.append(f"{what} has {n_hooked} entries but the rank owns {expected_owned} response "
                                f"tokens of these samples (docs/semantics.md §2, cp rank {cp_rank % cp_size} of "
                                f"{cp_size})")

        none_owned = self.dummy or expected_owned == 0
        if self._main.hooked is not None:
            w, tl = self._main.weights()
            out[k + "token_weight"] = w
            if tl is not None:
                out[k + "token_loss"] = tl
            shape_check(w.numel(), "the hooked per-token loss")
        elif none_owned:
            out[k + "token_weight"] = torch.zeros(0, dtype=torch.float32)
        else:
            problems.append("no per-token loss tensor was hooked (call handle.hook(per_token_loss))")
        n_response = int(R.sum()) if packed_ok else None
        for name, h in self._terms.items():
            self._term_tensors(out, f"{k}term.{name}.", name, h, none_owned, n_response, shape_check, problems)
        if problems:
            msg = f"lossguard_capture: micro-batch {self.index}: " + "; ".join(problems)
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, CaptureWarning, stacklevel=2)
        return out

    def _field_tensors(self, k: str) -> dict[str, torch.Tensor]:
        """The micro-batch's fields as host tensors named ``{k}NAME`` (integral ones as int64)."""
        f = self._fields
        out: dict[str, torch.Tensor] = {}
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
            out[k + "sample_denoms"] = _int_or_float64(_as_tensor(f["sample_denoms"]).cpu().reshape(-1),
                                                       k + "sample_denoms")
        return out

    @staticmethod
    def _packed_problems(out: dict[str, torch.Tensor], k: str) -> list[str]:
        """Where the packed fields (values on the host now) disagree with each other: one sample per index,
        0 <= R <= T, sum(T) tokens and sum(R) mask entries."""
        n = out[k + "sample_indices"].numel()
        T = out[k + "total_lengths"]
        R = out[k + "response_lengths"]
        problems: list[str] = []
        if T.numel() != n or R.numel() != n:
            problems.append(f"{n} sample_indices but {T.numel()} total_lengths and {R.numel()} response_lengths")
        elif bool((R > T).any()) or bool((R < 0).any()):
            problems.append("a response_length is negative or exceeds its total_length")
        else:
            if out[k + "tokens"].numel() != int(T.sum()):
                problems.append(f"tokens has {out[k + 'tokens'].numel()} entries, sum(total_lengths) = {int(T.sum())}")
            if out[k + "loss_masks"].numel() != int(R.sum()):
                problems.append(f"loss_masks has {out[k + 'loss_masks'].numel()} entries, "
                                f"sum(response_lengths) = {int(R.sum())}")
        return problems

    @staticmethod
    def _term_tensors(out: dict[str, torch.Tensor], p: str, name: str, h: _Hook, none_owned: bool,
                      n_response: int | None, shape_check: Callable[[int, str], None], problems: list[str]) -> None:
        """Term ``name``'s tensors ``{p}token_weight`` / ``token_loss`` / ``num_tokens`` / ``mask``; what is
        wrong with them goes to ``problems`` (``n_response``: sum(R), None when the packed fields are broken)."""
        if h.hooked is not None:
            w, tl = h.weights()
            out[p + "token_weight"] = w
            if tl is not None:
                out[p + "token_loss"] = tl
            shape_check(w.numel(), f"term {name!r}: the hooked per-token loss")
        elif h.num_tokens is not None:
            if none_owned:
                out[p + "token_weight"] = torch.zeros(0, dtype=torch.float32)
            else:
                problems.append(f"term {name!r}: num_tokens was set but no per-token loss tensor was hooked "
                                f"(call handle.hook(per_token_loss, term={name!r}))")
        if h.num_tokens is not None:
            out[p + "num_tokens"] = _int_or_float64(_as_tensor(h.num_tokens).cpu().reshape(()), p + "num_tokens")
        if h.mask is not None:
            fm = h.mask.cpu().reshape(-1)
            if fm.dtype == torch.bool or not fm.is_floating_point():
                fm = fm.to(torch.int64)
            elif torch.equal(fm, torch.round(fm)):
                fm = fm.to(torch.int64)
            if fm.is_floating_point() or bool(((fm != 0) & (fm != 1)).any()):
                problems.append(f"term {name!r}: the field mask holds values other than 0 and 1")
                fm = fm.to(torch.float64)
            if n_response is not None and fm.numel() != n_response:
                problems.append(f"term {name!r}: the field mask has {fm.numel()} entries, "
                                f"sum(response_lengths) = {n_response}")
            out[p + "mask"] = fm.contiguous()

    def _remove_hook(self) -> None:
        self._main.remove()
        for h in self._terms.values():
            h.remove()


class _Step:
    """One rank's records of one optimizer step; writes ``<out_dir>/step{step:06d}-rank{rank:05d}.safetensors``.

    The shared core of :class:`StepRecorder` (keyword-only, a context manager) and :class:`Recorder`
    (positional, the first API, deprecated)."""

    def __init__(self, out_dir: str, step: int, rank: int, world_size: int, *, tp: int = 1, pp: int = 1,
                 cp: int = 1, dp: int = 1, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0,
                 cp_layout: str = "zigzag", reduce: str = "per-token", strict: bool = True,
                 terms: Mapping[str, Any] | None = None, trainer: str | None = None,
                 declared_scales: Mapping[str, float] | None = None, loss_site: str | None = None):
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
        #: declared loss terms other than `main`: NAME -> {"reduce", "coef", "mask"} as metadata text
        self.terms: dict[str, dict[str, str]] = check_terms(terms, reduce)
        self.out_dir = out_dir
        self.step, self.rank, self.world_size = int(step), int(rank), int(world_size)
        self.tp, self.pp, self.cp, self.dp = int(tp), int(pp), int(cp), int(dp)
        self.tp_rank, self.pp_rank, self.cp_rank, self.dp_rank = int(tp_rank), int(pp_rank), int(cp_rank), int(dp_rank)
        self.cp_layout, self.reduce = cp_layout, reduce
        self.strict = strict
        #: metadata ``trainer`` (hf, trl, megatron, verl...): audit lists that trainer's presets first
        self.trainer = None if trainer is None else str(trainer)
        #: metadata ``declared_scales``: constant factors the trainer applies to its main loss (a loss
        #: coefficient); where one equals a layout product (0.5 at CP 2), audit takes it as the constant
        self.declared_scales: dict[str, float] = check_declared_scales(declared_scales)
        #: metadata ``loss_site``: where the trainer computes the loss (named in audit's advice)
        self.loss_site = None if loss_site is None else str(loss_site)
        self.microbatches: list[MicroBatch] = []
        self.path: str | None = None        # set by a successful finish()
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

    def _loss_dtype(self) -> str | None:
        """The metadata ``dtype``: the hooked per-token loss tensors' own dtype, the least precise one (the
        widest tolerance) over every hooked tensor, the main term's and every named term's.  If the main
        term's tensors of different micro-batches differ, with a warning (named terms in another dtype than
        the main one are common: no warning); ``None`` when nothing was hooked (audit then assumes float32)."""
        main = {mb.dtype for mb in self.microbatches if mb.dtype is not None}
        dts = {d for mb in self.microbatches for d in mb.dtypes}
        if not dts:
            return None
        worst = max(dts, key=lambda d: torch.finfo(d).eps)
        if len(main) > 1:
            warnings.warn(f"lossguard_capture: step {self.step}: the hooked per-token losses have different dtypes "
                          f"({', '.join(sorted(dtype_name(d) for d in main))}); metadata dtype = {dtype_name(worst)}",
                          CaptureWarning, stacklevel=2)
        return dtype_name(worst)

    def _tensors(self, grad_scale: Any, num_tokens_reduced: Any, skipped: Any, grad_norm: Any,
                 global_batch_size: Any, metrics_values: Any,
                 metrics_keys: Sequence[str] | None,
                 l_norm: Any = None, scheduler_stepped: Any = None,
                 global_batch_unit: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        out: dict[str, torch.Tensor] = {}
        for mb in self.microbatches:
            out.update(mb._tensors(self.cp_rank, self.cp_layout, self.strict))
        if grad_scale is None:
            raise ValueError("grad_scale is required (1 for a plain sum, 1/|G| for DDP's mean, 1/N for "
                             "Megatron's per-token finalisation)")
        out["grad_scale"] = _as_tensor(grad_scale).cpu().reshape(()).to(torch.float64)
        if num_tokens_reduced is not None:
            out["num_tokens_reduced"] = _int_or_float64(_as_tensor(num_tokens_reduced).cpu().reshape(()),
                                                        "num_tokens_reduced")
        if skipped is not None:
            out["skipped"] = torch.tensor(1 if bool(_as_tensor(skipped).cpu().reshape(())) else 0, dtype=torch.int64)
        if scheduler_stepped is not None:          # whether the LR scheduler advanced this step (§10)
            out["scheduler_stepped"] = torch.tensor(1 if bool(_as_tensor(scheduler_stepped).cpu().reshape(())) else 0,
                                                    dtype=torch.int64)
        if grad_norm is not None:
            out["grad_norm"] = _as_tensor(grad_norm).cpu().reshape(()).to(torch.float64)
        if global_batch_size is not None:
            out["global_batch_size"] = _as_tensor(global_batch_size).cpu().reshape(()).to(torch.int64)
        if l_norm is not None:
            # seq-mean-token-sum-norm's L_norm as the trainer used it (TRL dr_grpo's max_completion_length,
            # verl's loss_scale_factor); without it audit takes the step's longest response
            out["l_norm"] = _as_tensor(l_norm).cpu().reshape(()).to(torch.float64)
        meta: dict[str, Any] = {
            "lossguard.schema": SCHEMA, "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp,
            "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "cp_rank": self.cp_rank, "dp_rank": self.dp_rank,
            "cp_layout": self.cp_layout, "reduce": self.reduce, "num_microbatches": len(self.microbatches),
        }
        dtype = self._loss_dtype()
        if dtype is not None:
            meta["dtype"] = dtype
        if self.trainer:
            meta["trainer"] = self.trainer
        if self.declared_scales:
            meta["declared_scales"] = ",".join(f"{k}={v!r}" for k, v in self.declared_scales.items())
        if self.loss_site:
            meta["loss_site"] = self.loss_site
        if global_batch_unit is not None:
            if global_batch_unit not in ("samples", "rollouts"):
                raise ValueError(f"global_batch_unit {global_batch_unit!r}: 'samples' or 'rollouts'")
            meta["global_batch_unit"] = global_batch_unit
        if self.terms:
            meta["terms"] = ",".join(self.terms)
            for name, decl in self.terms.items():
                for field in ("reduce", "coef", "mask"):
                    meta[f"term.{name}.{field}"] = decl[field]
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
                global_batch_size: Any, metrics_values: Any, metrics_keys: Sequence[str] | None,
                l_norm: Any = None, scheduler_stepped: Any = None, global_batch_unit: str | None = None) -> str:
        from safetensors.torch import save_file

        self._check_open()
        tensors, meta = self._tensors(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                                      metrics_values, metrics_keys, l_norm, scheduler_stepped, global_batch_unit)
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
                metrics_keys: Sequence[str] | None = None, l_norm: Any = None,
                scheduler_stepped: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The (tensors, metadata) that :meth:`finish` writes, for inspection."""
        return self._tensors(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                             metrics_values, metrics_keys, l_norm, scheduler_stepped)

    def finish(self, *, grad_scale: Any, num_tokens_reduced: Any = None, skipped: Any = None,
               grad_norm: Any = None, global_batch_size: Any = None, metrics_values: Any = None,
               metrics_keys: Sequence[str] | None = None, l_norm: Any = None,
               scheduler_stepped: Any = None, global_batch_unit: str | None = None) -> str:
        """Write the step's capture file (atomically) and return its path.  ``grad_scale`` is the factor
        this rank applied to its gradients after backward; the rest are optional step records (§10);
        ``l_norm``: seq-mean-token-sum-norm's L_norm as the trainer used it; ``scheduler_stepped``: whether
        the LR scheduler advanced (a skipped step advances neither it nor the optimizer);
        ``global_batch_unit``: what ``global_batch_size`` counts, ``"samples"`` or ``"rollouts"`` (slime's
        and Relax's rollouts of several samples).  A rank that computes no loss (a pipeline stage before the
        last) records no micro-batch: only these step records, which audit judges with the last stage's."""
        return self._finish(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                            metrics_values, metrics_keys, l_norm, scheduler_stepped, global_batch_unit)

    def __enter__(self) -> "StepRecorder":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> "Literal[False]":
        if self.closed:
            return False
        self.abort()
        if exc_type is None:
            warnings.warn(f"lossguard_capture: step {self.step} on rank {self.rank} left its `with` block without "
                          f"finish(): nothing was written (lossguard audit will report this rank's capture as "
                          f"missing)", CaptureWarning, stacklevel=2)
        return False


class Recorder(_Step):
    """Deprecated: use :class:`lossguard_capture.Capture` (``cap = Capture(out_dir, reduce=..., cp=...)``
    once per run, ``with cap.step(n) as s:`` per step) or a trainer adapter (``lossguard_capture.hf`` /
    ``.trl`` / ``.megatron`` / ``.verl`` ``.attach(target, out_dir)``).  Constructing it warns
    ``DeprecationWarning``.

    The first, positional API, kept so that the code that wrote older captures still runs:
    ``Recorder(out_dir, step, rank, world_size, tp=.., pp=.., cp=.., dp=.., tp_rank=.., ...)`` records one
    rank's step, the coordinates given, not found.  It writes the same file as :class:`StepRecorder`
    (``Capture(out_dir, rank=rank, world_size=world_size, tp=.., ..., tp_rank=.., ...).step(step)`` is its
    equivalent, with keyword-only ``microbatch()``/``finish()``)."""

    def __init__(self, out_dir: str, step: int, rank: int, world_size: int, *, tp: int = 1, pp: int = 1,
                 cp: int = 1, dp: int = 1, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0,
                 cp_layout: str = "zigzag", reduce: str = "per-token", strict: bool = True,
                 terms: Mapping[str, Any] | None = None):
        warnings.warn("lossguard_capture.Recorder is deprecated: use lossguard_capture.Capture "
                      "(cap = Capture(out_dir, ...) once per run; with cap.step(n) as s: ... s.finish(...)) "
                      "or a trainer adapter (lossguard_capture.hf/trl/megatron/verl.attach)",
                      DeprecationWarning, stacklevel=2)
        super().__init__(out_dir, step, rank, world_size, tp=tp, pp=pp, cp=cp, dp=dp, tp_rank=tp_rank,
                         pp_rank=pp_rank, cp_rank=cp_rank, dp_rank=dp_rank, cp_layout=cp_layout, reduce=reduce,
                         strict=strict, terms=terms)

    def microbatch(self, sample_indices: Any, tokens: Any, total_lengths: Any, response_lengths: Any,
                   loss_masks: Any, cp_size: Any, num_tokens: Any = None, sample_denoms: Any = None,
                   dummy: bool = False) -> MicroBatch:
        """As :meth:`StepRecorder.microbatch`, positional."""
        return self._microbatch(sample_indices, tokens, total_lengths, response_lengths, loss_masks, cp_size,
                                num_tokens, sample_denoms, dummy)

    def tensors(self, grad_scale: Any, num_tokens_reduced: Any = None, skipped: Any = None,
                grad_norm: Any = None, global_batch_size: Any = None, metrics_values: Any = None,
                metrics_keys: Sequence[str] | None = None,
                l_norm: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The (tensors, metadata) that :meth:`finish` writes, for inspection."""
        return self._tensors(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                             metrics_values, metrics_keys, l_norm)

    def finish(self, grad_scale: Any, num_tokens_reduced: Any = None, skipped: Any = None,
               grad_norm: Any = None, global_batch_size: Any = None, metrics_values: Any = None,
               metrics_keys: Sequence[str] | None = None, l_norm: Any = None) -> str:
        """As :meth:`StepRecorder.finish`, positional."""
        return self._finish(grad_scale, num_tokens_reduced, skipped, grad_norm, global_batch_size,
                            metrics_values, metrics_keys, l_norm)
