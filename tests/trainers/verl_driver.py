"""Runs verl's OWN actor update loop on CPU under several loss configurations, each twice from the same
seed: with ``lossguard_capture.verl`` attached and without it, and writes what tests/trainers/test_verl.py
compares.

    torchrun --standalone --nproc-per-node 2 tests/trainers/verl_driver.py --out DIR --configs token-mean,...

Runs on every release ``lossguard_capture.verl`` supports (0.8.0, 0.9.0, 0.9.1); what differs is chosen from
the installed verl's version (:data:`VERL`), never from the environment:

* ``token-sum`` exists from 0.9.0 on: below it the config is not in :data:`CONFIGS` (0.8.0's ActorConfig
  rejects it; test_verl.py checks that and the adapter's refusal instead).
* the CPU platform: verl 0.9.0 and later pick the device through ``verl.plugin.platform``; 0.8.0 has none and
  reads ``verl.utils.device.is_cuda_available`` / ``is_npu_available`` (utils/device.py:46-47, :80-85), which
  :func:`use_cpu` sets to False.
* what ``forward_step`` keeps of the model output (:func:`kept_output`): ``detach_tree`` from 0.9.1, each
  tensor with a grad_fn detached in 0.9.0 (transformer_impl.py:1549-1552), the output as is in 0.8.0 (:1288-1292).
* verl <= 0.9.0 imports ``flash_attn.bert_padding`` when ``left_right_2_no_padding`` runs (the ``-dense``
  configs); on a machine without flash-attn, tests/trainers/cpu_stand_ins (a pure-torch stand-in, see its
  README) is put on ``sys.path`` (:data:`CPU_STAND_IN`).

What is verl's and what is not (verl 0.9.1; the same functions in 0.9.0 and 0.8.0 at other lines):

* verl's: ``BaseEngine.train_batch`` (engine/base.py:113: zero_grad, forward_backward_batch, optimizer_step),
  ``FSDPEngine.forward_backward_batch`` (engine/fsdp/transformer_impl.py:724: ``batch_num_tokens``
  all-reduced over the DP group, ``dp_size``, ``prepare_micro_batches``, one ``loss.backward()`` per
  micro-batch), ``FSDPEngine.optimizer_step`` (:788: clip, step), ``losses.ppo_loss`` with the registered
  policy losses, ``kl_penalty``, the entropy term and ``agg_loss``, ``ActorConfig``,
  ``left_right_2_no_padding`` (the v0 trainer's layout) and the TensorDict helpers.
* a CPU stand-in (:class:`CPUEngine`): FSDPEngine's constructor builds a Hugging Face model under FSDP on
  an accelerator; here the module is a tiny embedding model and ``forward_step`` calls it directly
  (what FSDPEngineWithLMHead.forward_step does around the model, :1549-1591, is kept: the loss function
  call, the output record, and the per-token entropy when the micro-batch asks ``calculate_entropy``,
  :1336 and :1542-1543).  FSDP averages the gradients over DP during backward; the stand-in does that
  all-reduce (mean) at ``optimizer_step``, before verl's.  A CPU platform replaces verl's CUDA one.
* ``-entropy`` configs: ``entropy_coeff`` = :data:`ENT_COEF` and ``calculate_entropy`` set as the trainers
  set it (``entropy_coeff != 0``, ray_trainer.py:1336-1338).  ``-bug`` configs plant a term bug in verl's
  own functions for both runs (:func:`plant`): ``kl-microbatch-mean`` aggregates the KL matrix without
  the global batch info, each micro-batch's own token mean (the bug class of verl #7200).

Batches: 12 samples per mini-batch (DP 2 x 2 micro-batches x 3 samples; ``global_batch_size`` 12 as the
trainer sets it, ppo_mini_batch_size x n), prompts of 2-5 tokens, responses of 1-9 tokens (sample 0 of
every mini-batch 9: the step's longest), holes in some response masks and samples 4 and 9 fully masked;
2 optimizer steps (2 mini-batches), both captured.  ``-dense`` configs hand the engine the v0 trainer's
layout: responses right-padded to 12 (``rollout.response_length``) and converted by verl's
``left_right_2_no_padding``; the others the v1 trainer's nested per-sample fields (agent_loop_tq.py:184-199).
``-m3``: 3 micro-batches of 2 per rank; ``-dynbsz``: ``use_dynamic_bsz`` with 16 tokens per micro-batch
(verl's ``rearrange_micro_batches``: 4 and 5 micro-batches of 1-2 samples, counts synchronised over DP).

Per config and run (``DIR/<config>/{adapter,plain}/``): ``losses-rank{r}.pt`` (the engine's per-micro-batch
loss values, in order), ``grads-step{n}-rank{r}.pt`` (the gradients the optimizer applies),
``params-step{n}.pt`` (the parameters the step's forward used), ``batch-step{n}.pt`` (the mini-batch, global
order) and, with the adapter, ``captures/step{n:06d}/`` (one capture per rank and step: the policy term as
main, the KL and entropy terms declared).

``--fail-fast CONFIG``: only that config, with the adapter and fail_fast (``--lossguard-bin``); a rank that gets
``lossguard_capture.AuditFailed`` writes ``DIR/failfast-rank{r}.json`` (the step, exit code, text, whether the
parameters were still those of the step's start) and re-raises, so the process exits non-zero.
"""
import argparse
import functools
import json
import os
import sys
import warnings
from functools import partial
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
from importlib.metadata import version as _dist_version

