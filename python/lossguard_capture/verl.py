"""Audit captures of verl's OWN actor loss: ``ppo_loss`` (the loss function verl's engine calls), its policy
loss, its KL and entropy terms and ``agg_loss``, for every ``loss_agg_mode``.

    import lossguard_capture.verl
    cap = lossguard_capture.verl.attach(engine, "captures")   # the actor's engine, every rank; steps=(0,), fail_fast
    ... worker.update_actor(...)                              # verl trains as usual; cap.paths, cap.verdicts

``attach`` wraps, on this instance only, ``engine.train_batch`` (one call = one optimizer step: forward and
backward of every micro-batch, then ``optimizer_step``) and, for the duration of a captured call, the loss
function it is handed and ``engine.optimizer_step``.  Each rank writes, for each captured step ``n``, ONE
capture ``captures/step{n:06d}/step{n:06d}-rank{r:05d}.safetensors`` of the whole loss: the policy-gradient
term is its main term and, when verl's loss has them, the KL term (``use_kl_loss``) and the entropy term
(``entropy_coeff != 0``) are declared terms ``kl`` and ``entropy`` (SPEC §11); ``lossguard audit
captures/step000000`` judges every term, each relative to the main term's scale (docs/semantics.md §10).
With ``fail_fast`` (the default) rank 0 audits the audited step (``audit_step``, default the first of
``steps``) as soon as it is written, inside the wrapped ``optimizer_step`` and before verl's own, and on FAIL
every rank raises :class:`lossguard_capture.AuditFailed` from ``train_batch``: the update is not applied.
``attach`` returns the :class:`VerlAdapter` (``paths``, ``results``, ``verdicts``: lossguard_capture.adapter,
as every adapter).  Without an engine: :meth:`VerlAdapter.wrap` the loss function and call
:meth:`VerlAdapter.begin_step` / :meth:`VerlAdapter.finish_step` around one optimizer step (fail fast audits in
``finish_step``).

What is measured, and where (verl 0.9.1; line numbers of that release):

* The engine (``verl/workers/engine/fsdp/transformer_impl.py``) ``forward_backward_batch`` (:724) counts
  ``batch_num_tokens = data["loss_mask"].sum()`` all-reduced over the DP group (:730-734), stores
  ``dp_size`` (:735), splits the mini-batch into micro-batches (:737) and, for each, calls
  ``loss_function(model_output=..., data=micro_batch, dp_group=...)`` (``forward_step``, :1576) and
  ``loss.backward()`` (:767).  The trainer sets ``global_batch_size = ppo_mini_batch_size * rollout.n``
  (``trainer/ppo/v1/trainer_base.py``:1829-1851, ``trainer/ppo/ray_trainer.py``:1352-1362): every sample
  of the mini-batch, with or without a token that carries loss.
* The loss function is ``verl/workers/utils/losses.py`` ``ppo_loss`` (:57): it copies ``dp_size``,
  ``batch_num_tokens``, ``global_batch_size`` and ``loss_scale_factor`` into ``config.global_batch_info``
  (:65-68), pads the response fields of the micro-batch (``to_padded_tensor``, :91: nested fields to the
  micro-batch's longest response), calls the policy loss ``get_policy_loss_fn(loss_mode)`` (:103-112),
  which aggregates its per-token losses with ``core_algos.agg_loss(..., loss_agg_mode,
  **config.global_batch_info)`` (``trainer/ppo/core_algos.py``:1140); when the engine computed an entropy
  (``calculate_entropy``, which the trainers set when ``entropy_coeff != 0``: ``ray_trainer.py``:1336-1338,
  ``v1/trainer_base.py``:1831-1833) it subtracts ``entropy_coeff * agg_loss(entropy, ..., loss_agg_mode,
  **global_batch_info)`` (:123-129), and with ``use_kl_loss`` adds ``kl_loss_coef * agg_loss(kl_penalty(...),
  ..., config.loss_agg_mode, **global_batch_info)`` (:132-140).
* For the duration of the wrapped call ``core_algos.agg_loss``, ``losses.agg_loss``,
  ``losses.get_policy_loss_fn``, ``losses.kl_penalty`` and ``losses.no_padding_2_padding`` are wrappers:
  each calls the real function with the same arguments and returns its result unchanged; the per-token
  loss matrix the policy loss hands ``agg_loss`` gets a backward hook (the main term), and so do the KL
  matrix ``kl_penalty`` returned (term ``kl``) and the padded entropy matrix (term ``entropy``) when they
  reach ``agg_loss``, over the same owned tokens in the same order.  Nothing in verl's computation changes,
  so the loss and the gradients are bit for bit verl's, and the hook sees ``dL/dl_t`` after everything
  verl does: ``/ batch_num_tokens * dp_size`` (token-mean), ``* dp_size`` (token-sum),
  ``/ global_batch_size * dp_size`` (the seq-mean modes), ``/ loss_scale_factor`` or ``/ loss_mask.shape[-1]``
  (seq-mean-token-sum-norm), and modes a policy loss forces (``sapo``: seq-mean-token-mean,
  core_algos.py:1688-1689).
* ``geo_mean`` (GMPO, core_algos.py:1928) calls no ``agg_loss``: it takes ``torch.mean`` over the
  micro-batch's per-sample losses ``L_i = -A_i * exp(sum_t m_t k_t / (m_i + 1e-8))`` (:2000).  The
  per-sample gradient ``dL/dL_i`` is measured (a hook on the tensor ``torch.mean`` receives) and written
  per token as ``dL/dL_i * m_t / (m_i + 1e-8)``, the weight of the token's term ``-A_i sg(rho_i) k_t`` in
  GMPO's gradient; ``token_loss`` is not written (its loss is not a weighted sum of per-token losses),
  so ``audit``'s loss check is not run for it.
* FSDP averages gradients over the DP group (the reason for verl's ``* dp_size``): ``grad_scale = 1/dp``,
  for every term.  The terms are declared with the capture's ``reduce``, mask ``loss`` (verl aggregates
  them with the policy's ``response_mask``) and the coefficient with which they enter the loss:
  ``kl`` ``kl_loss_coef`` (losses.py:140), ``entropy`` ``-entropy_coeff`` (:128 subtracts it).  A term whose
  coefficient is 0 contributes no gradient and is not recorded (``use_kl_loss`` with ``kl_loss_coef = 0``
  warns).  ``mb.{k}.loss`` is the whole scalar verl backpropagates (every term).
* ``num_tokens_reduced`` is ``batch_num_tokens``, ``global_batch_size`` the trainer's; no per-micro-batch
  count is written (verl computes none).

The releases in :data:`SUPPORTED` (``SPEC.verified``: 0.8.0, 0.9.0, 0.9.1; the tests run on each) are
measured the same way; what differs from 0.9.1 (line numbers of the release named):

* ``losses.ppo_loss`` (:57) is the same code in 0.9.0 and 0.8.0 (0.8.0's ``losses.py`` differs only in the
  critic's ``value_loss``).  The engine's ``forward_backward_batch`` is 0.9.0 :700 (count :706-711,
  ``loss.backward()`` :738) and 0.8.0 :617 (:622-627, :649); the loss call in ``forward_step`` 0.9.0 :1534,
  0.8.0 :1280.  0.8.0's engine has no ``no_sync`` gradient-sync context (each micro-batch's backward
  reduces at once: the same gradient) and no grad-scaler branch.
* ``token-sum`` exists from 0.9.0 (core_algos.py:1176-1180).  0.8.0's ``agg_loss`` (core_algos.py:1138)
  raises for it (:1197) and its ``ActorConfig.__post_init__`` rejects it (workers/config/actor.py:219):
  :data:`LOSS_AGG_MODES` has no ``token-sum`` there, and the adapter refuses it with that reason.
* ``gspo`` forces ``seq-mean-token-mean`` up to 0.9.0 (0.9.0 core_algos.py:1604-1605, 0.8.0 :1597-1598);
  from 0.9.1 it passes the configured mode (:1605-1606).  ``sapo`` forces it in every release (0.9.0
  :1687-1688, 0.8.0 :1680-1681).  :data:`FORCED_MODES` is the installed release's table
  (:func:`forced_modes`); the adapter measures what the policy loss hands ``agg_loss`` either way.
* ``geo_mean``'s ``torch.mean`` is 0.9.0 :1999, 0.8.0 :1992.  ``dro`` is a policy loss from 0.9.0 on
  (``PolicyLossConfig.dro_beta``, 0.9.0 workers/config/actor.py:102); 0.8.0 has neither.

The objective claimed (``reduce``) is the one the configured ``loss_agg_mode`` names (:data:`CLAIMS`;
``token-sum``, which lossguard has no objective for, claims ``per-token``: its weights are the per-token
ones times ``N``).  A policy loss that aggregates with another mode than the configured one (``sapo``;
``gspo`` up to 0.9.0: :data:`FORCED_MODES`), or none (``geo_mean``), is measured as it is and a
:class:`lossguard_capture.CaptureWarning` says so (citing the release's line when :data:`FORCED_MODES` knows
it); the KL and entropy terms always aggregate with the configured mode (losses.py:125, :137).

Sample layout: sample ``i`` of a micro-batch is its prompt (``P_i`` tokens) and response (``R_i``): the
no-padding layout verl's engine trains on (``input_ids`` nested ``[P_i + R_i]``; ``prompts``/``responses``
nested, or padded with an ``attention_mask``, as ``workers/utils/padding.py`` ``no_padding_2_padding``
reads them, :97-141); response index ``j`` is the loss matrix's column ``j``; its mask is
``response_mask[i, j]``.  Sample indices: ``attach`` numbers each DP rank's mini-batch
``dp_rank * n_local + position`` (the key :data:`SAMPLE_INDEX_KEY`, carried through verl's micro-batching).

Refused, with the reason: verl outside :data:`SUPPORTED` (0.7.x: another data contract, see ``SPEC.refused``;
``allow_unsupported=True`` only warns), ``token-sum`` on a release without it (0.8.x), a loss
function other than ``losses.ppo_loss``, an engine other than the FSDP one, Ulysses sequence parallelism,
a world that is not the DP group, a grad scaler (fp16), an unknown ``loss_agg_mode`` (before anything is
recorded), a policy loss that calls ``agg_loss`` more than once or aggregates neither through ``agg_loss``
nor a per-sample ``torch.mean``, an entropy present in some micro-batches of a step and not in others.
"""

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .adapter import Adapter, CannotMeasure, Spec, deprecated_alias, make_attach
from .recorder import CaptureWarning, MicroBatch, StepRecorder

