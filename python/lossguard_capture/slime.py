"""An audited slime run, switched on by slime's own plug-in flags: no edit to slime's source.

    LOSSGUARD_OUT=captures LOSSGUARD_STEPS=0 python train.py ...  \\
        --custom-megatron-init-path lossguard_capture.slime.init \\
        --custom-megatron-before-train-step-hook-path lossguard_capture.slime.before_train_step

slime loads both by dotted path (``slime.utils.misc.load_function``): the init hook once Megatron has
initialised (slime/backends/megatron_utils/initialize.py, the end of ``init``), the step hook at every train
step with ``(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)``, after the gradients are
zeroed and before ``forward_backward_func`` (slime/backends/megatron_utils/model.py ``train_one_step``).

What it hooks, by name, in slime's own modules (read at THUDM/slime 624b824, main: loss.py, model.py, data.py,
cp_utils.py; the DataIterator's contiguous ``micro_batch_size`` window at 1c81073, before 2f4bd0d (#1926) left it
only ``micro_batch_indices``; the names and signatures are checked at init and a slime without them is refused,
naming the attach point):

* ``model.get_batch`` — the micro-batch's samples by their global index: the rollout's ``partition`` (the
  global positions of this DP rank's samples) at the iterator's ``micro_batch_indices`` (or its contiguous
  window); without ``partition``, the rollout's ``sample_indices`` (its samples' own indices: a strided DP split
  named right); without either, ``dp_rank x local samples + local index`` (right for a contiguous split only).
* ``model.loss_function(args, batch, num_microbatches, step_global_batch_size, logits)`` (or the older one
  without ``step_global_batch_size``: then ``args.global_batch_size``) — wrapped by the Megatron adapter's
  :meth:`~lossguard_capture.megatron.MegatronAdapter.packed_loss_func` with the micro-batch's packed samples
  (``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ``loss_masks``; the packed ``tokens`` are
  checked against them), ``rollout_mask_sums`` as ``sample_denoms`` (sample-mean), and the step's
  ``global_batch_size`` as slime counts it (rollouts).
* ``loss.get_sum_of_sample_mean`` — the reducer factory slime's loss module calls itself: the reducers it
  returns hand lossguard the per-token tensor they reduce and then reduce it unchanged (slime's own math,
  with its ``rollout_mask_sums``: a reducer installed through ``--custom-pg-loss-reducer-function-path``
  would get no ``rollout_mask_sums`` and change it). In ``policy_loss_function`` the first reduction of a
  micro-batch is the policy loss (also through a custom reducer, whose factory ``load_function`` returns is
  wrapped the same way); the entropy (the tensor ``get_log_probs_and_entropy`` returned, concatenated) is
  term ``entropy`` with coefficient ``-entropy_coef``; ``compute_approx_kl``'s output is term ``kl`` with
  ``kl_loss_coef`` (``--use-kl-loss``). ``sft_loss``: the per-token loss is ``-log_probs``. A
  ``custom_loss`` hands its per-token losses over itself: :func:`per_token`.
* the step: :func:`lossguard_capture.megatron.attach` on the model chunks, the optimizer (its step and, fail
  fast, ``step_with_ready_grads``) and the LR scheduler at the first train step, ``finalize_model_grads_func``
  re-wrapped at every step (slime's ``train`` sets it anew each rollout); a step opens in the step hook and
  closes at the next ``zero_grad_buffer`` (slime releases the gradients after the scheduler).

The step number is slime's ``train/step``: ``rollout_id x steps per rollout + step_id`` (steps per rollout:
``args.num_steps_per_rollout``, else ``rollout_batch_size x n_samples_per_prompt // global_batch_size``).

Settings: ``LOSSGUARD_OUT`` (default ``lossguard-captures``), ``LOSSGUARD_STEPS`` (``0``; a comma list, or
``all``), ``LOSSGUARD_FAIL_FAST`` (``1``; ``0`` only records), ``LOSSGUARD_BIN`` (the binary) — each from the
process's environment, else from slime's own ``--train-env-vars`` JSON (the one way a variable reaches slime's
Ray actors: ``--train-env-vars '{"LOSSGUARD_OUT": "/data/captures", "LOSSGUARD_BIN": "/opt/bin/lossguard"}'``),
checked by the init hook before the first rollout (lossguard_capture.launch: the folder writable, the binary
runnable on rank 0); ``LOSSGUARD_CHAIN_INIT`` / ``LOSSGUARD_CHAIN_BEFORE_TRAIN_STEP`` (your own hooks' dotted
paths, called after lossguard's: slime has one flag each). From your own init hook call :func:`install`
instead.
"""