from packaging.version import Version

#: the installed verl release (its distribution's metadata; checked against verl.__version__ below)
VERL = Version(_dist_version("verl"))
#: configurations and expectations that depend on the release
HAS_TOKEN_SUM = VERL.release >= (0, 9, 0)         # agg_loss's token-sum (0.9.0 core_algos.py:1176)
HAS_DRO = VERL.release >= (0, 9, 0)               # the dro policy loss and PolicyLossConfig.dro_beta
GSPO_FORCES_MODE = VERL.release < (0, 9, 1)       # gspo aggregates with seq-mean-token-mean (0.9.0 :1604-1605)
STAND_INS = os.path.join(HERE, "cpu_stand_ins")


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


#: whether tests/trainers/cpu_stand_ins is on sys.path: verl < 0.9.1 without flash-attn
CPU_STAND_IN = VERL.release < (0, 9, 1) and not _flash_attn_importable()
if CPU_STAND_IN:
    sys.path.insert(0, STAND_INS)

import torch

torch.set_num_threads(1)

import verl

assert Version(verl.__version__) == VERL, (verl.__version__, str(VERL))


def use_cpu():
    """Point verl's device helpers (get_device_id, get_device_name) at the CPU and Gloo."""
    if VERL.release >= (0, 9, 0):
        from verl.plugin.platform.platform_cuda import PlatformCUDA
        from verl.plugin.platform.platform_manager import set_platform

        class PlatformCPU(PlatformCUDA):
            @property
            def device_name(self) -> str:
                return "cpu"

            def is_available(self) -> bool:
                return True

            def current_device(self):
                return "cpu"

            def communication_backend_name(self) -> str:
                return "gloo"

        set_platform(PlatformCPU())
    else:                 # 0.8.0: no platform plugin; get_device_name reads these (utils/device.py:80-85)
        from verl.utils import device
        device.is_cuda_available = False
        device.is_npu_available = False


use_cpu()

import lossguard_capture as lc
import lossguard_capture.verl as lverl
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig, PolicyLossConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding


def kept_output(model_output):
    """What the release's ``FSDPEngineWithLMHead.forward_step`` puts in its output record of the model output:
    0.9.1 ``detach_tree`` (transformer_impl.py:1584-1586), 0.9.0 every tensor with a grad_fn detached
    (:1549-1552), 0.8.0 the model output itself (:1288-1292)."""
    if VERL.release >= (0, 9, 1):
        from verl.workers.engine.utils import detach_tree
        return detach_tree(model_output)
    if VERL.release >= (0, 9, 0):
        return {k: v.detach() if isinstance(v, torch.Tensor) and v.grad_fn is not None else v
                for k, v in model_output.items()}
    return model_output