__all__ = ["attach", "VerlAdapter", "VerlCapture", "SPEC", "SUPPORTED", "LOSS_AGG_MODES", "CLAIMS", "FORCED_MODES",
           "SAMPLE_INDEX_KEY", "TERMS", "check_version", "check_loss_agg_mode", "loss_agg_modes", "forced_modes"]

#: verl versions whose loss path this adapter was checked against: [low, high); ``SPEC.verified`` the releases
#: its tests ran on (tests/trainers/test_verl.py, on each).  0.7.x is refused: its ``ppo_loss`` hands the
#: policy loss an unpadded micro-batch (0.7.1 workers/utils/losses.py:97 has no ``to_padded_tensor``) and its
#: ``no_padding_2_padding`` always reads ``attention_mask`` (workers/utils/padding.py:86-125), another data
#: contract than the one measured here.
SPEC = Spec("lossguard_capture.verl", "verl", ("0.8.0", "0.9.2"), lambda: verl.__version__,
            "it hooks losses.ppo_loss, core_algos.agg_loss and the FSDP engine's train_batch as these releases have "
            "them", verified=("0.8.0", "0.9.0", "0.9.1"),
            refused=(("0", "0.8.0", "before 0.8 ppo_loss does not pad the micro-batch (0.7.1 "
                                    "workers/utils/losses.py:97) and no_padding_2_padding always reads attention_mask "
                                    "(0.7.1 workers/utils/padding.py:86-125): another data contract than the one the "
                                    "adapter measures; nearest supported: 0.8.0"),),
            loss_site="verl workers/utils/losses.py ppo_loss (core_algos.agg_loss)")