import atexit
import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from . import launch as _launch
from . import megatron as _lcm
from .adapter import Spec, say

__all__ = ["init", "before_train_step", "install", "per_token", "SlimeAdapter", "Trainer", "SLIME", "current"]


class Trainer:
    """What differs between the trainers of slime's shape (slime, Relax): the modules whose names are hooked,
    the commits they were read at, and what a micro-batch adds (Relax: CP size, dummy)."""

    def __init__(self, name: str, model_module: str, loss_module: str, commits: str, *,
                 index_keys: Sequence[str], denoms_key: str,
                 micro_batch: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 sft_loss_types: Sequence[str] = ("sft_loss",),
                 refusals: Callable[[Any], list[str]] | None = None):
        self.name, self.model_module, self.loss_module, self.commits = name, model_module, loss_module, commits
        self.index_keys, self.denoms_key = tuple(index_keys), denoms_key   # rollout keys: global indices; d_i
        self.micro_batch = micro_batch or (lambda batch: {})
        #: the --loss-type names whose loss is -sum_of_sample_mean(log_probs) (slime "sft_loss", Relax "sft")
        self.sft_loss_types = tuple(sft_loss_types)
        #: what this trainer runs that the adapter does not measure, refused at init naming the flag
        self.refusals = refusals or (lambda args: [])
        self._adapter_class: type[_lcm.MegatronAdapter] | None = None

    @property
    def adapter_class(self) -> type[_lcm.MegatronAdapter]:
        """The Megatron adapter under this trainer's plug-in points: its ``spec`` names the trainer (the captures
        say ``trainer: NAME``) and its loss function (audit's advice)."""
        if self._adapter_class is None:
            name = f"{self.name.capitalize()}Adapter"
            self._adapter_class = type(name, (_lcm.MegatronAdapter,), {
                "spec": _spec(self), "__module__": f"lossguard_capture.{self.name}", "__qualname__": name,
                "__doc__": f"The Megatron adapter under {self.name}'s plug-in points (its captures say "
                           f"``trainer: {self.name}``)."})
        return self._adapter_class


SLIME = Trainer("slime", "slime.backends.megatron_utils.model", "slime.backends.megatron_utils.loss",
                "THUDM/slime main @624b824: loss.py, model.py, data.py, cp_utils.py",
                index_keys=("partition", "sample_indices"), denoms_key="rollout_mask_sums")


def _spec(trainer: Trainer) -> Spec:
    s = _lcm.SPEC
    return Spec(f"lossguard_capture.{trainer.name}", s.package, s.supported, s.installed, s.relies_on,
                loss_site=f"{trainer.loss_module}.loss_function")


SlimeAdapter = SLIME.adapter_class


class _Terms:
    """The running micro-batch's reductions: which per-token tensors are the loss's terms."""

    def __init__(self, loss_type: str):
        self.loss_type = loss_type
        self.first = True
        self.entropy: list[torch.Tensor] | None = None
        self.kl: torch.Tensor | None = None


def _params(f: Any) -> list[str]:
    try:
        return list(inspect.signature(f).parameters)
    except (TypeError, ValueError):
        return []