SEED = 4321
VOCAB = 48
HIDDEN = 16
DP = 2
MICRO = 3                  # samples per micro-batch (micro_batch_size_per_gpu)
MB_PER_RANK = 2
GLOBAL_BATCH = DP * MB_PER_RANK * MICRO
STEPS = 2
R_MAX = 9                  # the longest response (sample 0 of every mini-batch)
R_PAD = 12                 # rollout.response_length of the -dense layout
MAX_TOKENS = 16            # max_token_len_per_gpu of the -dynbsz configs (use_dynamic_bsz)
EMPTY = (4, 9)             # fully masked samples (one per DP rank)
KL_COEF = 0.25
ENT_COEF = 0.05            # entropy_coeff of the -entropy configs (enters the loss as -ENT_COEF * entropy_loss)
LSF = R_MAX                # loss_scale_factor of the -lsf configs

# config name -> loss_agg_mode, policy loss, use_kl_loss, loss_scale_factor, layout, samples per micro-batch,
# use_dynamic_bsz, entropy_coeff != 0, a planted term bug
def _cfg(mode, loss="vanilla", kl=False, lsf=None, layout="nested", micro=MICRO, dynbsz=False, entropy=False,
         bug=None):
    return {"mode": mode, "loss": loss, "kl": kl, "lsf": lsf, "layout": layout, "micro": micro, "dynbsz": dynbsz,
            "entropy": entropy, "bug": bug}


CONFIGS = {
    "token-mean": _cfg("token-mean"),
    "token-mean-dense": _cfg("token-mean", layout="dense"),
    **({"token-sum": _cfg("token-sum")} if HAS_TOKEN_SUM else {}),     # 0.8.0 has no token-sum
    "seq-mean-token-sum": _cfg("seq-mean-token-sum"),
    "seq-mean-token-mean": _cfg("seq-mean-token-mean"),
    "seq-mean-token-sum-norm": _cfg("seq-mean-token-sum-norm"),
    "seq-mean-token-sum-norm-lsf": _cfg("seq-mean-token-sum-norm", lsf=LSF),
    "seq-mean-token-sum-norm-dense": _cfg("seq-mean-token-sum-norm", layout="dense"),
    "sapo-token-mean": _cfg("token-mean", loss="sapo"),
    "sapo-seq-mean-token-mean": _cfg("seq-mean-token-mean", loss="sapo"),
    # verl's own history: up to 0.9.0 gspo aggregates with seq-mean-token-mean whatever is configured (0.9.0
    # core_algos.py:1604-1605); 0.9.1 passes the configured mode (:1605-1606) — FAIL before, exact after
    "gspo-token-mean": _cfg("token-mean", loss="gspo"),
    "geo_mean": _cfg("token-mean", loss="geo_mean"),
    "geo_mean-m3": _cfg("token-mean", loss="geo_mean", micro=2),      # 3 micro-batches per rank: M != dp
    "geo_mean-dynbsz": _cfg("token-mean", loss="geo_mean", dynbsz=True),  # micro-batches of unequal sizes
    "token-mean-dynbsz": _cfg("token-mean", dynbsz=True),
    "seq-mean-token-sum-norm-dynbsz": _cfg("seq-mean-token-sum-norm", dynbsz=True),
    "token-mean-kl": _cfg("token-mean", kl=True),
    "seq-mean-token-mean-kl": _cfg("seq-mean-token-mean", kl=True),
    "token-mean-kl-entropy": _cfg("token-mean", kl=True, entropy=True),
    "seq-mean-token-mean-kl-entropy": _cfg("seq-mean-token-mean", kl=True, entropy=True),
    "token-mean-kl-bug": _cfg("token-mean", kl=True, bug="kl-microbatch-mean"),
}
BUGS = ("kl-microbatch-mean",)