SUPPORTED, check_version = SPEC.supported, SPEC.check_version       # the range; the gate (adapter.Spec)
verl: Any = SPEC.require("verl", "scripts/setup-trainers.sh pins verl==0.9.1 in ~/.cache/lossguard/venv-verl")
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.utils import losses as verl_losses  # noqa: E402

#: every mode ``core_algos.agg_loss`` knows in 0.9.1 (core_algos.py:1170-1204; also ``ActorConfig.__post_init__``,
#: workers/config/actor.py:212-220) and the lossguard objective each mode's name and docstring claim.
_ALL_CLAIMS: dict[str, str] = {
    "token-mean": "token-mean",
    "token-sum": "per-token",                 # "the sum over all valid tokens": no lossguard objective; per-token x N
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
}

#: (release, where its core_algos.py has what): the line numbers messages cite, for each release the adapter
#: was checked against (a release between two of them: the older one's).
_SITES: tuple[tuple[tuple[int, ...], dict[str, str]], ...] = (
    ((0, 9, 1), {"release": "0.9.1", "agg_loss": "1140", "sapo": "1688-1689"}),
    ((0, 9, 0), {"release": "0.9.0", "agg_loss": "1140", "sapo": "1687-1688", "gspo": "1604-1605"}),
    ((0, 8, 0), {"release": "0.8.0", "agg_loss": "1138", "sapo": "1680-1681", "gspo": "1597-1598"}),
)
#: the first release whose agg_loss knows ``token-sum`` (0.9.0 core_algos.py:1176-1180)
TOKEN_SUM_SINCE = "0.9.0"
#: the first release whose gspo policy loss aggregates with the configured mode (0.9.1 core_algos.py:1605-1606)
GSPO_CONFIGURED_SINCE = "0.9.1"


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version  # a dependency of verl
    return Version(version).release


def _sites(version: str) -> dict[str, str]:
    rel = _release(version)
    return next((sites for r, sites in _SITES if rel >= r), _SITES[-1][1])


def loss_agg_modes(version: str) -> tuple[str, ...]:
    """The modes verl ``version``'s ``core_algos.agg_loss`` knows: ``token-sum`` only from 0.9.0 on (0.8.0's
    agg_loss, core_algos.py:1138-1197, raises for it; its ActorConfig rejects it, workers/config/actor.py:219)."""
    return tuple(m for m in _ALL_CLAIMS if m != "token-sum" or _release(version) >= _release(TOKEN_SUM_SINCE))


def forced_modes(version: str) -> dict[str, str]:
    """{policy loss: the mode it hands ``agg_loss`` whatever ``loss_agg_mode`` is configured} in verl
    ``version``: ``sapo`` seq-mean-token-mean in every supported release, ``gspo`` too up to 0.9.0 (0.9.0
    core_algos.py:1604-1605, 0.8.0 :1597-1598; 0.9.1 passes the configured mode, :1605-1606).  ``geo_mean``
    aggregates with no mode (a per-sample ``torch.mean``) and is not listed."""
    out = {"sapo": "seq-mean-token-mean"}
    if _release(version) < _release(GSPO_CONFIGURED_SINCE):
        out["gspo"] = "seq-mean-token-mean"
    return out


#: the modes the installed verl's ``core_algos.agg_loss`` knows (:func:`loss_agg_modes`).
LOSS_AGG_MODES: tuple[str, ...] = loss_agg_modes(verl.__version__)

#: the lossguard objective each of :data:`LOSS_AGG_MODES` claims (``reduce`` of the captures).
CLAIMS: dict[str, str] = {m: _ALL_CLAIMS[m] for m in LOSS_AGG_MODES}

#: the installed verl's policy losses that aggregate with a fixed mode (:func:`forced_modes`).
FORCED_MODES: dict[str, str] = forced_modes(verl.__version__)

#: the declared terms besides the main (policy-gradient) one: the KL loss (``use_kl_loss``) and the entropy
#: bonus (``entropy_coeff != 0``).
TERMS: tuple[str, ...] = ("kl", "entropy")

#: the per-sample key :func:`attach` adds to the mini-batch (global sample indices for the captures).
SAMPLE_INDEX_KEY = "lossguard_sample_index"


def check_loss_agg_mode(mode: Any) -> str:
    """``mode`` if the installed verl's ``core_algos.agg_loss`` knows it, else ValueError naming the modes
    (and, for ``token-sum`` below 0.9.0, the release that added it)."""
    if mode not in LOSS_AGG_MODES:
        sites = _sites(verl.__version__)
        why = ""
        if mode == "token-sum":
            why = (f"token-sum exists from verl {TOKEN_SUM_SINCE} on; verl {verl.__version__}'s agg_loss raises "
                   f"for it and its ActorConfig rejects it (0.8.0 core_algos.py:1197, workers/config/actor.py:219); ")
        raise ValueError(f"lossguard_capture.verl: unknown loss_agg_mode {mode!r}: {why}verl {verl.__version__}'s "
                         f"agg_loss (verl/trainer/ppo/core_algos.py:{sites['agg_loss']} in {sites['release']}) knows "
                         f"{', '.join(LOSS_AGG_MODES)}; nothing was recorded")
    return mode