class SlimeAudit:
    """One per process, made by :func:`install` (the init hook) for a trainer of slime's shape (``trainer``: its
    :class:`Trainer` record, slime's or Relax's): patches the names of the module docstring and owns the Megatron
    adapter (``.megatron``, the trainer's ``adapter_class``, made at the first train step: ``paths``,
    ``results``, ``verdicts``)."""

    def __init__(self, trainer: Trainer, args: Any, out_dir: str, steps: Sequence[int] | None = (0,),
                 fail_fast: bool = True, **options: Any):
        self.trainer, self.args, self.out_dir = trainer, args, out_dir
        self.steps, self.fail_fast, self.options = steps, fail_fast, options
        self.model_mod: Any = importlib.import_module(trainer.model_module)
        self.loss_mod: Any = importlib.import_module(trainer.loss_module)
        self._check_attach_points()
        self._check_config(args)
        self.loss_type = str(getattr(args, "loss_type", "policy_loss"))
        self.per_token_loss = bool(getattr(args, "calculate_per_token_loss", False))
        self.reduce = "per-token" if self.per_token_loss else "sample-mean"
        self.terms: dict[str, dict[str, Any]] = {}
        if self.loss_type == "policy_loss":
            if float(getattr(args, "entropy_coef", 0.0) or 0.0) != 0.0:
                self.terms["entropy"] = dict(reduce=self.reduce, coef=-float(args.entropy_coef))
            if getattr(args, "use_kl_loss", False) and float(getattr(args, "kl_loss_coef", 0.0) or 0.0) != 0.0:
                self.terms["kl"] = dict(reduce=self.reduce, coef=float(args.kl_loss_coef))
        self.megatron: _lcm.MegatronAdapter | None = None
        self._source: torch.Tensor | None = None  # what a mask-safe reducer was handed (before its torch.where)
        self.step_ctx: Any = None
        self.indices: dict[int, list[int] | None] = {}
        self.mb: _Terms | None = None
        self.calls = 0
        self._skipped_role: str | None = None
        self._patch()
        atexit.register(self.close)

    # -- the names it relies on ---------------------------------------------------------------------
    def _check_attach_points(self) -> None:
        m, l = self.model_mod, self.loss_mod
        want = [(m, "loss_function", ("args", "batch", "num_microbatches")),
                (m, "get_batch", ("data_iterator", "keys")),
                (l, "get_sum_of_sample_mean", ("total_lengths", "response_lengths", "loss_masks")),
                (l, "policy_loss_function", ("args", "batch", "logits", "sum_of_sample_mean")),
                (l, "get_log_probs_and_entropy", ("logits",)), (l, "compute_approx_kl", ()), (l, "load_function", ())]
        missing = []
        for mod, name, lead in want:
            f = getattr(mod, name, None)
            if f is None:
                missing.append(f"{mod.__name__}.{name} is missing")
            elif lead and _params(f)[:len(lead)] != list(lead):
                missing.append(f"{mod.__name__}.{name}{tuple(_params(f))} does not start with {lead}")
        lf = _params(getattr(m, "loss_function", None))
        if lf and "logits" not in lf:
            missing.append(f"{m.__name__}.loss_function{tuple(lf)} takes no logits")
        if missing:
            raise RuntimeError(f"lossguard_capture.{self.trainer.name}: this {self.trainer.name} lacks the "
                               f"attach points the adapter was built against ({self.trainer.commits}): "
                               + "; ".join(missing))
        self.has_step_gbs = "step_global_batch_size" in lf

    def _check_config(self, args: Any) -> None:
        """What the adapter does not measure, refused at init naming the flag (nothing is patched)."""
        bad = []
        # --qkv-format {thd,bshd}: slime v0.2.2 .. v0.3.0 (added by 2fe5d82, #1285; removed from main by 7703751,
        # #2100 "Remove bshd support", so main's args have no qkv_format) and Relax, which shares this check. Their
        # bshd micro-batch is padded [B, S] rows without PackedSeqParams, which the adapter does not place.
        if getattr(args, "qkv_format", "thd") != "thd":
            bad.append(f"--qkv-format {args.qkv_format} (a flag of slime v0.2.2 to v0.3.0 and of Relax; the adapter "
                       "places packed thd micro-batches)")
        if getattr(args, "allgather_cp", False) and int(getattr(args, "context_parallel_size", 1) or 1) > 1:
            bad.append("--allgather-cp (a contiguous CP split; the adapter places slime's zig-zag one)")
        if getattr(args, "enable_mtp_training", False):
            bad.append("--enable-mtp-training (the MTP loss is not handed to the reducers)")
        bad += self.trainer.refusals(args)
        if bad:
            raise RuntimeError(f"lossguard_capture.{self.trainer.name} does not measure: " + "; ".join(bad))

    # -- patches (module attributes; slime looks them up at call time) --------------------------------
    def _patch(self) -> None:
        m, l, audit = self.model_mod, self.loss_mod, self
        orig_get_batch, orig_loss, orig_factory = m.get_batch, m.loss_function, l.get_sum_of_sample_mean
        orig_lpe, orig_kl, orig_load = l.get_log_probs_and_entropy, l.compute_approx_kl, l.load_function

        def get_batch(data_iterator: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
            local = audit._local_indices(data_iterator)
            batch = orig_get_batch(data_iterator, keys, *args, **kwargs)
            if audit._open() and local is not None and isinstance(batch, dict):
                audit.indices[id(batch)] = audit._global_indices(data_iterator, local, batch)
            return batch

        def loss_function(args: Any, batch: Any, num_microbatches: Any, *rest: Any, **kwargs: Any) -> Any:
            return audit._loss_function(orig_loss, args, batch, num_microbatches, *rest, **kwargs)

        def get_sum_of_sample_mean(*args: Any, **kwargs: Any) -> Any:
            return audit._reducer(orig_factory(*args, **kwargs))

        def get_log_probs_and_entropy(*args: Any, **kwargs: Any) -> Any:
            out = orig_lpe(*args, **kwargs)
            # ``(empty, {"log_probs", "entropy"})`` since slime 0bcde26 (#1506, 2026-01-28); the dict itself
            # before it (e.g. 4d837ff .. f9f00b2, tests/trainers/test_slime_history.py)
            res = out[1] if isinstance(out, tuple) and len(out) == 2 else out
            if audit.mb is not None and isinstance(res, dict):
                ent = res.get("entropy")
                audit.mb.entropy = list(ent) if isinstance(ent, (list, tuple)) else None
            return out

        def compute_approx_kl(*args: Any, **kwargs: Any) -> Any:
            out = orig_kl(*args, **kwargs)
            if audit.mb is not None:
                audit.mb.kl = out
            return out

        def load_function(path: Any, *args: Any, **kwargs: Any) -> Any:
            f = orig_load(path, *args, **kwargs)
            if path is not None and path == getattr(audit.args, "custom_pg_loss_reducer_function_path", None):
                def factory(*fa: Any, **fk: Any) -> Any:
                    return audit._reducer(f(*fa, **fk))
                return factory
            return f

        self.metrics_close = hasattr(m, "normalize_reduced_loss_metrics")
        if self.metrics_close:        # Relax: the step's reduced metrics (SPEC §6), on the last stage, after the update
            orig_norm = m.normalize_reduced_loss_metrics

            def normalize_reduced_loss_metrics(keys: Any, values: Any, *args: Any, **kwargs: Any) -> Any:
                st = None if audit.megatron is None else audit.megatron._state
                if st is not None and not st.written:
                    st.metrics = (torch.tensor([float(v) for v in values], dtype=torch.float64), list(keys))
                try:
                    return orig_norm(keys, values, *args, **kwargs)
                finally:
                    if audit.step_ctx is not None:
                        audit.close()
            normalize_reduced_loss_metrics.__wrapped__ = orig_norm      # type: ignore[attr-defined]
            m.normalize_reduced_loss_metrics = normalize_reduced_loss_metrics
        self._patch_mask_safe_reducer(l)
        wrappers: tuple[tuple[Any, str, Callable[..., Any], Any], ...] = (
            (m, "get_batch", get_batch, orig_get_batch),
            (m, "loss_function", loss_function, orig_loss),
            (l, "get_sum_of_sample_mean", get_sum_of_sample_mean, orig_factory),
            (l, "get_log_probs_and_entropy", get_log_probs_and_entropy, orig_lpe),
            (l, "compute_approx_kl", compute_approx_kl, orig_kl),
            (l, "load_function", load_function, orig_load))
        for mod, name, new, old in wrappers:
            new.__wrapped__ = old           # type: ignore[attr-defined]
            setattr(mod, name, new)

    def _patch_mask_safe_reducer(self, l: Any) -> None:
        """Relax's token-global estimators (reinforce_plus_plus*) wrap each reducer in one that reduces
        torch.where(mask, x, 0) (Relax loss.py:810-827 @36882ca): remember x for _term's recognition."""
        orig_msr = getattr(l, "_get_reinforce_plus_plus_mask_safe_reducer", None)
        if orig_msr is None:
            return
        audit = self

        def mask_safe_reducer(reducer: Any, loss_masks: Any, *args: Any, **kwargs: Any) -> Any:
            safe = orig_msr(reducer, loss_masks, *args, **kwargs)

            def reduce(values: Any, *ra: Any, **rk: Any) -> Any:
                audit._source = values if isinstance(values, torch.Tensor) else None
                try:
                    return safe(values, *ra, **rk)
                finally:
                    audit._source = None
            return reduce
        mask_safe_reducer.__wrapped__ = orig_msr    # type: ignore[attr-defined]
        l._get_reinforce_plus_plus_mask_safe_reducer = mask_safe_reducer

    @staticmethod
    def _local_indices(it: Any) -> list[int] | None:
        """The rollout-local indices of the micro-batch ``it.get_next`` is about to return (slime's DataIterator:
        ``micro_batch_indices[offset]``, or ``offset .. offset + micro_batch_size``)."""
        offset = getattr(it, "offset", None)
        if offset is None:
            return None
        mbi = getattr(it, "micro_batch_indices", None)
        if mbi is not None:
            return [int(i) for i in mbi[offset]] if offset < len(mbi) else None
        size = getattr(it, "micro_batch_size", None)
        return None if size is None else list(range(int(offset), int(offset) + int(size)))

    def _global_indices(self, it: Any, local: list[int], batch: dict[str, Any]) -> list[int] | None:
        """The global indices of the samples ``batch`` holds, in its order: the micro-batch's rows (``local``)
        mapped through the rollout's index key, matched to ``unconcat_tokens`` by identity or value (a dynamic-
        CP sub-group keeps a subset of the rows, Relax's ``dynamic_cp_split_data``); None when they do not
        match (then the micro-batch is refused)."""
        rd = getattr(it, "rollout_data", None) or {}
        key = next((k for k in self.trainer.index_keys if rd.get(k) is not None), None)
        if key is not None:
            glob = [int(rd[key][i]) for i in local]
        else:
            from megatron.core import parallel_state as ps
            n = len(rd.get("total_lengths") or ())
            glob = [ps.get_data_parallel_rank() * n + int(i) for i in local]
        toks = rd.get("tokens")
        held = batch.get("unconcat_tokens")
        if toks is None or held is None:
            return glob if held is None or len(held) == len(glob) else None
        cands = [(g, toks[i]) for g, i in zip(glob, local, strict=True)]
        out: list[int] = []
        for t in held:
            hit = next((k for k, (_, c) in enumerate(cands) if c is t), None)
            if hit is None:
                hit = next((k for k, (_, c) in enumerate(cands)
                            if isinstance(c, torch.Tensor) and isinstance(t, torch.Tensor)
                            and c.shape == t.shape and bool(torch.equal(c.detach().cpu(), t.detach().cpu()))), None)
            if hit is None:
                return None
            out.append(cands.pop(hit)[0])
        return out

    def _open(self) -> bool:
        return self.megatron is not None and self.megatron._state is not None

    def _loss_function(self, orig: Any, args: Any, batch: Any, num_microbatches: Any, *rest: Any, **kwargs: Any) -> Any:
        meg = self.megatron
        st = None if meg is None else meg._state
        logits = rest[-1] if rest else kwargs.get("logits")
        if meg is None or st is None or not rest or not isinstance(logits, torch.Tensor) or not logits.requires_grad:
            return orig(args, batch, num_microbatches, *rest, **kwargs)
        try:
            wrapped = self._measured_loss(meg, st, orig, args, batch, num_microbatches, *rest, **kwargs)
        except _lcm._Unmeasured as e:     # not the step fail fast audits: a warning, the trainer's own loss
            meg._dropped(e)
            return orig(args, batch, num_microbatches, *rest, **kwargs)
        self.mb = _Terms(self.loss_type)
        try:
            return wrapped(rest[-1] if rest else kwargs.get("logits"))
        finally:
            self.mb = None

    def _measured_loss(self, meg: Any, st: Any, orig: Any, args: Any, batch: Any, num_microbatches: Any, *rest: Any,
                       **kwargs: Any) -> Any:
        """The micro-batch's loss function measured through the Megatron adapter (meg._fail where it cannot be)."""
        gbs = (rest[0] if self.has_step_gbs and len(rest) == 2
               else batch.get("dynamic_global_batch_size") or getattr(args, "global_batch_size", None))
        if gbs is not None:
            gbs = int(gbs)
            if st.global_batch_size is None:
                st.global_batch_size = gbs
                st.global_batch_unit = "rollouts"       # slime's step_global_batch_size, Relax's sample indices
            elif st.global_batch_size != gbs:
                meg._fail(st, f"step_global_batch_size {gbs} in one micro-batch, {st.global_batch_size} in another")
        indices = self.indices.pop(id(batch), None)
        if indices is None:
            meg._fail(st, f"{self.trainer.name}'s loss_function received a batch whose samples are unknown (the "
                          f"wrapped get_batch did not return it, or its unconcat_tokens are not the rows its "
                          f"iterator gave)")
        if getattr(args, "qkv_format", "thd") != "thd":
            meg._fail(st, f"qkv_format {args.qkv_format!r}: the adapter reads slime's packed (thd) micro-batches only")
        denoms = None
        given = batch.get(self.trainer.denoms_key)
        if not self.per_token_loss and given is not None and len(given):
            denoms = torch.stack([torch.as_tensor(d, dtype=torch.float64).reshape(()).cpu() for d in given])
        fn = partial(orig, args, batch, num_microbatches, *rest[:-1], **kwargs)      # Relax: lm_head_forward=
        extra = self.trainer.micro_batch(batch)
        masks = list(batch["loss_masks"])
        if extra.get("dummy"):      # a padding micro-batch (Relax repeats a real partition): it trains nothing
            masks = [torch.zeros_like(torch.as_tensor(m)) for m in masks]
        return meg.packed_loss_func(fn, sample_indices=indices, tokens=list(batch["unconcat_tokens"]),
                                    total_lengths=list(batch["total_lengths"]),
                                    response_lengths=list(batch["response_lengths"]), loss_masks=masks,
                                    sample_denoms=denoms, stream_tokens=batch.get("tokens"), **extra)

    def _reducer(self, reducer: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        audit = self

        def reduce(x: Any, *args: Any, **kwargs: Any) -> Any:
            return reducer(audit._term(x), *args, **kwargs)
        reduce.__wrapped__ = reducer        # type: ignore[attr-defined]
        return reduce

    def _term(self, x: Any) -> Any:
        """Hand the per-token tensor ``x`` a reducer is about to reduce to lossguard when it is a term of the loss
        (module docstring), and return what the reducer reduces (the same values)."""
        mb, meg = self.mb, self.megatron
        if mb is None or meg is None or not isinstance(x, torch.Tensor):
            return x
        # A detached tensor is a metric, except the first reduction when it is empty: before 0bcde26 slime builds
        # the log-probs of a sample with no token on this CP rank as ``logits.new_zeros((0,))`` (no grad;
        # slime/utils/ppo_utils.py:579 @f9f00b2), so a micro-batch whose samples all lie elsewhere reduces an
        # empty, detached policy loss (and adds ``0 * logits.sum()``, loss.py:511-512): its loss all the same (0 tokens)
        if not x.requires_grad and not (mb.first and x.numel() == 0):
            return x
        if mb.first:
            mb.first = False
            if mb.loss_type == "policy_loss":
                return meg.per_token(x)
            if mb.loss_type in self.trainer.sft_loss_types:    # loss = -sum_of_sample_mean(log_probs): -log p_t
                return -meg.per_token(-x)
            return x
        # under a mask-safe reducer (Relax's token-global estimators) the reducer sees torch.where(mask, x, 0):
        # the term is recognised by the tensor handed to the mask-safe reducer, the reduced copy is measured
        src = x if self._source is None else self._source
        if "kl" in self.terms and mb.kl is not None and src is mb.kl:
            return meg.per_token(x, term="kl")
        if "entropy" in self.terms and mb.entropy is not None and self._is_entropy(src, mb.entropy):
            mb.entropy = None
            return meg.per_token(x, term="entropy")
        return x

    @staticmethod
    def _is_entropy(x: torch.Tensor, parts: list[torch.Tensor]) -> bool:
        if x.dim() != 1 or x.numel() != sum(int(p.numel()) for p in parts):
            return False
        return bool(torch.equal(x.detach(), torch.cat([p.detach().reshape(-1) for p in parts]))) if parts else True

    # -- steps ----------------------------------------------------------------------------------------
    def step_number(self, args: Any, rollout_id: int, step_id: int) -> int:
        per = getattr(args, "num_steps_per_rollout", None)
        if not per:
            try:
                per = args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
            except (AttributeError, TypeError, ZeroDivisionError):
                per = None
        return int(rollout_id) * int(per) + int(step_id) if per else self.calls - 1

    def before_train_step(self, args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                          opt_param_scheduler: Any) -> None:
        self.calls += 1
        self._abandon()
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        role = getattr(chunks[0], "role", "actor")
        if role != "actor" or self.loss_type in ("value_loss",):
            if self._skipped_role is None and _main():
                say(f"lossguard_capture.{self.trainer.name}: not auditing the {role} ({self.loss_type})")
            self._skipped_role = role
            return
        from megatron.core.utils import get_model_config
        config = get_model_config(chunks[0])
        if self.megatron is None:
            self.megatron = self.trainer.adapter_class(self.out_dir, steps=self.steps, fail_fast=self.fail_fast,
                                                       reduce=self.reduce, terms=self.terms or None, **self.options)
            self.megatron.attach(config, model=chunks, optimizer=optimizer, scheduler=opt_param_scheduler)
            for chunk in chunks:
                self._wrap_zero_grad(chunk)
        else:
            self.megatron.wrap_finalize(config)
        self.indices.clear()
        n = self.step_number(args, rollout_id, step_id)
        ctx = self.megatron.step(n)
        if ctx.active:
            ctx.__enter__()
            self.step_ctx = ctx

    def _wrap_zero_grad(self, chunk: Any) -> None:
        orig, audit = chunk.zero_grad_buffer, self

        def zero_grad_buffer(*args: Any, **kwargs: Any) -> Any:
            meg = audit.megatron
            st = None if meg is None else meg._state
            if audit.step_ctx is not None and meg is not None and st is not None and st.finalized and not (
                    audit.metrics_close and meg.last_stage):      # there: at the metrics, just after
                audit.close()
            return orig(*args, **kwargs)
        zero_grad_buffer.__wrapped__ = orig       # type: ignore[attr-defined]
        chunk.zero_grad_buffer = zero_grad_buffer

    def _abandon(self) -> None:
        """A step still open at the next step hook never reached finalize_model_grads (it raised): dropped."""
        ctx, self.step_ctx = self.step_ctx, None
        if ctx is not None:
            ctx.__exit__(RuntimeError, RuntimeError("abandoned"), None)

    def close(self) -> None:
        """Close the open step: written (and, fail fast, audited: AuditFailed raises here) once its gradients
        were finalized; a step that never reached finalize_model_grads (it raised) is dropped."""
        st = None if self.megatron is None else self.megatron._state
        if st is not None and not st.finalized:
            self._abandon()
            return
        ctx, self.step_ctx = self.step_ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)


def _main() -> bool:
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0


_AUDIT: SlimeAudit | None = None


def current() -> SlimeAudit | None:
    """The process's audit (None before :func:`install`)."""
    return _AUDIT


def install(args: Any, out_dir: str | None = None, *, steps: Any = "env", fail_fast: bool | None = None,
            trainer: Trainer = SLIME, **options: Any) -> SlimeAudit:
    """Switch the audit on in this process (what the init hook does; call it from your own init hook instead).
    ``out_dir`` / ``steps`` / ``fail_fast`` default to the environment (module docstring); ``options``: the
    Megatron adapter's (``lossguard_bin``, ``timeout``, ``audit_args``...)."""
    global _AUDIT
    if _AUDIT is not None:
        return _AUDIT
    # each setting from this process's environment, else slime's own --train-env-vars (what reaches its Ray
    # actors), else the default; checked here, before the first rollout (lossguard_capture.launch)
    found = _launch.settings(args)
    out_dir = out_dir or found.out_dir
    if steps == "env":
        steps = found.steps
    if fail_fast is None:
        fail_fast = found.fail_fast
    if "lossguard_bin" not in options and found.lossguard_bin:
        options["lossguard_bin"] = found.lossguard_bin
    _launch.check(_launch.Settings(out_dir, steps, fail_fast, options.get("lossguard_bin"), found.source),
                  auditing_rank=_main(), who=f"lossguard_capture.{trainer.name}.init")
    _AUDIT = SlimeAudit(trainer, args, out_dir, steps=steps, fail_fast=fail_fast, **options)
    if _main():
        say(f"lossguard_capture.{trainer.name}: auditing train steps {'all' if steps is None else list(steps)} into "
            f"{out_dir} ({_AUDIT.reduce}; terms {sorted(_AUDIT.terms) or 'none'}; "
            f"{'fail fast' if fail_fast else 'record only'})")
    return _AUDIT


def _chain(var: str, *args: Any) -> None:
    path = os.environ.get(var)
    if path:
        mod, _, name = path.rpartition(".")
        getattr(importlib.import_module(mod), name)(*args)


def init(args: Any) -> None:
    """``--custom-megatron-init-path lossguard_capture.slime.init``."""
    install(args)
    _chain("LOSSGUARD_CHAIN_INIT", args)


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                      opt_param_scheduler: Any, *, trainer: Trainer = SLIME) -> None:
    """``--custom-megatron-before-train-step-hook-path lossguard_capture.slime.before_train_step``."""
    if _AUDIT is None:
        name = trainer.name
        raise RuntimeError(f"lossguard_capture.{name}.before_train_step: the audit is not installed (add "
                           f"--custom-megatron-init-path lossguard_capture.{name}.init, or call "
                           f"lossguard_capture.{name}.install(args) from your own init hook)")
    _AUDIT.before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)
    _chain("LOSSGUARD_CHAIN_BEFORE_TRAIN_STEP", args, rollout_id, step_id, model, optimizer, opt_param_scheduler)


def per_token(t: torch.Tensor, *, term: str | None = None) -> torch.Tensor:
    """In a ``--custom-loss-function-path`` loss: hand lossguard the per-token losses (the owned response tokens
    in local order, as slime's reducers take them) before reducing them; returns ``t``."""
    a = _AUDIT
    if a is None or a.megatron is None or a.mb is None:
        return t
    a.mb.first = False
    return a.megatron.per_token(t, term=term)