class TinyLM(torch.nn.Module):
    """Per position: log-softmax of a 2-layer map of the token's embedding, read at the next token (the
    packed sequence rolled by one, as verl's no-padding log-prob computation does)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.hid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def _log_softmax(self, values: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.out(torch.tanh(self.hid(self.emb(values)))), dim=-1)

    def log_probs_flat(self, values: torch.Tensor) -> torch.Tensor:
        return self._log_softmax(values).gather(-1, torch.roll(values, -1)[:, None])[:, 0]

    def entropy_flat(self, values: torch.Tensor) -> torch.Tensor:
        """The entropy of each position's next-token distribution (verl's entropy_from_logits)."""
        logp = self._log_softmax(values)
        return -(logp.exp() * logp).sum(-1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lp = self.log_probs_flat(input_ids.values())
        return torch.nested.nested_tensor_from_jagged(lp, offsets=input_ids.offsets())

    def entropy(self, input_ids: torch.Tensor) -> torch.Tensor:
        ent = self.entropy_flat(input_ids.values())
        return torch.nested.nested_tensor_from_jagged(ent, offsets=input_ids.offsets())


def make_model() -> TinyLM:
    torch.manual_seed(SEED)
    return TinyLM()


def global_batch(step: int, model: TinyLM):
    """The step's mini-batch in global order: per sample prompt, response, response mask, old/ref log-probs
    (the step-start model's, perturbed) and a GRPO-like per-sample advantage."""
    g = torch.Generator().manual_seed(SEED + 1000 * step)
    out = []
    for i in range(GLOBAL_BATCH):
        P = int(torch.randint(2, 6, (1,), generator=g))
        R = R_MAX if i == 0 else int(torch.randint(1, R_MAX + 1, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (P,), generator=g)
        resp = torch.randint(3, VOCAB, (R,), generator=g)
        mask = torch.ones(R, dtype=torch.int64)
        if i in EMPTY:
            mask[:] = 0
        elif i % 3 == 1 and R > 3:
            mask[1:3] = 0
        adv = float(torch.randn((), generator=g))
        out.append({"prompt": prompt, "response": resp, "mask": mask, "adv": adv,
                    "noise_old": 0.15 * torch.randn(R, generator=g), "noise_ref": 0.3 * torch.randn(R, generator=g)})
    with torch.no_grad():
        for s in out:
            ids = torch.cat([s["prompt"], s["response"]])
            lp = model.log_probs_flat(ids)
            P = s["prompt"].numel()
            cur = lp[P - 1: P - 1 + s["response"].numel()]
            s["old_log_probs"] = (cur + s.pop("noise_old")).float()
            s["ref_log_prob"] = (cur + s.pop("noise_ref")).float()
    return out


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def rank_batch(samples, rank: int, layout: str, micro: int = MICRO, dynbsz: bool = False, entropy: bool = False):
    """This DP rank's chunk of the mini-batch (verl dispatches contiguous chunks) as the engine gets it."""
    n = len(samples) // DP
    mine = samples[rank * n:(rank + 1) * n]
    non_tensor = {"global_batch_size": GLOBAL_BATCH, "use_dynamic_bsz": dynbsz, "micro_batch_size_per_gpu": micro,
                  "max_token_len_per_gpu": MAX_TOKENS, "use_remove_padding": True, "use_fused_kernels": False,
                  "calculate_entropy": entropy}
    if layout == "nested":        # the v1 trainer: per-sample fields, stacked jagged (agent_loop_tq.py:184-199)
        fields = {
            "input_ids": _nested(torch.cat([s["prompt"], s["response"]]) for s in mine),
            "prompts": _nested(s["prompt"] for s in mine),
            "responses": _nested(s["response"] for s in mine),
            "response_mask": _nested(s["mask"] for s in mine),
            "loss_mask": _nested(s["mask"] for s in mine),
            "old_log_probs": _nested(s["old_log_probs"] for s in mine),
            "ref_log_prob": _nested(s["ref_log_prob"] for s in mine),
            "advantages": _nested(torch.full((s["mask"].numel(),), s["adv"]) for s in mine),
        }
        return tu.get_tensordict(fields, non_tensor)
    # the v0 trainer: left-padded prompts, right-padded responses, then verl's left_right_2_no_padding
    pmax = max(s["prompt"].numel() for s in mine)
    b = len(mine)
    prompts = torch.zeros(b, pmax, dtype=torch.int64)
    responses = torch.zeros(b, R_PAD, dtype=torch.int64)
    am = torch.zeros(b, pmax + R_PAD, dtype=torch.int64)
    rmask = torch.zeros(b, R_PAD, dtype=torch.int64)
    old = torch.zeros(b, R_PAD)
    ref = torch.zeros(b, R_PAD)
    adv = torch.zeros(b, R_PAD)
    for i, s in enumerate(mine):
        P, R = s["prompt"].numel(), s["response"].numel()
        prompts[i, pmax - P:] = s["prompt"]
        responses[i, :R] = s["response"]
        am[i, pmax - P: pmax + R] = 1
        rmask[i, :R] = s["mask"]
        old[i, :R] = s["old_log_probs"]
        ref[i, :R] = s["ref_log_prob"]
        adv[i, :R] = s["adv"]
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    td = tu.get_tensordict({"input_ids": torch.cat([prompts, responses], 1), "attention_mask": am,
                            "position_ids": pos, "prompts": prompts, "responses": responses,
                            "response_mask": rmask, "old_log_probs": old, "ref_log_prob": ref,
                            "advantages": adv}, non_tensor)
    return left_right_2_no_padding(td)


def actor_config(config: str) -> FSDPActorConfig:
    c = CONFIGS[config]
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=GLOBAL_BATCH,
                           ppo_micro_batch_size_per_gpu=c["micro"], loss_agg_mode=c["mode"],
                           loss_scale_factor=c["lsf"], policy_loss=PolicyLossConfig(loss_mode=c["loss"]),
                           use_dynamic_bsz=c["dynbsz"], use_kl_loss=c["kl"], kl_loss_coef=KL_COEF,
                           entropy_coeff=ENT_COEF if c["entropy"] else 0.0,
                           kl_loss_type="low_var_kl", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2,
                           use_torch_compile=False)


class CPUEngine(FSDPEngine):
    """verl's FSDP engine with a CPU stand-in for what its constructor builds (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, out: str, rank: int, world: int):
        # FSDPEngine.__init__ (HF model, FSDP wrapping, optimizer on an accelerator) is not run.
        self.module = model
        self.ulysses_sequence_parallel_size = 1
        self.engine_config = SimpleNamespace(use_no_sync_for_gradient_accumulation=True)
        self.optimizer_config = SimpleNamespace(clip_grad=1e9)     # no clipping (it is not a normalisation)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        self.scaler = None
        self._qat_enabled = False
        self.out, self.rank, self.world = out, rank, world
        self.step = 0

    def get_data_parallel_size(self):
        return self.world

    def get_data_parallel_rank(self):
        return self.rank

    def get_data_parallel_group(self):
        return torch.distributed.group.WORLD          # world = DP

    def is_mp_src_rank_with_outputs(self):
        return True

    def forward_step(self, micro_batch, loss_function, forward_only):
        # FSDPEngineWithLMHead.forward_step (transformer_impl.py:1549-1591) with the model call replaced
        model_output = {"log_probs": self.module(micro_batch["input_ids"])}
        if tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):    # :1336, :1542
            model_output["entropy"] = self.module.entropy(micro_batch["input_ids"])
        loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                      dp_group=self.get_data_parallel_group())
        return loss, {"model_output": kept_output(model_output), "loss": loss.detach().item(), "metrics": metrics}

    def optimizer_step(self):
        # FSDP's gradient mean over the DP group (done during backward by FSDP), then verl's optimizer_step
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)
            p.grad /= self.world
        torch.save({n: p.grad.detach().clone() for n, p in self.module.named_parameters()},
                   os.path.join(self.out, f"grads-step{self.step}-rank{self.rank}.pt"))
        return FSDPEngine.optimizer_step(self)


def plant(bug):
    """Plant a term bug in verl's own loss path; returns the undo.  ``kl-microbatch-mean``: the KL matrix
    (what ``kl_penalty`` returned last) is aggregated by ``agg_loss`` without ``global_batch_info`` — with
    ``dp_size = 1`` and ``batch_num_tokens`` the micro-batch's own mask sum: each micro-batch's token mean,
    while the policy term keeps the global count.  ``losses.agg_loss`` and ``core_algos.agg_loss`` are
    replaced by the same function (verl imports one into the other)."""
    from verl.trainer.ppo import core_algos
    from verl.workers.utils import losses
    assert bug in BUGS, bug
    real_agg, real_core, real_kl = losses.agg_loss, core_algos.agg_loss, losses.kl_penalty
    last = []

    @functools.wraps(real_kl)
    def kl_penalty(*a, **k):
        out = real_kl(*a, **k)
        last[:] = [out]
        return out

    @functools.wraps(real_agg)
    def agg_loss(loss_mat, loss_mask, loss_agg_mode, **kw):
        if last and loss_mat is last[0]:
            return real_agg(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=loss_mask.sum())
        return real_agg(loss_mat, loss_mask, loss_agg_mode, **kw)
    losses.agg_loss = core_algos.agg_loss = agg_loss
    losses.kl_penalty = kl_penalty

    def undo():
        losses.agg_loss, core_algos.agg_loss, losses.kl_penalty = real_agg, real_core, real_kl
    return undo


def run(config, out, rank, world, adapter, fail_fast=False, lossguard_bin=None):
    undo = plant(CONFIGS[config]["bug"]) if CONFIGS[config]["bug"] else None
    try:
        _run(config, out, rank, world, adapter, fail_fast, lossguard_bin)
    finally:
        if undo is not None:
            undo()


def _run(config, out, rank, world, adapter, fail_fast, lossguard_bin):
    os.makedirs(out, exist_ok=True)
    layout, micro, dynbsz, entropy = (CONFIGS[config][k] for k in ("layout", "micro", "dynbsz", "entropy"))
    model = make_model()
    engine = CPUEngine(model, out, rank, world)
    cap = None
    if adapter:
        cap = lverl.attach(engine, os.path.join(out, "captures"), steps=range(STEPS), fail_fast=fail_fast,
                           lossguard_bin=lossguard_bin, timeout=60)
    loss_fn = partial(ppo_loss, config=actor_config(config))       # as ActorRolloutRefWorker sets it
    losses, warned = [], []
    for step in range(STEPS):
        engine.step = step
        samples = global_batch(step, model)
        if rank == 0:
            torch.save(samples, os.path.join(out, f"batch-step{step}.pt"))
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                       os.path.join(out, f"params-step{step}.pt"))
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                output = engine.train_batch(rank_batch(samples, rank, layout, micro, dynbsz, entropy),
                                            loss_function=loss_fn)
        except lc.AuditFailed as e:
            unchanged = all(torch.equal(p.detach(), start[n]) for n, p in model.named_parameters())
            with open(os.path.join(out, f"failfast-rank{rank}.json"), "w") as f:
                json.dump({"step": step, "exit_code": e.exit_code, "text": e.text, "message": str(e),
                           "params_unchanged": unchanged, "verdicts": cap.verdicts if cap else None}, f)
            raise
        warned += [str(x.message) for x in w if issubclass(x.category, lverl.CaptureWarning)]
        losses += [torch.tensor(v, dtype=torch.float64) for v in output["loss"]]
    torch.save(losses, os.path.join(out, f"losses-rank{rank}.pt"))
    with open(os.path.join(out, f"meta-rank{rank}.json"), "w") as f:
        json.dump({"config": config, "verl": verl.__version__, "torch": torch.__version__, "warnings": warned,
                   "paths": {str(k): v for k, v in (cap.paths.items() if cap else [])}}, f, indent=1)
    torch.distributed.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--fail-fast", default=None, metavar="CONFIG", help="only CONFIG, adapter with fail_fast")
    ap.add_argument("--lossguard-bin", default=None)
    a = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    assert world == DP, f"run with {DP} processes"
    if a.fail_fast:
        run(a.fail_fast, os.path.join(a.out, a.fail_fast), rank, world, True, True, a.lossguard_bin)
        torch.distributed.destroy_process_group()
        return
    for config in [c for c in a.configs.split(",") if c]:
        run(config, os.path.join(a.out, config, "adapter"), rank, world, True)
        run(config, os.path.join(a.out, config, "plain"), rank, world, False)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
