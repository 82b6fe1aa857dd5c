"""``Capture``: one object per training run that hands out a step recorder per optimizer step.

    import lossguard_capture as lc

    cap = lc.Capture("captures", reduce="per-token", cp=2)     # after init_process_group, or under torchrun
    for n, batch in enumerate(loader):
        with cap.step(n) as s:
            for mb in micro_batches(batch):
                h = s.microbatch(sample_indices=..., tokens=..., total_lengths=..., response_lengths=...,
                                 loss_masks=..., cp_size=2)
                l = per_token_loss(...)          # [owned], local order
                h.hook(l)
                loss = (l * mask).sum() / n_tokens
                h.loss(loss)
                loss.backward()
            ...
            s.finish(grad_scale=..., num_tokens_reduced=..., skipped=..., grad_norm=...)

The rank and world size come from ``torch.distributed`` when it is initialised, else from the
``RANK``/``WORLD_SIZE`` environment variables a launcher sets, else 0/1.  The rank's tp/cp/dp/pp
coordinates follow Megatron's order (docs/semantics.md §7): ``rank = tp + TP*(cp + CP*(dp + DP*pp))``,
unless given.
"""

import os
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Literal

from .recorder import CP_LAYOUTS, StepRecorder, check_declared_scales, check_reduce, check_terms

__all__ = ["Capture", "coordinates"]