def _underlying(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _nt(data: Any, key: str, default: Any = None) -> Any:
    """A non-tensor entry of a verl TensorDict (``tensordict_utils.get_non_tensor_data``)."""
    from verl.utils import tensordict_utils as tu
    return tu.get_non_tensor_data(data=data, key=key, default=default)


class _Layout:
    """The samples of one micro-batch as the captures need them (see the module docstring)."""

    def __init__(self, data: Any, first_index: int):
        ids = data["input_ids"]
        if not getattr(ids, "is_nested", False):
            raise CannotMeasure("lossguard_capture.verl: the micro-batch's input_ids are not nested: only verl's "
                               "no-padding layout (pad_mode no_padding, as the PPO trainers hand the engine) is "
                               "supported")
        prompts, responses = data["prompts"], data["responses"]
        if prompts.is_nested:               # as no_padding_2_padding (workers/utils/padding.py:115-119)
            P = prompts.offsets().diff()
            R = responses.offsets().diff()
        else:                               # padded prompts/responses with an attention mask (:121-125)
            am = data["attention_mask"]
            P = am[:, : prompts.shape[1]].sum(dim=1)
            R = am[:, prompts.shape[1]:].sum(dim=1)
        T = ids.offsets().diff()
        P, R, T = P.to(torch.int64).cpu(), R.to(torch.int64).cpu(), T.to(torch.int64).cpu()
        if not torch.equal(P + R, T):
            raise CannotMeasure(f"lossguard_capture.verl: prompt + response lengths {(P + R).tolist()} != the "
                               f"input_ids lengths {T.tolist()}")
        self.n = int(T.numel())
        self.P, self.R, self.T = P, R, T
        self.tokens = ids.values()
        rm = data["response_mask"]
        if rm.is_nested:
            lens = rm.offsets().diff().to(torch.int64).cpu()
            if not torch.equal(lens, R):
                raise CannotMeasure(f"lossguard_capture.verl: response_mask lengths {lens.tolist()} != the response "
                                   f"lengths {R.tolist()}")
            masks = rm.values()
        else:
            width = rm.shape[1]
            if self.n and int(R.max()) > width:
                raise CannotMeasure(f"lossguard_capture.verl: a response of {int(R.max())} tokens in a response_mask "
                                   f"of width {width}")
            inside = torch.arange(width)[None, :] < R[:, None]
            if bool((rm.cpu()[~inside] != 0).any()):
                raise CannotMeasure("lossguard_capture.verl: response_mask is set beyond a response's end")
            masks = rm[inside.to(rm.device)]
        self.masks = (masks != 0).to(torch.int64)
        idx = data.get(SAMPLE_INDEX_KEY, None) if hasattr(data, "get") else None
        if idx is not None:
            self.sample_indices = idx.detach().to(torch.int64).reshape(-1).cpu()
            if self.sample_indices.numel() != self.n:
                raise CannotMeasure(f"lossguard_capture.verl: {SAMPLE_INDEX_KEY} holds {self.sample_indices.numel()} "
                                   f"indices for {self.n} samples")
        else:
            self.sample_indices = torch.arange(first_index, first_index + self.n, dtype=torch.int64)
        self._index: dict[int, torch.Tensor] = {}

    def owned_index(self, loss_mat: torch.Tensor) -> torch.Tensor:
        """The owned tokens of a ``[n, W]`` loss matrix in local order (per sample, response indices ascending)."""
        if loss_mat.dim() != 2 or loss_mat.shape[0] != self.n:
            raise CannotMeasure(f"lossguard_capture.verl: a per-token loss matrix of shape {tuple(loss_mat.shape)} for "
                               f"{self.n} samples")
        W = int(loss_mat.shape[1])
        if self.n and int(self.R.max()) > W:
            raise CannotMeasure(f"lossguard_capture.verl: a loss matrix of width {W} for a response of "
                               f"{int(self.R.max())} tokens")
        if W not in self._index:
            cols = torch.arange(W, dtype=torch.int64)
            flat = torch.arange(self.n, dtype=torch.int64)[:, None] * W + cols[None, :]
            self._index[W] = flat[cols[None, :] < self.R[:, None]]
        return self._index[W].to(loss_mat.device)

    def fields(self) -> dict[str, Any]:
        return dict(sample_indices=self.sample_indices, tokens=self.tokens, total_lengths=self.T,
                    response_lengths=self.R, loss_masks=self.masks, cp_size=1)


class _GeoProbe:
    """geo_mean: the measured per-sample gradient dL/dL_i, written per token through a probe tensor."""

    def __init__(self, mb: MicroBatch, per_sample: torch.Tensor, layout: _Layout):
        self.grads: list[torch.Tensor] = []
        self.handle = per_sample.register_hook(self._keep)
        self.layout = layout
        owned = int(layout.R.sum())
        self.probe = torch.zeros(owned, dtype=per_sample.dtype, device=per_sample.device, requires_grad=True)
        self.dtype, self.device = per_sample.dtype, per_sample.device
        mb.hook(self.probe, record_token_loss=False)

    def _keep(self, grad: torch.Tensor) -> None:
        self.grads.append(grad.detach())

    def fire(self) -> None:
        """Hand the probe its weights: g_i * m_t / (m_i + 1e-8), computed as geo_mean computes the
        denominator (core_algos.py:1983-1984: an integer mask sum + 1e-8 in the default float dtype)."""
        self.handle.remove()
        lay = self.layout
        g = torch.zeros(lay.n, dtype=self.dtype, device=self.device)
        for x in self.grads:
            g = g + x
        row = torch.repeat_interleave(torch.arange(lay.n), lay.R).to(self.device)
        m = lay.masks.to(self.device)
        m_sum = torch.zeros(lay.n, dtype=torch.int64, device=self.device).index_add_(0, row, m)
        den = (m_sum + 1e-8).to(self.dtype)
        coeff = g[row] * m.to(self.dtype) / den[row]
        with torch.enable_grad():
            self.probe.backward(coeff)

    def remove(self) -> None:
        self.handle.remove()


class _Call:
    """The state of one wrapped loss-function call (one micro-batch)."""

    def __init__(self, layout: _Layout, mb: MicroBatch, loss_mode: str, mode: str):
        self.layout = layout
        self.mb = mb
        self.loss_mode = loss_mode
        self.mode = mode
        self.in_pg = 0
        self.pg_modes: list[str] = []
        self.hooked: set = set()                         # the named terms hooked in this micro-batch
        self.kld: torch.Tensor | None = None          # what kl_penalty returned
        self.ent: torch.Tensor | None = None          # the padded entropy matrix
        self.means: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pg_return: torch.Tensor | None = None


class _OpenStep:
    def __init__(self, step: int, dp: int, dp_rank: int, rank: int, world: int,
                 global_batch_size: int | None):
        self.step, self.dp, self.dp_rank, self.rank, self.world = step, dp, dp_rank, rank, world
        self.global_batch_size = global_batch_size
        self.rec: StepRecorder | None = None
        self.terms: dict[str, dict[str, Any]] = {}       # the declared terms: name -> reduce, coef, mask
        self.reduce: str | None = None
        self.batch_num_tokens: Any = None
        self.geo: list[_GeoProbe] = []
        self.next_index = 0
        self.warned: set = set()


class VerlAdapter(Adapter):
    """Captures ``steps`` of verl's actor loss (``losses.ppo_loss``) for ``lossguard audit``; made by
    :func:`attach`.

    ``steps`` are the optimizer steps counted per engine from 0 (one ``train_batch`` call = one step).
    ``reduce``: the objective claimed, instead of :data:`CLAIMS` of the configured ``loss_agg_mode`` (the
    declared terms claim it too).  ``kl`` / ``entropy``: record the KL term (``use_kl_loss``) / the entropy
    term (``entropy_coeff != 0``) as declared terms.  The other options (``steps``, ``fail_fast``, ...) and
    the results (``paths``, ``results``, ``verdicts``) are :class:`lossguard_capture.adapter.Adapter`'s."""

    spec = SPEC

    def __init__(self, out_dir: str, *, reduce: str | None = None, kl: bool = True, entropy: bool = True,
                 **options: Any):
        super().__init__(out_dir, reduce=reduce, **options)
        self.kl = bool(kl)
        self.entropy = bool(entropy)
        self._open: _OpenStep | None = None
        self._calls = 0

    # -- wiring ---------------------------------------------------------------------------------
    def _attach(self, engine: Any, /, **where: Any) -> None:
        """Wrap ``engine.train_batch`` (instance attribute; the class is untouched): a captured call numbers its
        samples, opens the step, wraps the loss function it is handed and ``engine.optimizer_step``, whose
        wrapper writes the capture (and, fail fast, audits it) before verl's optimizer step."""
        _check_engine(engine)
        cap = self
        orig_train_batch = engine.train_batch

        def train_batch(data: Any, loss_function: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            n = cap._calls
            cap._calls += 1
            if not cap.should_capture(n):
                return orig_train_batch(data, loss_function, *args, **kw)
            dp, dp_rank = int(engine.get_data_parallel_size()), int(engine.get_data_parallel_rank())
            local = len(data)
            if SAMPLE_INDEX_KEY in data.keys():
                raise RuntimeError(f"lossguard_capture.verl: the mini-batch already holds {SAMPLE_INDEX_KEY!r}")
            dev = data["input_ids"].device if "input_ids" in data.keys() else torch.device("cpu")
            first = dp_rank * local
            data[SAMPLE_INDEX_KEY] = torch.arange(first, first + local, dtype=torch.int64, device=dev)
            try:
                cap.begin_step(n, dp=dp, dp_rank=dp_rank, global_batch_size=_nt(data, "global_batch_size", None))
            except CannotMeasure as e:
                cap._drop(e, n)
            orig_step = engine.optimizer_step

            def optimizer_step(*a: Any, **k: Any) -> Any:
                if cap._open is not None:
                    try:
                        cap.finish_step(grad_scale=1.0 / dp)      # FSDP's mean over the DP group; fail fast here
                    except CannotMeasure as e:
                        cap._drop(e, n)
                return orig_step(*a, **k)
            engine.optimizer_step = optimizer_step
            try:
                return orig_train_batch(data, cap.wrap(loss_function), *args, **kw)
            except BaseException:
                cap.abort_step()
                raise
            finally:
                if engine.__dict__.get("optimizer_step") is optimizer_step:
                    del engine.optimizer_step
                if SAMPLE_INDEX_KEY in data.keys():
                    del data[SAMPLE_INDEX_KEY]
                if cap._open is not None:          # optimizer_step never came: nothing is written
                    cap.abort_step()

        engine.train_batch = train_batch
        engine.lossguard_capture = cap

    def _describe(self) -> str:
        return f"reduce={self.reduce or 'the loss_agg_mode claim'}; kl={self.kl}, entropy={self.entropy}"

    # -- steps ----------------------------------------------------------------------------------
    def begin_step(self, step: int, *, dp: int, dp_rank: int, global_batch_size: int | None = None,
                   rank: int | None = None, world_size: int | None = None) -> None:
        """Open optimizer step ``step`` on this rank: the wrapped loss function records into it until
        :meth:`finish_step` or :meth:`abort_step`."""
        if self._open is not None:
            raise RuntimeError(f"lossguard_capture.verl: step {self._open.step} is still open")
        if rank is None or world_size is None:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                rank, world_size = dist.get_rank(), dist.get_world_size()
            else:
                rank, world_size = 0, 1
        if int(world_size) != int(dp):
            raise CannotMeasure(f"lossguard_capture.verl: world size {world_size} != DP size {dp}: only data "
                               f"parallelism (FSDP without Ulysses sequence parallelism) is supported")
        if not 0 <= int(dp_rank) < int(dp):
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp})")
        self._open = _OpenStep(int(step), int(dp), int(dp_rank), int(rank), int(world_size),
                               None if global_batch_size is None else int(global_batch_size))

    def abort_step(self) -> None:
        """Drop the open step: every hook removed, nothing written."""
        st, self._open = self._open, None
        if st is None:
            return
        for g in st.geo:
            g.remove()
        if st.rec is not None:
            st.rec.abort()

    def finish_step(self, *, grad_scale: float, skipped: Any = None, grad_norm: Any = None) -> str:
        """Write the open step's capture (after every micro-batch's backward, before the optimizer applies
        the step) and return its path; ``grad_scale``: what the rank multiplies its gradients by (``1/dp``
        under FSDP; every term's).  Fail fast: the audited step is audited here (AuditFailed on FAIL)."""
        st = self._open
        if st is None:
            raise RuntimeError("lossguard_capture.verl: no step is open")

        def finish() -> str:
            if st.rec is None:
                raise CannotMeasure(f"lossguard_capture.verl: step {st.step}: the wrapped loss function was never "
                                    f"called")
            for g in st.geo:
                g.fire()
            out = st.rec.finish(grad_scale=float(grad_scale), num_tokens_reduced=st.batch_num_tokens,
                                skipped=skipped, grad_norm=grad_norm, global_batch_size=st.global_batch_size)
            self._open = None
            return out
        return self.write_step(st.step, finish, self.abort_step)

    # -- the loss function ----------------------------------------------------------------------
    def wrap(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` (``losses.ppo_loss`` or a ``functools.partial`` of it, as the actor worker sets it)
        measured while a step is open; passed through unchanged otherwise."""
        if _underlying(loss_fn) is not verl_losses.ppo_loss:
            msg = (f"lossguard_capture.verl measures verl.workers.utils.losses.ppo_loss (the actor's loss); got "
                   f"{getattr(_underlying(loss_fn), '__qualname__', loss_fn)!r}")
            if not self.allow_unsupported:
                raise RuntimeError(msg)
            warnings.warn(msg, CaptureWarning, stacklevel=2)
        sig = inspect.signature(loss_fn)
        cap = self

        @functools.wraps(_underlying(loss_fn))
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if cap._open is None:
                return loss_fn(*args, **kwargs)
            step = cap._open.step
            try:
                return cap._measure(loss_fn, sig, args, kwargs)
            except CannotMeasure as e:
                cap._drop(e, step)                   # raises where fail fast audits this step
                return e.output if e.output is not None else loss_fn(*args, **kwargs)
            except BaseException:
                cap.abort_step()
                raise
        wrapped.__lossguard_wrapped__ = loss_fn     # type: ignore[attr-defined]
        return wrapped

    def _recorder(self, st: _OpenStep, cfg: Any, mode: str, entropy: bool) -> StepRecorder:
        """The step's recorder, made at its first micro-batch with the terms verl's loss has: ``kl``
        (``use_kl_loss``, coefficient ``kl_loss_coef``, losses.py:140) and ``entropy`` (an entropy in the
        model output and ``entropy_coeff != 0``: ``policy_loss -= entropy_coeff * entropy_loss``, :128)."""
        if st.rec is not None:
            return st.rec
        st.reduce = self.reduce or CLAIMS[mode]
        if self.kl and bool(getattr(cfg, "use_kl_loss", False)):
            coef = float(cfg.kl_loss_coef)
            if coef == 0.0:
                warnings.warn("lossguard_capture.verl: use_kl_loss with kl_loss_coef = 0: the KL term carries no "
                              "gradient and is not recorded", CaptureWarning, stacklevel=2)
            else:
                st.terms["kl"] = dict(reduce=st.reduce, coef=coef, mask="loss")
        if entropy:
            st.terms["entropy"] = dict(reduce=st.reduce, coef=-float(cfg.entropy_coeff), mask="loss")
        st.rec = self.recorder(st.step, rank=st.rank, world_size=st.world, dp=st.dp, dp_rank=st.dp_rank,
                               reduce=st.reduce, terms=st.terms)
        return st.rec

    def _warn_once(self, st: _OpenStep, key: str, msg: str) -> None:
        if key not in st.warned:
            st.warned.add(key)
            warnings.warn(msg, CaptureWarning, stacklevel=3)

    def _measure(self, loss_fn: Callable[..., Any], sig: inspect.Signature, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        """One micro-batch of an open step: verl's loss function called with its aggregation wrapped (the
        module docstring's "What is measured"), then refused if a term could not be measured."""
        st = self._open
        assert st is not None
        cfg, data, model_output = _loss_arguments(loss_fn, args, kwargs)
        call, ent_in = self._open_call(st, cfg, data, model_output)
        out = _call_patched(_patches(st, call, ent_in), loss_fn, args, kwargs)
        loss, _metrics = out
        try:
            self._check_call(st, call)
        except CannotMeasure as e:
            e.output = out           # verl's own result: the run goes on with it
            raise
        call.mb.loss(loss)           # the whole scalar the engine backpropagates: every term
        return out

    def _drop(self, e: CannotMeasure, step: int) -> None:
        """Step ``step`` cannot be measured (``e``): dropped; the error stops the run only where fail fast
        audits that step (:meth:`Adapter.stops_at`), else a warning and verl goes on unmeasured."""
        self.abort_step()
        if self.stops_at(step):
            raise e
        self.say_unmeasured(str(e))

    def _open_call(self, st: _OpenStep, cfg: Any, data: Any, model_output: Any) -> tuple[_Call, Any]:
        """The micro-batch's recorder handle and call state (the step's recorder made at its first), and the
        entropy the model output holds (None: none)."""
        mode = check_loss_agg_mode(getattr(cfg, "loss_agg_mode", None))
        pl = cfg.policy_loss
        loss_mode = pl.get("loss_mode", "vanilla") if hasattr(pl, "get") else getattr(pl, "loss_mode", "vanilla")
        st.batch_num_tokens = _nt(data, "batch_num_tokens", None)
        if st.global_batch_size is None:
            st.global_batch_size = _nt(data, "global_batch_size", None)
        # without SAMPLE_INDEX_KEY (no attach): the rank's samples in call order, after the lower ranks'
        per_rank = st.global_batch_size // st.dp if st.global_batch_size else 1 << 20
        layout = _Layout(data, st.dp_rank * per_rank + st.next_index)
        # ppo_loss takes the entropy term when the model output holds one (losses.py:60-62, :123)
        ent_in = model_output.get("entropy", None) if hasattr(model_output, "get") else None
        with_entropy = self.entropy and ent_in is not None and float(getattr(cfg, "entropy_coeff", 0.0) or 0.0) != 0.0
        first = st.rec is None
        rec = self._recorder(st, cfg, mode, with_entropy)
        if not first and with_entropy != ("entropy" in st.terms):
            raise CannotMeasure(f"lossguard_capture.verl: step {st.step}: the model output holds an entropy in some "
                               f"micro-batches and not in others (calculate_entropy changed within the step)")
        st.next_index += layout.n
        mb = rec.microbatch(**layout.fields())
        return _Call(layout, mb, loss_mode, mode), ent_in

    def _check_call(self, st: _OpenStep, call: _Call) -> None:
        """RuntimeError when the call's terms did not reach agg_loss as measured (a policy loss that
        aggregates per sample is measured per sample, and says so once a step)."""
        loss_mode, mode, layout = call.loss_mode, call.mode, call.layout
        problems = []
        if len(call.pg_modes) > 1:
            problems.append(f"the policy loss {loss_mode!r} called agg_loss {len(call.pg_modes)} times")
        elif not call.pg_modes:
            geo = [(a, o) for a, o in call.means if o is call.pg_return and a.dim() == 1 and a.shape[0] == layout.n
                   and a.requires_grad]
            if len(geo) == 1:
                st.geo.append(_GeoProbe(call.mb, geo[0][0], layout))
                self._warn_once(st, "geo", f"lossguard_capture.verl: the policy loss {loss_mode!r} aggregates no "
                                f"per-token losses (a torch.mean over the micro-batch's per-sample losses, "
                                f"core_algos.py:2000); its loss_agg_mode {mode!r} is not used: measured per sample "
                                f"and written per token as dL/dL_i * m_t / m_i")
            else:
                problems.append(f"the policy loss {loss_mode!r} aggregated its per-token losses neither through "
                                f"core_algos.agg_loss nor a per-sample torch.mean")
        elif call.pg_modes[0] != mode:
            sites = _sites(verl.__version__)
            where = (f" (verl {verl.__version__} forces it: core_algos.py:{sites[loss_mode]} in {sites['release']})"
                     if FORCED_MODES.get(loss_mode) == call.pg_modes[0] and loss_mode in sites else "")
            self._warn_once(st, "mode", f"lossguard_capture.verl: the policy loss {loss_mode!r} aggregates with "
                            f"{call.pg_modes[0]!r} although loss_agg_mode = {mode!r}{where}: the captures claim "
                            f"{st.reduce!r} and measure what verl does")
        if "kl" in st.terms and "kl" not in call.hooked:
            problems.append("use_kl_loss is set but no KL matrix reached agg_loss")
        if "entropy" in st.terms and "entropy" not in call.hooked:
            problems.append("the model output holds an entropy but it did not reach agg_loss")
        if problems:
            raise CannotMeasure("lossguard_capture.verl: cannot measure verl's loss: " + "; ".join(problems))


def _loss_arguments(loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The call's ``config``, ``data`` and ``model_output``, bound through every functools.partial layer:
    partial(ppo_loss, config) fixes config POSITIONALLY (as a user may write it; verl's worker passes
    config=), and the call gives model_output=, data=."""
    fn: Any = loss_fn
    full_args, full_kwargs = tuple(args), dict(kwargs)
    while isinstance(fn, functools.partial):
        fn, full_args, full_kwargs = fn.func, tuple(fn.args) + full_args, {**fn.keywords, **full_kwargs}
    bound = inspect.signature(fn).bind(*full_args, **full_kwargs)
    bound.apply_defaults()
    cfg, data = bound.arguments.get("config"), bound.arguments.get("data")
    if cfg is None or data is None:
        raise CannotMeasure("lossguard_capture.verl: the loss function was called without config or data: verl "
                           "calls it as loss_fn(model_output=..., data=micro_batch) after partial(ppo_loss, "
                           "config=...) (verl 0.9.1 workers/engine_workers.py:643; "
                           "ppo_loss(config, model_output, data, dp_group))")
    return cfg, data, bound.arguments.get("model_output")


def _patches(st: _OpenStep, call: _Call, ent_in: Any) -> list[tuple[Any, str, Callable[..., Any]]]:
    """(module, name, wrapper) for each verl function wrapped during one loss-function call: each calls the
    real one and returns its result unchanged, hooking the matrices that reach agg_loss on the way."""
    mb, layout = call.mb, call.layout
    real_agg, real_core_agg = verl_losses.agg_loss, core_algos.agg_loss
    real_get, real_kl, real_mean = verl_losses.get_policy_loss_fn, verl_losses.kl_penalty, torch.mean
    real_pad = verl_losses.no_padding_2_padding
    if real_core_agg is not real_agg:
        raise CannotMeasure("lossguard_capture.verl: core_algos.agg_loss and losses.agg_loss differ (patched by "
                           "someone else?)")
    agg_sig = inspect.signature(real_agg)

    def agg_loss(*a: Any, **k: Any) -> Any:
        b = agg_sig.bind(*a, **k)
        b.apply_defaults()
        m = b.arguments["loss_agg_mode"]
        check_loss_agg_mode(m)
        out = real_agg(*a, **k)
        loss_mat = b.arguments["loss_mat"]
        if call.in_pg:
            call.pg_modes.append(m)
            if len(call.pg_modes) == 1:
                mb.hook(loss_mat, index=layout.owned_index(loss_mat))
        else:
            for term, mat in (("kl", call.kld), ("entropy", call.ent)):
                if mat is not None and loss_mat is mat and term in st.terms and term not in call.hooked:
                    mb.hook(loss_mat, index=layout.owned_index(loss_mat), term=term)
                    call.hooked.add(term)
        return out

    def kl_penalty(*a: Any, **k: Any) -> Any:
        out = real_kl(*a, **k)
        call.kld = out
        return out

    def no_padding_2_padding(*a: Any, **k: Any) -> Any:
        out = real_pad(*a, **k)
        src = a[0] if a else k.get("tensor")
        if ent_in is not None and src is ent_in:
            call.ent = out
        return out

    def mean(*a: Any, **k: Any) -> Any:
        out = real_mean(*a, **k)
        if a and isinstance(a[0], torch.Tensor) and not k and len(a) == 1:
            call.means.append((a[0], out))
        return out

    def get_policy_loss_fn(name: Any) -> Any:
        fn = real_get(name)

        @functools.wraps(fn)
        def policy_loss(*a: Any, **k: Any) -> Any:
            call.in_pg += 1
            torch.mean = mean
            try:
                res = fn(*a, **k)
                call.pg_return = res[0]
                return res
            finally:
                torch.mean = real_mean
                call.in_pg -= 1
        return policy_loss

    return [(verl_losses, "agg_loss", agg_loss), (core_algos, "agg_loss", agg_loss),
            (verl_losses, "get_policy_loss_fn", get_policy_loss_fn), (verl_losses, "kl_penalty", kl_penalty),
            (verl_losses, "no_padding_2_padding", no_padding_2_padding)]


def _call_patched(patched: list[tuple[Any, str, Callable[..., Any]]], loss_fn: Callable[..., Any],
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``loss_fn(*args, **kwargs)`` with each (module, name) of ``patched`` set to its wrapper for the call and
    the real one back after it (and torch.mean, which the policy loss's wrapper sets while it runs);
    RuntimeError when someone else replaced a wrapper meanwhile."""
    real = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]
    real_mean = torch.mean
    for mod, name, fn in patched:
        setattr(mod, name, fn)
    try:
        out = loss_fn(*args, **kwargs)
    finally:
        replaced = [f"{mod.__name__}.{name}" for mod, name, fn in patched if getattr(mod, name) is not fn]
        for mod, name, fn in real:
            setattr(mod, name, fn)
        torch.mean = real_mean
    if replaced:
        raise CannotMeasure(f"lossguard_capture.verl: {', '.join(replaced)} replaced by someone else during the "
                           f"loss function")
    return out


attach = make_attach(VerlAdapter, """
    Capture ``steps`` of the actor's loss on ``engine`` (a verl FSDP engine; every rank) into
    ``out_dir/step{n:06d}/``; with ``fail_fast`` a FAIL of the audited step raises AuditFailed from
    ``train_batch`` before the optimizer applies it.  ``options``: :class:`VerlAdapter`'s.  Returns the adapter:
    ``paths``, ``results``, ``verdicts``.""")


#: The first lower-level entry: every step, no fail fast.
VerlCapture = deprecated_alias(VerlAdapter, "VerlCapture", "lossguard_capture.verl.attach(engine, out_dir, ...) or "
                               "VerlAdapter(out_dir, ...)", steps=None, fail_fast=False)


def _check_engine(engine: Any) -> None:
    bad = []
    mod = type(engine).__module__
    if not mod.startswith("verl.workers.engine.fsdp") and not any(
            c.__module__.startswith("verl.workers.engine.fsdp") for c in type(engine).__mro__):
        bad.append(f"engine {type(engine).__qualname__} ({mod}): only verl's FSDP engine "
                   f"(verl/workers/engine/fsdp/transformer_impl.py) is verified")
    if int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1) > 1:
        bad.append(f"Ulysses sequence parallelism (size {engine.ulysses_sequence_parallel_size})")
    if getattr(engine, "scaler", None) is not None:
        bad.append("a grad scaler (fp16): the hooks would see the scaled loss")
    for name in ("train_batch", "forward_backward_batch", "optimizer_step", "get_data_parallel_size",
                 "get_data_parallel_rank"):
        if not hasattr(engine, name):
            bad.append(f"no engine.{name}")
    if bad:
        raise RuntimeError("lossguard_capture.verl does not support: " + "; ".join(bad))