def coordinates(rank: int, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1) -> dict[str, int]:
    """A global rank's ``tp_rank``, ``cp_rank``, ``dp_rank``, ``pp_rank`` in Megatron's order
    (``tp-cp-ep-dp-pp`` with EP = 1): ``rank = tp + TP*(cp + CP*(dp + DP*pp))``."""
    world = tp * pp * cp * dp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, tp*pp*cp*dp = {world})")
    return {"tp_rank": rank % tp, "cp_rank": (rank // tp) % cp, "dp_rank": (rank // (tp * cp)) % dp,
            "pp_rank": rank // (tp * cp * dp)}


def _rank_and_world() -> "tuple[int, int]":
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:                 # pragma: no cover - torch without distributed
        pass
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return 0, 1


class Capture:
    """Records audit captures (docs/semantics.md §10) of a training run, one file per rank and step.

    ``reduce`` is the objective the trainer claims (``lossguard audit`` judges the measured weights
    against it; one of :data:`lossguard_capture.REDUCE_CHOICES`).  ``tp``, ``pp``, ``cp`` are the model-
    parallel sizes; ``dp`` defaults to ``world_size / (tp*pp*cp)``.  ``rank``/``world_size`` and the
    coordinates ``tp_rank``... are found (module docstring) unless given.  ``steps``: the optimizer steps
    to record (``None``: every step); :meth:`step` of any other step gives an inactive recorder that
    records nothing and costs nothing.  ``strict``: inconsistent fields raise ``ValueError`` in finish()
    (``False``: a warning).

    ``terms``: the objective's terms besides the main per-token loss, ``{NAME: dict(reduce=, coef=,
    mask=)}`` (every key optional: the capture's ``reduce``, 1.0, ``"loss"``; mask ``"loss"``, ``"all"``,
    ``"shift:J"`` or ``"field"``), e.g. ``{"kl": dict(coef=0.1), "aux": dict(coef=0.01, mask="all")}``.
    Each is hooked separately: ``h.hook(l_kl, term="kl")``, its count ``h.set(num_tokens=n, term="kl")``."""

    def __init__(self, out_dir: str, *, reduce: str = "per-token", cp_layout: str = "zigzag", tp: int = 1,
                 pp: int = 1, cp: int = 1, dp: int | None = None, strict: bool = True,
                 steps: Iterable[int] | None = None, rank: int | None = None,
                 world_size: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None,
                 cp_rank: int | None = None, dp_rank: int | None = None,
                 terms: Mapping[str, Any] | None = None, trainer: str | None = None,
                 declared_scales: Mapping[str, float] | None = None, loss_site: str | None = None):
        check_reduce(reduce)
        #: metadata ``declared_scales`` (``{"loss_scale": 0.5}``: constants the trainer applies to its main
        #: loss) and ``loss_site`` (where the trainer computes it): audit's diagnosis names them
        self.declared_scales = check_declared_scales(declared_scales)
        self.loss_site = loss_site
        #: written as metadata ``trainer``: audit lists the presets of that trainer first (hf, trl, megatron...)
        self.trainer = trainer
        self.terms = check_terms(terms, reduce)
        if cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be one of {', '.join(CP_LAYOUTS)}; got {cp_layout!r}")
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        found_rank, found_world = _rank_and_world()
        self.rank = int(found_rank if rank is None else rank)
        self.world_size = int(found_world if world_size is None else world_size)
        mp = tp * pp * cp
        if dp is None:
            if self.world_size % mp:
                raise ValueError(f"world size {self.world_size} is not a multiple of tp*pp*cp = {mp}")
            dp = self.world_size // mp
        if mp * dp != self.world_size:
            raise ValueError(f"tp*pp*cp*dp = {mp * dp} != world size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.world_size})")
        self.out_dir = out_dir
        self.reduce, self.cp_layout, self.strict = reduce, cp_layout, strict
        self.tp, self.pp, self.cp, self.dp = int(tp), int(pp), int(cp), int(dp)
        coords = coordinates(self.rank, tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp)
        for name, given in (("tp_rank", tp_rank), ("pp_rank", pp_rank), ("cp_rank", cp_rank), ("dp_rank", dp_rank)):
            if given is not None:
                coords[name] = int(given)
        self.tp_rank, self.pp_rank = coords["tp_rank"], coords["pp_rank"]
        self.cp_rank, self.dp_rank = coords["cp_rank"], coords["dp_rank"]
        self.steps = None if steps is None else frozenset(int(s) for s in steps)

    def should_capture(self, step: int) -> bool:
        """Whether :meth:`step` of ``step`` records (``steps=None`` records every step)."""
        return self.steps is None or int(step) in self.steps

    def step(self, step: int) -> "StepRecorder | InactiveStep":
        """The recorder of optimizer step ``step`` on this rank (a context manager, see
        :class:`lossguard_capture.StepRecorder`); an :class:`InactiveStep` for a step not in ``steps``."""
        if not self.should_capture(step):
            return InactiveStep(int(step))
        return StepRecorder(self.out_dir, int(step), self.rank, self.world_size, tp=self.tp, pp=self.pp,
                            cp=self.cp, dp=self.dp, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                            cp_rank=self.cp_rank, dp_rank=self.dp_rank, cp_layout=self.cp_layout,
                            reduce=self.reduce, strict=self.strict,
                            terms={name: dict(reduce=d["reduce"], coef=float(d["coef"]), mask=d["mask"])
                                   for name, d in self.terms.items()}, trainer=self.trainer,
                            declared_scales=self.declared_scales, loss_site=self.loss_site)

    def __repr__(self) -> str:
        return (f"Capture({self.out_dir!r}, reduce={self.reduce!r}, rank={self.rank}/{self.world_size}, "
                f"tp={self.tp} pp={self.pp} cp={self.cp} dp={self.dp}, tp_rank={self.tp_rank} "
                f"pp_rank={self.pp_rank} cp_rank={self.cp_rank} dp_rank={self.dp_rank})")


class _InactiveMicroBatch:
    """Stands for a micro-batch of a step that is not recorded: every call passes its argument through."""

    index = -1
    dummy = False

    def hook(self, token_loss: Any, record_token_loss: bool = True, index: Any = None, *, term: str | None = None,
             mask: Any = None) -> Any:
        return token_loss

    def loss(self, scalar_loss: Any) -> Any:
        return scalar_loss

    def set(self, num_tokens: Any = None, sample_denoms: Any = None, *, term: str | None = None) -> None:
        return None


class InactiveStep:
    """The recorder of a step that ``Capture(steps=...)`` does not record: the same calls, no hooks, no
    file.  ``active`` is False, so a trainer can skip building the records: ``if s.active: ...``."""

    active = False
    path = None
    closed = False

    def __init__(self, step: int):
        self.step = step

    def microbatch(self, **fields: Any) -> _InactiveMicroBatch:
        return _InactiveMicroBatch()

    def finish(self, **records: Any) -> None:
        return None

    def abort(self) -> None:
        return None

    def __enter__(self) -> "InactiveStep":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> "Literal[False]":
        return False
