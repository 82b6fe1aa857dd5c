#!/usr/bin/env python3
"""Runs slime's (``--trainer slime``, the default) or Relax's (``--trainer relax``) training step as the
trainer drives it (tests/trainers/slime_shape, tests/trainers/relax_shape: the module paths, hook signatures,
call order, batch keys, THD/CP layout and return shapes) over the real megatron-core (CPU, Gloo, torchrun),
with the audit switched on by the trainer's own plug-in flags — ``--custom-megatron-init-path
lossguard_capture.<trainer>.init`` and ``--custom-megatron-before-train-step-hook-path
lossguard_capture.<trainer>.before_train_step``, the output folder and steps from the environment — and again
without them, from the same seed; writes what tests/trainers/test_slime.py and test_relax.py compare.

    torchrun --nproc-per-node 2 tests/trainers/slime_relax_driver.py --out DIR --pp 1 --cp 2 --scenarios pt,sm
    torchrun --nproc-per-node 4 tests/trainers/slime_relax_driver.py --trainer relax --out DIR --pp 2 --scenarios pt,bug-src
    python tests/trainers/slime_relax_driver.py --reference DIR --pp 1 --scenarios pt,sm
    torchrun --nproc-per-node 2 tests/trainers/slime_relax_driver.py --out DIR --cp 2 --scenarios pt \
        --slime-src $LOSSGUARD_SLIME_SRC/<commit>
    torchrun --nproc-per-node 2 tests/trainers/slime_relax_driver.py --trainer relax --out DIR --cp 2 \
        --scenarios pt,sft --relax-src $LOSSGUARD_RELAX_SRC

``--slime-src DIR`` (tests/trainers/test_slime_history.py): slime's REAL modules, read at run time from DIR
(scripts/slime-src.sh: DIR/slime/backends/megatron_utils/loss.py ...; never copied into this repository),
laid over a copy of the shape's package in a temporary folder first on sys.path (:func:`overlay_slime`): the
real loss module runs in the shape's training step, data and initialisation (whose real modules need Ray,
sglang and Megatron's training stack), which then also do what the real loss needs — the old log-probs of
slime's actor (``forward_only``), the args fields it reads.

``--relax-src ROOT`` (tests/trainers/test_relax_source.py): Relax's REAL modules, ``ROOT/<commit>/<path>`` for
each file of tests/trainers/relax_source_manifest.json's tier (scripts/relax-src.sh), laid over the shape the
same way, and the real ``_is_global_zero_token_step`` compiled from model.py into the shape's training step
(:func:`overlay_relax`); Relax's true on-policy mode gives its policy loss the old log-probs.

One rollout of three train steps (``args.global_batch_size`` 4 rollouts a step, six samples: two rollouts of
two samples each, slime's ``rollout_mask_sums`` their mask totals): step 0 every sample with an effective
token; step 1 a fully masked sample alone in its rollout (slime's count takes clamp_min(mask.sum(), 1) of it:
the seed's bug 1); step 2 no effective token (slime has no skip: the optimizer steps — bug 2).  The DP ranks
hold samples 2i+d of each step (``partition``), two micro-batches per step by ``micro_batch_indices``.

Scenarios: ``pt`` (--calculate-per-token-loss, entropy bonus 0.05, k1 KL 0.1 under --use-kl-loss), ``sm``
(per-rollout sample mean, entropy bonus), ``sm-reducer`` (``sm`` with --custom-pg-loss-reducer-function-path
set to a user's reducer that calls slime's factory without rollout_mask_sums: a per-sample mean),
``sft`` (sft_loss, per-token), ``pt-ff`` (``pt`` with fail fast on step 1).  Relax (RELAX_SCENARIOS): ``pt``,
``sm`` (its sample_index_mask_sums, ``__loss_scale__`` from the iterator), ``dyncp`` (a CP size per micro-batch),
``dummy`` (a dummy micro-batch per step), and the seed's bugs planted in its code one at a time: ``bug-clamp``
(``-ff``: with fail fast), ``bug-noskip``, ``bug-src``.  The model: the tiny GPTModel of
megatron_shapes_driver without position embeddings (identity attention: a position's loss depends on its
token only, so the packed stream's losses are the samples' own).
"""
import argparse
import contextlib
import hashlib
import json
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(HERE, "slime_shape"))
sys.path.insert(0, os.path.join(HERE, "relax_shape"))
sys.path.insert(0, HERE)
# Megatron-LM's megatron.training (global_vars: set_args / get_args, which slime's init, train and train_one_step
# use), not in the megatron-core wheel: the source tier's stand-in, LAST on sys.path (slime_head_stand_ins/README.md)
sys.path.append(os.path.join(HERE, "slime_head_stand_ins", "site"))

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)

import megatron_driver as base  # noqa: E402
import megatron_shapes_driver as shapes  # noqa: E402
from lossguard_capture.megatron_cpu import cuda_on_cpu  # noqa: E402

SEED, VOCAB = base.SEED, base.VOCAB
STEPS, GBS, M = 3, 4, 2
ENTROPY, KL = 0.05, 0.1
#: per step: (T, R, response mask, rollout) of its six samples
SAMPLES = [
    [(7, 3, [1, 1, 0], 0), (6, 4, [1, 1, 1, 1], 1), (5, 2, [0, 1], 1), (9, 5, [1, 0, 1, 1, 0], 2),
     (4, 2, [1, 1], 3), (8, 3, [1, 1, 1], 3)],
    [(6, 3, [1, 1, 1], 0), (5, 2, [0, 0], 1), (7, 4, [1, 0, 1, 1], 2), (3, 1, [1], 2), (6, 2, [1, 1], 3),
     (5, 3, [0, 1, 0], 3)],
    [(7, 3, [0, 0, 0], 0), (6, 4, [0, 0, 0, 0], 1), (5, 2, [0, 0], 1), (9, 5, [0] * 5, 2), (4, 2, [0, 0], 3),
     (8, 3, [0, 0, 0], 3)],
]
SCENARIOS = {   # scenario -> args overrides
    "pt": dict(calculate_per_token_loss=True, entropy_coef=ENTROPY, use_kl_loss=True, kl_loss_coef=KL),
    "sm": dict(calculate_per_token_loss=False, entropy_coef=ENTROPY),
    "sm-reducer": dict(calculate_per_token_loss=False, entropy_coef=ENTROPY,
                       custom_pg_loss_reducer_function_path="slime_relax_driver.per_sample_mean_reducer"),
    "sft": dict(calculate_per_token_loss=True, loss_type="sft_loss"),
    "pt-ff": dict(calculate_per_token_loss=True, entropy_coef=ENTROPY, use_kl_loss=True, kl_loss_coef=KL),
    # the samples named by the rollout's ``sample_indices`` alone (slime's rollout carries both keys, a
    # rollout of its older releases or a custom one may lack ``partition``): DP ranks hold a strided split
    "pt-sample-indices": dict(calculate_per_token_loss=True, entropy_coef=ENTROPY, use_kl_loss=True,
                              kl_loss_coef=KL, index_key="sample_indices"),
}
#: Relax (--trainer relax): the same steps through Relax's shape; its fixes (PR #285) pass them, the seed's
#: three bugs planted one at a time fail them
RELAX_SCENARIOS = {
    "pt": SCENARIOS["pt"],
    "sm": dict(calculate_per_token_loss=False, entropy_coef=ENTROPY, loss_scales=True),
    "dyncp": dict(SCENARIOS["pt"], max_tokens_per_gpu=8),
    # Relax's own loss type names and estimators: ``sft`` (slime's is sft_loss); a token-global estimator
    # (reinforce_plus_plus: every reducer mask-safe, the entropy bonus and the KL term through it; CP 1 only)
    "sft": dict(calculate_per_token_loss=True, loss_type="sft"),
    "rpp": dict(SCENARIOS["pt"], advantage_estimator="reinforce_plus_plus"),
    "dummy": dict(SCENARIOS["pt"], dummy=True),
    # --sft-chunked-logits (loss.py:1627-1634, model.py:1249-1281 @36882ca): the model returns hidden states and
    # the loss runs the output layer on sub-chunks of 2 tokens through lm_head_forward (the logits never whole)
    "sftc": dict(calculate_per_token_loss=True, loss_type="sft", sft_chunked_logits=True, sft_logits_chunk_size=2),
    # an off-policy step (true_on_policy_mode off, loss.py:876-880): the actor's old log-probs from a forward of
    # an older policy (the weights before a change: here the model's with seeded noise), advantages +-1 — the
    # PPO ratio is not 1 and clipping fires on both sides (pg_clipfrac > 0)
    "offp": dict(SCENARIOS["pt"], true_on_policy_mode=False, stale_policy=0.2, signed_advantages=True),
    # off-policy with TIS (loss.py:997-1044: pg_loss x clamp(exp(old - rollout)), the reducer rebuilt with the
    # samples' denominators) and OPSM (loss.py:961-994: a negative-advantage sample whose sequence KL exceeds
    # opsm_delta masked out of pg_loss), per-sample mean over sample_index_mask_sums
    "tis-opsm": dict(calculate_per_token_loss=False, entropy_coef=ENTROPY, true_on_policy_mode=False,
                     stale_policy=0.2, signed_advantages=True, rollout_drift=0.4, use_tis=True, tis_clip=1.2,
                     tis_clip_low=0.8, use_opsm=True, opsm_delta=0.05),
    # __loss_scale__ as Relax's fully-async dynamic-batch iterator sets it (MicroBatchListIterator.__next__ in
    # relax/utils/data/stream_dataloader.py: one constant for every micro-batch of the rollout, __is_dummy__ from
    # the k_local-th on; actor.py _drain_dynamic_batch_rollout: k_global / mini_global_samples x DP x CP, k_global
    # counting the dummies), sample mean with a dummy micro-batch per step
    "lscale": dict(calculate_per_token_loss=False, entropy_coef=ENTROPY, dummy=True, loss_scales=True),
    "bug-clamp": SCENARIOS["pt"], "bug-clamp-ff": SCENARIOS["pt"],
    "bug-noskip": SCENARIOS["pt"], "bug-src": SCENARIOS["pt"],
    # planted: the iterator's scale from k_local (the real micro-batches) instead of k_global
    "bug-lscale": dict(calculate_per_token_loss=False, entropy_coef=ENTROPY, dummy=True, loss_scales=True),
}
PLANTED = ("pt-ff", "bug-clamp", "bug-clamp-ff", "bug-noskip", "bug-src", "bug-lscale")
TRAINER = "slime"
SLIME_SRC = None        # --slime-src: the folder slime's real modules were read from (overlay_slime)
RELAX_SRC = None        # --relax-src: the folder Relax's real modules were read from (overlay_relax)
SRC_REAL = {}           # their paths in the package -> sha256 of the file as read
TRANSPLANTED = {}       # module.function -> the real file it was compiled from (overlay_relax)
from harness import LOSSGUARD  # noqa: E402  (the binary under test: one definition)


def per_sample_mean_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """A user's --custom-pg-loss-reducer-function-path factory: it gets slime's four arguments (no
    rollout_mask_sums) and builds slime's reducer from them: each sample over its OWN mask count."""
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    return get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks,
                                  calculate_per_token_loss=calculate_per_token_loss)


def scenarios():
    return SCENARIOS if TRAINER == "slime" else RELAX_SCENARIOS


USER_HOOKS = {"init": 0, "steps": []}


def user_init(args):
    """The user's own --custom-megatron-init-path hook, kept by naming it in LOSSGUARD_CHAIN_INIT."""
    USER_HOOKS["init"] += 1


def user_before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    """The user's own step hook (LOSSGUARD_CHAIN_BEFORE_TRAIN_STEP): called after lossguard's, every step."""
    USER_HOOKS["steps"].append([rollout_id, step_id])


def make_args(scenario, pp, cp, adapter):
    a = SimpleNamespace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        loss_type="policy_loss", calculate_per_token_loss=True, entropy_coef=0.0, use_kl_loss=False,
        kl_loss_coef=0.0, kl_loss_type="k1", eps_clip=0.2, eps_clip_high=0.28, custom_pg_loss_reducer_function_path=None,
        custom_loss_function_path=None, qkv_format="thd", allgather_cp=False, data_pad_size_multiplier=4,
        seq_length=64, micro_batch_size=1, global_batch_size=GBS, rollout_batch_size=GBS * STEPS, n_samples_per_prompt=1,
        custom_megatron_init_path=None, custom_megatron_before_train_step_hook_path=None, max_tokens_per_gpu=None,
        loss_scales=False, dummy=False, stale_policy=0.0, signed_advantages=False, rollout_drift=0.0,
        # what slime's real loss.py and model.py read beside (--slime-src; cited at @9e5a857, the same at
        # @4d837ff, @763f18d, @f9f00b2 a few lines off): the logits / rollout_temperature (loss.py:57), the old
        # log-probs from the batch, not the rollout's (use_rollout_logprobs, loss.py:390), the PPO ratio per
        # token (advantage_estimator not gspo, loss.py:406), no TIS (get_mismatch_metrics, use_tis,
        # loss.py:437), forward_only's entropy and hook (use_rollout_entropy, model.py:234;
        # custom_megatron_before_log_prob_hook_path, model.py:241) — slime's defaults (slime/utils/arguments.py:200,
        # 709, 755, 764, 770, 780 @9e5a857)
        rollout_temperature=1.0, use_rollout_logprobs=False, advantage_estimator="grpo", get_mismatch_metrics=False,
        use_tis=False, custom_tis_function_path=None, use_rollout_entropy=False,
        custom_megatron_before_log_prob_hook_path=None)
    if RELAX_SRC:       # what Relax's real loss.py reads beside (36882ca: get_responses L79-222,
        #                 get_log_probs_and_entropy L320-498, policy_loss_function L830-1176, loss_function
        #                 L1545-1730), its defaults off: no OPSM, TIS, OPD, rollout log-probs, recomputation,
        #                 all-gather CP; true on-policy mode (L860-863, L900-905: the old log-probs are this
        #                 forward's, detached — Relax's own mode for a trainer without the actor's extra forward)
        for k, v in dict(use_opsm=False, allgather_cp=False, use_opd=False, opd_loss_coef=0.0, opd_log_prob_top_k=0,
                         opd_only_reward=False, true_on_policy_mode=True, recompute_loss_function=False,
                         use_unbiased_kl=False, kl_coef=0.0, normalize_advantages=False, task_type="causal_lm",
                         opsm_delta=0.0, sft_chunked_logits=False, sft_logits_chunk_size=1024, mtp_only_training=False,
                         is_vl_model=False, uses_unsplit_forward=False, log_probs_chunk_size=-1, value_clip=0.2,
                         tis_clip=2.0, tis_clip_low=0.0).items():
            setattr(a, k, v)
    for k, v in scenarios()[scenario].items():
        setattr(a, k, v)
    if adapter:                                   # what a user adds to the trainer's command line
        a.custom_megatron_init_path = f"lossguard_capture.{TRAINER}.init"
        a.custom_megatron_before_train_step_hook_path = f"lossguard_capture.{TRAINER}.before_train_step"
    return a


def tokens(step):
    g = torch.Generator().manual_seed(SEED + 17 * step)
    return [torch.randint(1, VOCAB, (T,), generator=g) for T, _, _, _ in SAMPLES[step]]


def rollout_data(dp, dp_rank):
    if TRAINER == "relax":
        return relax_rollout_data(dp, dp_rank)
    rd, indices = slime_rollout_data(dp, dp_rank)
    # slime's actor hands train_actor the per-rollout mask totals as one float32 tensor (actor.py:264-268 @624b824)
    rd["rollout_mask_sums"] = torch.stack(rd["rollout_mask_sums"]).to(torch.float32)
    return rd, indices


def relax_rollout_data(dp, dp_rank):
    """As slime_rollout_data, with Relax's keys: ``sample_indices`` (global positions), ``sample_index_mask_sums``
    (the denominators), the advantages and reference log-probs whole (get_batch slices them to the micro-batch's
    CP layout, which dynamic CP decides there)."""
    rd, indices = slime_rollout_data(dp, dp_rank, cp_local=False)
    rd["sample_indices"] = rd.pop("partition")
    rd["sample_index_mask_sums"] = rd.pop("rollout_mask_sums")
    return rd, indices


def slime_rollout_data(dp, dp_rank, cp_local=True):
    """This DP rank's samples of the rollout (every step), as slime's RolloutManager hands them to the actor:
    ``partition`` their global positions, ``rollout_mask_sums`` each sample's rollout mask total, and the
    advantages (1: on-policy PPO's gradient is the cross entropy's) and reference log-probs (0) CP-local."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    rd = {k: [] for k in ("tokens", "total_lengths", "response_lengths", "loss_masks", "rollout_mask_sums",
                          "advantages", "ref_log_probs", "partition")}
    indices = []
    for step in range(STEPS):
        toks = tokens(step)
        sums = {}
        for T, R, m, r in SAMPLES[step]:
            sums[r] = sums.get(r, 0) + sum(m)
        mine = [i for i in range(len(SAMPLES[step])) if i % dp == dp_rank]
        start = len(rd["tokens"])
        for i in mine:
            T, R, m, r = SAMPLES[step][i]
            rd["tokens"].append(toks[i])
            rd["total_lengths"].append(T)
            rd["response_lengths"].append(R)
            rd["loss_masks"].append(torch.tensor(m, dtype=torch.int32))
            rd["rollout_mask_sums"].append(torch.tensor(sums[r]))
            local = slice_log_prob_with_cp if cp_local else (lambda v, T, R: v)
            rd["advantages"].append(local(torch.ones(R), T, R))
            rd["ref_log_probs"].append(local(torch.zeros(R), T, R))
            rd["partition"].append(step * len(SAMPLES[step]) + i)
        local = list(range(start, len(rd["tokens"])))
        half = (len(local) + 1) // 2
        indices += [local[:half], local[half:]]
    return rd, indices


def build(pp, cp, per_token):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    config = shapes.make_config(pp, 1, cp, per_token)
    config.variable_seq_lengths = True      # slime trains packed streams of any length (its arguments set it)
    torch.manual_seed(SEED)
    model = GPTModel(config=config, transformer_layer_spec=base.layer_spec(), vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="none",
                     share_embeddings_and_output_weights=False, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    chunks = [DDP(config, DistributedDataParallelConfig(), model)]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, min_lr=0.001, weight_decay=0.01,
                                                 clip_grad=0.0, bf16=False, fp16=False), chunks)
    sched = OptimizerParamScheduler(opt, init_lr=0.01, max_lr=0.01, min_lr=0.001, lr_warmup_steps=0,
                                    lr_decay_steps=GBS * STEPS, lr_decay_style="linear", start_wd=0.01,
                                    end_wd=0.01, wd_incr_steps=GBS * STEPS, wd_incr_style="constant")
    return config, chunks, opt, sched


def modules():
    """The trainer's modules (the shape's package on sys.path) and its adapter module."""
    import importlib
    base = "slime.backends.megatron_utils" if TRAINER == "slime" else "relax.backends.megatron"
    return ({k: importlib.import_module(f"{base}.{k}") for k in ("initialize", "model", "data", "loss", "cp_utils")},
            importlib.import_module(f"lossguard_capture.{TRAINER}"))


def plant(scenario, mods):
    """The seed's three bugs, planted in Relax's shape one at a time (PR #285 fixed each)."""
    from megatron.core import parallel_state as mpu
    if scenario.startswith("bug-clamp"):         # bug 1: at CP 1 an empty response counted as 1 token
        real = mods["loss"].get_cp_local_num_tokens

        def legacy(total_lengths, response_lengths, loss_masks, *a, **k):
            if (k.get("dynamic_cp_size") or mpu.get_context_parallel_world_size()) == 1:
                return sum(torch.clamp_min(m.sum(), 1) for m in loss_masks).to(torch.int)
            return real(total_lengths, response_lengths, loss_masks, *a, **k)
        mods["loss"].get_cp_local_num_tokens = legacy
    elif scenario == "bug-noskip":              # bug 2: a zero-token step runs optimizer.step()
        mods["model"]._is_global_zero_token_step = lambda losses: False
    elif scenario == "bug-src":                 # bug 3: the decision broadcast from a group-local source (stage 0)
        real = mods["model"]._is_global_zero_token_step
        saved = mpu.get_pipeline_model_parallel_last_rank

        def first_stage_src(losses):
            mpu.get_pipeline_model_parallel_last_rank = mpu.get_pipeline_model_parallel_first_rank
            try:
                return real(losses)
            finally:
                mpu.get_pipeline_model_parallel_last_rank = saved
        mods["model"]._is_global_zero_token_step = first_stage_src


def fresh_job(scenario, out, mods):
    """A job's settings as a user sets them (the environment: out folder, binary, steps, fail fast for ``*-ff``,
    the user's own hooks chained after lossguard's), and nothing left of the previous job of this process (one
    process runs several jobs here; a trainer runs one)."""
    import lossguard_capture.slime as lcs
    ff = scenario.endswith("-ff")
    os.environ.update(LOSSGUARD_OUT=os.path.join(out, "captures"), LOSSGUARD_BIN=LOSSGUARD,
                      LOSSGUARD_STEPS="1" if ff else "0,1,2", LOSSGUARD_FAIL_FAST="1" if ff else "0",
                      LOSSGUARD_CHAIN_INIT="slime_relax_driver.user_init",
                      LOSSGUARD_CHAIN_BEFORE_TRAIN_STEP="slime_relax_driver.user_before_train_step")
    USER_HOOKS.update(init=0, steps=[])
    lcs._AUDIT = None
    _reset_patches(mods)


def run(scenario, out, pp, cp, adapter):
    from megatron.core import parallel_state as ps
    mods, lca = modules()
    os.makedirs(out, exist_ok=True)
    args = make_args(scenario, pp, cp, adapter)
    fresh_job(scenario, out, mods)
    if TRAINER == "relax":
        mods["data"].MAX_TOKENS_PER_GPU = args.max_tokens_per_gpu
    mods["initialize"].init(args)
    plant(scenario, mods)
    config, chunks, opt, sched = build(pp, cp, args.calculate_per_token_loss)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rd, mbi = rollout_data(dp, dp_rank)
    if getattr(args, "index_key", "partition") != "partition":     # a rollout without `partition`
        rd[args.index_key] = rd.pop("partition")
    M_steps = [M] * STEPS
    result = {}
    if SLIME_SRC:   # slime's real policy loss reads the old log-probs: its actor computes them before training
        #            (actor.py:365-375 @9e5a857, forward_only(get_log_probs_and_entropy)): at step 0 the ratio is 1
        rd.update(mods["model"].forward_only(mods["loss"].get_log_probs_and_entropy, args, chunks,
                                             [mods["data"].DataIterator(rd, mbi)], M_steps))
    if SLIME_SRC or RELAX_SRC:
        result["real_src"] = {"dir": SLIME_SRC or RELAX_SRC, "real": SRC_REAL, "transplanted": TRANSPLANTED,
                              "loaded": {k: os.path.abspath(m.__file__) for k, m in sorted(mods.items())},
                              "zero_token_skip": getattr(getattr(mods["model"], "_is_global_zero_token_step", None),
                                                         "__code__", None) and
                              mods["model"]._is_global_zero_token_step.__code__.co_filename}
    extra = {}
    if args.dummy:       # every DP rank runs a third micro-batch per step: its first partition again, a dummy
        mbi = [x for k in range(STEPS) for x in (mbi[2 * k], mbi[2 * k + 1], mbi[2 * k])]
        extra["dummy_micro_batch_offsets"] = [3 * k + 2 for k in range(STEPS)]
        M_steps = [3] * STEPS
    if args.loss_scales:     # what Relax's iterator injects: k_global / mini_global_samples x DP x CP, k_global
        #                      the step's micro-batches with the dummies (bug-lscale: without them, k_local)
        dpcp = ps.get_data_parallel_world_size(with_context_parallel=True)
        k = M if scenario == "bug-lscale" else M_steps[0]
        extra["micro_batch_loss_scales"] = [k / GBS * dpcp] * len(mbi)
    if not getattr(args, "true_on_policy_mode", True):
        off_policy_rollout(args, mods, chunks, rd, mbi, out)
    if getattr(args, "sft_chunked_logits", False):
        count_chunked_sft(mods, result)
    if TRAINER == "relax":
        its = [mods["data"].DataIterator(rd, None, mbi, **extra)]
        train = lambda: mods["model"].train(0, chunks, opt, sched, its, M_steps, [GBS] * STEPS, args)  # noqa: E731
    else:       # slime's DataIterator(rollout_data, micro_batch_indices) (data.py:155-168 @624b824)
        assert not extra, "the dummy micro-batches and injected loss scales are Relax's"
        its = [mods["data"].DataIterator(rd, mbi)]
        train = slime_train(mods, chunks, opt, sched, its, M_steps, [GBS] * STEPS)
    _train_and_record(mods, chunks, opt, out, adapter, result, train)


def slime_train(mods, chunks, opt, sched, its, num_microbatches, global_batch_sizes):
    """slime's ``train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches,
    global_batch_sizes)`` as a callable returning [(report, grad norm)] per step: slime's train returns nothing
    (it logs each step, model.py:874-898 @624b824), so the test reads what its ``train_one_step`` returns."""
    def train():
        steps = []
        real_step = mods["model"].train_one_step

        def train_one_step(*a, **k):              # the test's view of what train() reports per step
            loss, grad_norm = real_step(*a, **k)
            steps.append(({key: float(v) for key, v in loss.items()}, grad_norm))
            return loss, grad_norm
        mods["model"].train_one_step = train_one_step
        try:
            mods["model"].train(0, chunks, opt, sched, its, num_microbatches, global_batch_sizes)
        finally:
            mods["model"].train_one_step = real_step
        return steps
    return train


def off_policy_rollout(args, mods, chunks, rd, mbi, out):
    """The rollout of an older policy: the actor's old log-probs (``log_probs``, which Relax's policy loss reads
    outside true on-policy mode, loss.py:879-880 @36882ca) from a forward of the weights before a change — the
    model's own with seeded noise of std ``stale_policy``, restored after — through the trainer's
    get_batch and get_log_probs_and_entropy, each sample's CP-local log-probs made whole over the CP group;
    advantages +1 / -1 by the sample's global index (``signed_advantages``); the rollout engine's log-probs
    (``rollout_log_probs``, TIS) the old ones plus seeded noise in [-rollout_drift, rollout_drift].  Saves
    {global index: old, rollout, advantage} for the reference (``offpolicy-rank*.pt``)."""
    import lossguard_capture as lc
    from megatron.core import parallel_state as ps
    assert ps.get_pipeline_model_parallel_world_size() == 1, "the older policy's forward is written for PP 1"
    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    params = [p for c in chunks for p in c.parameters()]
    saved = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(SEED + 991)
    old = [None] * len(rd["tokens"])
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * args.stale_policy)
        it = mods["data"].DataIterator(rd, None, mbi)
        for rows in mbi:
            batch = mods["data"].get_batch(it, ["tokens", "total_lengths", "response_lengths", "loss_masks"],
                                           args.data_pad_size_multiplier, args.qkv_format)
            logits = chunks[0](input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                               packed_seq_params=batch["packed_seq_params"])
            _, res = mods["loss"].get_log_probs_and_entropy(
                logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
                response_lengths=batch["response_lengths"], with_entropy=False)
            for i, lp, T, R in zip(rows, res["log_probs"], batch["total_lengths"], batch["response_lengths"]):
                full = torch.zeros(R, dtype=torch.float32)
                full[torch.tensor(lc.zigzag_owned(T, R, cp, r), dtype=torch.int64)] = lp.detach().float()
                if cp > 1:
                    dist.all_reduce(full, group=ps.get_context_parallel_group())
                old[i] = full
        for p, s in zip(params, saved):
            p.copy_(s)
    rd["log_probs"] = old
    keep = {}
    for k, gi in enumerate(rd["sample_indices"]):
        R = int(rd["response_lengths"][k])
        a = (1.0 if gi % 2 == 0 else -1.0) if args.signed_advantages else 1.0
        rd["advantages"][k] = torch.full((R,), a)
        drift = (torch.rand(R, generator=torch.Generator().manual_seed(SEED + 7 * gi)) * 2 - 1) * args.rollout_drift
        keep[int(gi)] = dict(old=old[k].clone(), rollout=old[k] + drift, adv=a)
    if args.rollout_drift:
        rd["rollout_log_probs"] = [keep[int(gi)]["rollout"] for gi in rd["sample_indices"]]
    torch.save(keep, os.path.join(out, f"offpolicy-rank{dist.get_rank()}.pt"))


def count_chunked_sft(mods, result):
    """Records that the loss ran Relax's chunked SFT path: sft_loss_function_chunked's calls, the width of what
    it received (the hidden size, not the vocabulary) and the rows of each lm_head_forward call."""
    real = mods["loss"].sft_loss_function_chunked
    seen = result.setdefault("sft_chunked", {"calls": 0, "lm_head_rows": [], "widths": []})

    def sft_loss_function_chunked(args, batch, hidden_states, sum_of_sample_mean, *, lm_head_forward):
        seen["calls"] += 1
        seen["widths"] = sorted(set(seen["widths"]) | {int(hidden_states.shape[-1])})

        def head(x, *a, **k):
            seen["lm_head_rows"].append(int(x.shape[0]))
            return lm_head_forward(x, *a, **k)
        return real(args, batch, hidden_states, sum_of_sample_mean, lm_head_forward=head)
    mods["loss"].sft_loss_function_chunked = sft_loss_function_chunked


def _train_and_record(mods, chunks, opt, out, adapter, result, train):
    """Runs ``train()`` (the trainer's rollout of STEPS steps: it returns [(reported, grad norm)] per step) with the
    test's own view of each step — this rank's parameters before forward_backward_func and its ``main_grad`` after
    (finalize_model_grads ran inside it) — and saves them, the final parameters and ``result`` in ``out``; fail
    fast's stop is recorded (with whether the parameters stayed those of the failing step)."""
    import lossguard_capture.slime as lcs
    from megatron.core import parallel_state as ps
    rank = dist.get_rank()
    record = {"grads": [], "params": []}
    real_fb = mods["model"].get_forward_backward_func

    def get_forward_backward_func():          # the test's own view: main_grad after finalize, the step's params
        fb = real_fb()

        def run_fb(**kw):
            if kw.get("forward_only"):
                return fb(**kw)
            record["params"].append({n: p.detach().clone() for n, p in shapes.named_params(chunks)})
            out = fb(**kw)
            record["grads"].append({n: {"grad": p.main_grad.detach().clone(), "partition_dim": -1, "tp_rank": 0}
                                    for n, p in shapes.named_params(chunks)})
            return out
        return run_fb
    mods["model"].get_forward_backward_func = get_forward_backward_func
    try:
        out_steps = train()
        result["reported"] = [r for r, _ in out_steps]
        result["grad_norm"] = [float(g) for _, g in out_steps]
    except Exception as e:
        from lossguard_capture import AuditFailed
        if not isinstance(e, AuditFailed):
            raise
        result["audit_failed"] = {"step": e.step, "exit_code": e.exit_code}
        result["params_unchanged"] = all(torch.equal(p.detach(), record["params"][-1][n])
                                         for n, p in shapes.named_params(chunks))
    finally:
        mods["model"].get_forward_backward_func = real_fb
    if lcs.current() is not None:
        lcs.current().close()
    result["lr"] = float(opt.param_groups[0]["lr"])
    if adapter:
        result["user_hooks"] = dict(USER_HOOKS)
    for s, g in enumerate(record["grads"]):
        torch.save(g, os.path.join(out, f"grads-step{s}-rank{rank}.pt"))
    for s, p in enumerate(record["params"]):
        torch.save(p, os.path.join(out, f"params-step{s}-rank{rank}.pt"))
    torch.save({n: p.detach().clone() for n, p in shapes.named_params(chunks)}, os.path.join(out, f"final-rank{rank}.pt"))
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    ps.destroy_model_parallel()
    dist.barrier()


def _reset_patches(mods):
    """Undo the previous job's patches of the trainer's modules (one process runs several jobs here): the
    adapter's wrappers (``__wrapped__``) and the plants (the originals kept in ``ORIGINALS``)."""
    for mod in (mods["loss"], mods["model"]):
        saved = ORIGINALS.setdefault(mod.__name__, dict(vars(mod)))
        for name, f in list(vars(mod).items()):
            while callable(f) and hasattr(f, "__wrapped__") and getattr(f, "__module__", "") == "lossguard_capture.slime":
                f = f.__wrapped__
            setattr(mod, name, saved.get(name, f))


ORIGINALS = {}


def overlay_slime(src):
    """slime's real modules from ``src`` (``src/slime/...``, scripts/slime-src.sh) laid over a copy of the
    shape's package (tests/trainers/slime_shape/slime) in a temporary folder, which goes first on sys.path;
    the shape's ``__init__.py`` files are kept (slime's import its actor, Ray, Megatron's training stack).
    Returns {path in the package: sha256 of the real file} (the test checks the modules loaded are these)."""
    if not os.path.isdir(os.path.join(src, "slime")):
        raise SystemExit(f"--slime-src {src}: no slime/ folder there (scripts/slime-src.sh DEST COMMIT writes "
                         f"DEST/<commit>/slime/...)")
    files = {}
    for folder, _, names in os.walk(os.path.join(src, "slime")):
        for name in sorted(names):
            if name.endswith(".py") and name != "__init__.py":
                files[os.path.relpath(os.path.join(folder, name), src)] = os.path.join(folder, name)
    if not files:
        raise SystemExit(f"--slime-src {src}: no module of slime there")
    return _overlay("slime_shape", "slime", files)


def relax_tier():
    """tests/trainers/relax_source_manifest.json's ``tier``: the Relax files the real-source tier runs, each at
    its commit, and ``transplants``: single functions of a real file compiled into the shape's module."""
    with open(os.path.join(HERE, "relax_source_manifest.json")) as f:
        m = json.load(f)
    return m["tier"], m.get("transplants", [])


def overlay_relax(root):
    """Relax's real modules, read from ``root/<commit>/<path>`` for each file of the manifest's tier
    (scripts/relax-src.sh writes that layout), laid over a copy of the shape's package (tests/trainers/relax_shape:
    it also holds the modules the real ones import that the tier does not run: OPD, replay capture, logging);
    then the manifest's transplants: a function of a real module whose other parts need Relax's whole stack
    (model.py: Ray, Megatron's training package) compiled from the real file, its own lines and file name, into
    the shape's module. Returns {path: sha256} of the real files and {module.function: real file}."""
    tier, transplants = relax_tier()
    files, gone = {}, []
    for e in tier + transplants:
        f = os.path.join(root, e["commit"], e["path"])
        if not os.path.isfile(f):
            gone.append(f"{e['commit'][:7]}:{e['path']}")
        elif e in tier:
            files[e["path"]] = f
    if gone:
        raise SystemExit(f"--relax-src {root}: lacks {', '.join(gone)} (scripts/relax-src.sh DEST writes "
                         f"DEST/<commit>/<path> for every file of tests/trainers/relax_source_manifest.json)")
    real = _overlay("relax_shape", "relax", files)
    import ast
    import importlib
    moved = {}
    for e in transplants:
        path = os.path.join(root, e["commit"], e["path"])
        with open(path) as f:
            text = f.read()
        fn = next((n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == e["function"]),
                  None)
        if fn is None:
            raise SystemExit(f"--relax-src: {path} defines no {e['function']}()")
        first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        lines = text.splitlines(keepends=True)
        code = compile("\n" * (first - 1) + "".join(lines[first - 1:fn.end_lineno]), path, "exec")
        module = importlib.import_module(e["module"])
        exec(code, vars(module))     # noqa: S102 — the real function, in the namespace its module gives it
        moved[f"{e['module']}.{e['function']}"] = path
        with open(path, "rb") as f:
            real[e["path"]] = hashlib.sha256(f.read()).hexdigest()
    return real, moved


def _overlay(shape, package, files):
    """A copy of ``tests/trainers/<shape>/<package>`` in a temporary folder first on sys.path, with ``files``
    ({path in the package: real file}) laid over it; {path: sha256 of the file as read}."""
    import atexit
    import shutil
    import tempfile
    tmp = tempfile.mkdtemp(prefix=f"lossguard-{package}-")
    atexit.register(shutil.rmtree, tmp, True)
    shutil.copytree(os.path.join(HERE, shape, package), os.path.join(tmp, package),
                    ignore=shutil.ignore_patterns("__pycache__"))
    real = {}
    for rel, src in sorted(files.items()):
        dst = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        with open(dst, "rb") as f:
            real[rel] = hashlib.sha256(f.read()).hexdigest()
    sys.path.insert(0, tmp)
    # slime decorates compute_approx_kl, compute_policy_loss and its entropy's mul_reduce with
    # @torch.compile(dynamic=True) (slime/utils/ppo_utils.py:9,48,90 @f9f00b2), as megatron-core does its
    # fused cross entropy (jit_fuser), Relax its ppo_utils likewise: on this CPU they run eagerly — the same
    # operations, without Inductor
    import torch._dynamo
    torch._dynamo.config.disable = True
    return real


# ---- the source tier: slime's own training step at its head (--slime-source) ------------------------------
SLIME_SOURCE = None     # --slime-source ROOT: slime's real modules at the manifest's commit, ROOT/<commit>/<path>
#: the source tier's planted bugs (adapter runs only), each around slime's real code, none in it
SOURCE_PLANTS = {"bug-cp": SCENARIOS["pt"], "bug-denoms": SCENARIOS["sm"]}


def source_tier():
    """tests/trainers/slime_source_manifest.json: the commit, the real files, the stand-ins."""
    with open(os.path.join(HERE, "slime_source_manifest.json")) as f:
        return json.load(f)


def overlay_slime_source(root):
    """slime's real modules at the manifest's commit, read from ``root/<commit>/<path>`` (scripts/slime-src.sh), laid
    over a copy of tests/trainers/slime_head_stand_ins/slime (the few modules whose real imports cannot run here:
    httpx, psutil, wandb) in a temporary folder first on sys.path; the stand-ins' ``site`` (Megatron-LM's
    ``megatron.training``, tqdm) goes LAST on sys.path. A real file never lies over a stand-in (refused).
    Returns {path: sha256 of the real file as read}."""
    m = source_tier()
    src = os.path.join(root, m["commit"])
    files = {rel: os.path.join(src, rel) for rel in m["real"]}
    gone = [rel for rel, f in files.items() if not os.path.isfile(f)]
    if gone:
        raise SystemExit(f"--slime-source {root}: lacks {m['commit'][:7]}:{', '.join(gone[:3])} "
                         "(scripts/slime-src.sh DEST writes DEST/<commit>/<path> for every file of "
                         "tests/trainers/slime_source_manifest.json)")
    stand = os.path.join(HERE, "slime_head_stand_ins")
    both = [rel for rel in files if os.path.exists(os.path.join(stand, rel))]
    assert not both, f"a stand-in and a real file at the same path: {both}"
    real = _overlay("slime_head_stand_ins", "slime", files)
    sys.path.append(os.path.join(stand, "site"))
    return real


def cpu_accelerator():
    """This CPU as a slime accelerator: a subclass of slime's own ``Accelerator`` contract
    (slime/utils/accelerator/base.py:17 @624b824), installed with slime's ``set_accelerator``
    (accelerator/__init__.py:221), its "dependency injection" point. slime picks CUDA or MUSA otherwise and, on a
    machine with neither, raises "No usable accelerator" (accelerator/__init__.py:198) where data.py:90 asks for
    ``accelerator.device()`` (get_batch's cu_seqlens)."""
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    class CPUAccelerator(Accelerator):
        name, device_type, communication_backend_name = "cpu", "cpu", "gloo"

        def is_available(self):
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None):
            return "cpu"

        def set_device(self, index):
            pass

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def synchronize(self, device=None):
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self):
            pass

        def mem_get_info(self, device=None):
            return (0, 0)

        def memory_allocated(self, device=None):
            return 0

        def memory_reserved(self, device=None):
            return 0
    accelerator.set_accelerator(CPUAccelerator())


@contextlib.contextmanager
def cuda_rng_on_cpu():
    """slime's init seeds Megatron's CUDA RNG tracker (initialize.py:30 @624b824:
    ``tensor_parallel.model_parallel_cuda_manual_seed``), whose ``add`` reads and restores the CUDA generator's state
    (megatron/core/tensor_parallel/random.py:235-240 in 0.16.1) — without a driver, "Found no NVIDIA driver". Inside
    this block (init only) the CUDA generator is a CPU ``torch.Generator``: the tracker's states are seeded and kept
    as on a GPU (they serve dropout in tensor-parallel regions: the tier's dropout is 0, TP 1)."""
    import megatron.core.tensor_parallel.random as mrandom
    gen = torch.Generator()
    saved = (torch.cuda.get_rng_state, torch.cuda.manual_seed, mrandom._set_cuda_rng_state)
    torch.cuda.get_rng_state = lambda device="cuda": gen.get_state()
    torch.cuda.manual_seed = lambda seed: gen.manual_seed(seed)
    mrandom._set_cuda_rng_state = lambda state, *a, **k: gen.set_state(state)
    try:
        yield
    finally:
        torch.cuda.get_rng_state, torch.cuda.manual_seed, mrandom._set_cuda_rng_state = saved


def source_model_provider(pre_process=True, post_process=True):
    """The test's tiny GPTModel (as :func:`build`), loaded by slime's own ``--custom-model-provider-path`` branch
    (model_provider.py:97-116 @624b824): the stage's layers from the args slime's ``get_args`` returns."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training.global_vars import get_args
    a = get_args()
    config = shapes.make_config(a.pipeline_model_parallel_size, 1, a.context_parallel_size, a.calculate_per_token_loss)
    config.variable_seq_lengths = True      # slime trains packed streams of any length (its arguments set it)
    torch.manual_seed(SEED)
    return GPTModel(config=config, transformer_layer_spec=base.layer_spec(), vocab_size=VOCAB, max_sequence_length=64,
                    position_embedding_type="none", share_embeddings_and_output_weights=False,
                    pre_process=pre_process, post_process=post_process)


def make_source_args(scenario, pp, cp, adapter):
    """make_args' fields and what slime's real init, setup_model_and_optimizer, forward_only, train, train_one_step,
    get_batch and loss read beside them at 624b824 — the values slime's arguments give by default
    (slime/utils/arguments.py and Megatron-LM's; the tier's own choices marked): initialize.py:37-104, model.py:203-231
    (the LR schedule: 3 steps of 4 rollouts, linear from 0.01 to 0.001, as :func:`build`), 290-320, 454, 500,
    550-700, 738-940, loss.py:549, 1297-1330, ppo_utils' ``compute_policy_loss(eps_clip_c=)``."""
    a = make_args(scenario if scenario in SCENARIOS else "pt", pp, cp, adapter)
    for k, v in (SOURCE_PLANTS.get(scenario) or {}).items():
        setattr(a, k, v)
    world = dist.get_world_size()
    for k, v in dict(
            # initialize.py:37-104 (Megatron-LM's defaults)
            rank=dist.get_rank(), world_size=world, data_parallel_size=world // (pp * cp), seed=SEED,
            virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_comm_backend=None,
            hierarchical_context_parallel_sizes=None, expert_model_parallel_size=1, expert_tensor_parallel_size=1,
            num_distributed_optimizer_instances=1, distributed_timeout_minutes=10, nccl_communicator_config_path=None,
            use_tp_pp_dp_mapping=False, enable_gloo_process_groups=True, enable_experimental=False,
            data_parallel_random_init=False, te_rng_tracker=False, inference_rng_tracker=False, rampup_batch_size=None,
            decrease_batch_size_if_needed=False, deterministic_mode=False, tp_comm_overlap=False,
            # setup_model_and_optimizer (model.py:290-320): the model by --custom-model-provider-path (the tier's);
            # its assertion asks for a checkpoint path, which only initialize_model_and_optimizer (not run) loads
            moe_use_upcycling=False, load="/nonexistent/not-loaded", pretrained_checkpoint=None, num_rollout=1,
            custom_model_provider_path="slime_relax_driver.source_model_provider", use_stateless_adam=False,
            optimizer="adam", lr=0.01, min_lr=0.001, weight_decay=0.01, clip_grad=0.0, bf16=False, fp16=False,
            use_distributed_optimizer=False,
            # get_optimizer_param_scheduler (model.py:203-231)
            lr_decay_iters=None, lr_wsd_decay_iters=None, lr_warmup_fraction=None, lr_warmup_iters=0,
            lr_warmup_init=0.0, lr_decay_style="linear", start_weight_decay=0.01, end_weight_decay=0.01,
            weight_decay_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=False, lr_wsd_decay_style="exponential",
            # forward_only, train_one_step, train (model.py:347-940)
            allgather_cp=False, rollout_top_p=1.0, use_dynamic_batch_size=False, save_debug_train_data=None,
            enable_mtp_training=False, decoder_seq_length=None, ci_test=False, overlap_grad_reduce=False,
            overlap_param_gather=False, align_grad_reduce=True, align_param_gather=False, reset_optimizer_states=False,
            manual_gc=False, ci_save_grad_norm=None, ci_load_grad_norm=None, ci_disable_kl_checker=False,
            # the loss (loss.py)
            log_probs_chunk_size=-1, use_opsm=False, eps_clip_c=None, recompute_loss_function=False,
            use_unbiased_kl=False, use_wandb=False, use_tensorboard=False).items():
        setattr(a, k, v)
    return a


def plant_source(scenario, mods):
    """A bug planted AROUND slime's real code (its files unchanged), before slime's init installs the adapter
    (which then wraps the planted function as it would a buggy slime's):

    * ``bug-cp`` — the per-token loss not multiplied by CP: slime's real ``loss_function``, its loss divided by
      the CP size (what slime did before f9f00b2, #990: loss.py:717-718 there; loss.py:1360-1361 @624b824
      multiplies by it). At CP 2 every token weighs x1/2.
    * ``bug-denoms`` — the per-rollout denominators dropped: slime's real ``get_sum_of_sample_mean`` called
      without ``sample_denoms`` (loss.py:1319-1325 @624b824 passes ``batch["rollout_mask_sums"]``): each sample
      over its own mask count (cp_utils.py:67-68), a per-sample mean where slime's is per rollout."""
    from megatron.core import mpu
    if scenario == "bug-cp":
        real = mods["model"].loss_function

        def loss_function(args, batch, num_microbatches, step_global_batch_size, logits):
            loss, count, log = real(args, batch, num_microbatches, step_global_batch_size, logits)
            return loss / mpu.get_context_parallel_world_size(), count, log
        mods["model"].loss_function = loss_function
    elif scenario == "bug-denoms":
        real = mods["loss"].get_sum_of_sample_mean

        def get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks, sample_denoms=None,
                                   calculate_per_token_loss=False):
            return real(total_lengths, response_lengths, loss_masks, None, calculate_per_token_loss)
        mods["loss"].get_sum_of_sample_mean = get_sum_of_sample_mean


def run_source(scenario, out, pp, cp, adapter):
    """One job through slime's OWN modules (:func:`overlay_slime_source`): its ``init`` (which loads the init hook
    with its ``load_function``), ``setup_model_and_optimizer``, ``get_data_iterator``, ``forward_only`` (the old
    log-probs, as its actor's ``compute_log_prob``: actor.py:357-372, 447-453 @624b824) and ``train`` (its
    ``train_one_step``, ``get_batch`` and ``loss_function``), over one rollout of :data:`SAMPLES`."""
    import importlib

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    mods = {k: importlib.import_module(f"slime.backends.megatron_utils.{k}")
            for k in ("initialize", "model", "data", "loss", "cp_utils")}
    from slime.observability import logging_utils
    os.makedirs(out, exist_ok=True)
    args = make_source_args(scenario, pp, cp, adapter)
    fresh_job(scenario, out, mods)
    logging_utils.LOGGED.clear()
    plant_source(scenario, mods)
    # initialize.py:66 asserts numpy 1.x (NVIDIA/Megatron-LM#1563: Megatron's checkpointing and datasets); the
    # venv's numpy is 2.x and nothing of this run reaches what the assertion guards: the version reads 1.x there
    version = np.__version__
    np.__version__ = "1.26.4"
    try:
        with cuda_rng_on_cpu():
            mods["initialize"].init(args)
    finally:
        np.__version__ = version
    chunks, opt, sched = mods["model"].setup_model_and_optimizer(args)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rd, mbi = rollout_data(dp, dp_rank)
    # what slime's actor hands train_actor (actor.py:257-268 @624b824): tokens long, loss masks int, the
    # per-rollout mask totals one float32 tensor (rollout_data); its schedule (micro_batch_indices,
    # num_microbatches, global_batch_sizes: the rollouts of each step over DP)
    rd.update(micro_batch_indices=mbi, num_microbatches=[M] * STEPS, global_batch_sizes=[GBS] * STEPS)
    its = mods["data"].get_data_iterator(rd)
    rd.update(mods["model"].forward_only(mods["loss"].get_log_probs_and_entropy, args, chunks, its,
                                         rd["num_microbatches"], store_prefix="", use_rollout_top_p_replay=True))
    result = {"real_src": {"dir": os.path.join(SLIME_SOURCE, source_tier()["commit"]), "real": SRC_REAL,
                           "loaded": {k: os.path.abspath(m.__file__) for k, m in sorted(mods.items())}}}
    train = slime_train(mods, chunks, opt, sched, its, rd["num_microbatches"], rd["global_batch_sizes"])
    try:
        _train_and_record(mods, chunks, opt, out, adapter, result, train)
    finally:
        destroy_num_microbatches_calculator()
    with open(os.path.join(out, f"logged-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(logging_utils.LOGGED, f)


# ---- the reference: sum_t w_t grad(l_t) on the whole float64 model ---------------------------------------
def policy_token_losses(cfg, logp, T, R, mask, off):
    """The policy's per-token losses at the logit positions of a sample (float64, differentiable in ``logp``):
    PPO's clipped surrogate max(-r A, -clip(r, 1 - 0.2, 1 + 0.28) A), r = exp(log p - old log p) — on-policy
    (``off`` None: old = log p detached, A = 1; its gradient is the cross entropy's), else the rollout's old
    log-probs and advantage; TIS: x clamp(exp(old - rollout), tis_clip_low, tis_clip); OPSM: x 0 for a sample
    with A < 0 whose mean over its mask of old - log p exceeds opsm_delta.  Written from the formulas, not from
    Relax's code (ppo_utils.compute_policy_loss, loss.vanilla_tis_function, ppo_utils.compute_opsm_mask)."""
    old = logp.detach().clone()
    adv = torch.ones_like(logp)
    factor = torch.ones_like(logp)
    if off is not None:
        pos = slice(T - R - 1, T - 1)
        old[pos] = off["old"].double()
        adv[pos] = off["adv"]
        if cfg.get("use_tis"):
            factor[pos] = torch.exp(off["old"].double() - off["rollout"].double()).clamp(cfg["tis_clip_low"],
                                                                                          cfg["tis_clip"])
        if cfg.get("use_opsm"):
            mk = torch.tensor(mask, dtype=torch.float64)
            seq_kl = ((old[pos] - logp[pos].detach()) * mk).sum() / max(float(mk.sum()), 1.0)
            if off["adv"] < 0 and float(seq_kl) > cfg["opsm_delta"]:
                factor = factor * 0
    ratio = torch.exp(logp - old)
    return torch.maximum(-ratio * adv, -ratio.clamp(1 - 0.2, 1 + 0.28) * adv) * factor


def reference(d, layers, scenarios):
    """For each scenario's adapter run and step: the applied gradient (one DP x CP replica's main_grad, the
    stages assembled) and sum over terms and tokens of w_t grad(l_t) with the captured weights: the policy
    loss (:func:`policy_token_losses`: on-policy PPO with advantage 1 has grad = grad CE; off-policy, the
    clipped surrogate at the rollout's old log-probs and advantages, x TIS, x OPSM), SFT's -log p, the entropy
    and the k1 KL (grad = -grad CE), each token's loss recomputed in float64 on the whole model from the sample
    alone.  Also ``want_cross_entropy``: the same sum with every policy token's loss taken as its cross entropy
    (the on-policy identity), which an off-policy step must NOT match (the tests show it rejected)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import lossguard_capture as lc
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    ps.initialize_model_parallel()
    for scenario in scenarios:
        out = os.path.join(d, scenario, "adapter")
        cfg = dict(globals()["scenarios"]().get(scenario, {}))
        off = {}                               # off-policy: the rollout's old log-probs, advantages (the driver's)
        for f in sorted(os.listdir(out)):
            if f.startswith("offpolicy-rank"):
                off.update(torch.load(os.path.join(out, f)))
        for step in range(STEPS):
            sd = os.path.join(out, "captures", f"step{step:06d}")
            caps = []
            for f in sorted(os.listdir(sd)):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(sd, f), framework="pt") as h:
                        caps.append((load_file(os.path.join(sd, f)), h.metadata()))
            replica = [int(m["rank"]) for _, m in caps if m["dp_rank"] == "0" and m["cp_rank"] == "0"]
            grads = shapes.whole([torch.load(os.path.join(out, f"grads-step{step}-rank{r}.pt")) for r in replica])
            params = {}
            for r in replica:
                params.update(torch.load(os.path.join(out, f"params-step{step}-rank{r}.pt")))
            with cuda_on_cpu():
                torch.manual_seed(SEED)
                model = GPTModel(config=shapes.make_config_whole(layers), transformer_layer_spec=base.layer_spec(),
                                 vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="none",
                                 share_embeddings_and_output_weights=False)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n])
            model = model.double()
            W = {t: [torch.zeros(T, dtype=torch.float64) for T, _, _, _ in SAMPLES[step]] for t in ("main", "entropy", "kl")}
            seen = [torch.zeros(T, dtype=torch.int64) for T, _, _, _ in SAMPLES[step]]
            first = {int(i): None for i in range(len(SAMPLES[step]))}
            for t, meta in caps:
                if int(meta["pp_rank"]) != int(meta["pp"]) - 1:
                    continue
                gs = t["grad_scale"].double().item()
                for k in range(int(meta["num_microbatches"])):
                    if f"mb.{k}.dummy" in t and int(t[f"mb.{k}.dummy"]):
                        assert float(t[f"mb.{k}.token_weight"].abs().sum()) == 0.0        # its loss is x 0
                        continue
                    cpk = int(t[f"mb.{k}.cp_size"]) if f"mb.{k}.cp_size" in t else int(meta["cp"])
                    r = int(meta["cp_rank"]) % cpk
                    ws = {"main": t[f"mb.{k}.token_weight"]}
                    for term in ("entropy", "kl"):
                        if f"mb.{k}.term.{term}.token_weight" in t:
                            ws[term] = t[f"mb.{k}.term.{term}.token_weight"]
                    at = 0
                    for i, T, R in zip(t[f"mb.{k}.sample_indices"].tolist(), t[f"mb.{k}.total_lengths"].tolist(),
                                       t[f"mb.{k}.response_lengths"].tolist()):
                        i -= step * len(SAMPLES[step])           # partition: global positions over the rollout
                        first[i] = True
                        for j in lc.zigzag_owned(T, R, cpk, r):
                            for term, w in ws.items():
                                W[term][i][T - R - 1 + j] += float(w[at]) * gs
                            seen[i][T - R - 1 + j] += 1
                            at += 1
            total, wrong = 0, 0      # wrong: the on-policy identity (grad = the cross entropy's) on any step
            toks = tokens(step)
            for i, (T, R, m, _) in enumerate(SAMPLES[step]):
                logits = model(toks[i][None], None, None)[0]                    # [T, V]
                labels = torch.cat([toks[i][1:], torch.zeros(1, dtype=torch.int64)])
                ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
                logp = torch.log_softmax(logits, dim=-1)
                entropy = -(logp.exp() * logp).sum(-1)
                main = ce if cfg.get("loss_type") in ("sft", "sft_loss") else \
                    policy_token_losses(cfg, -ce, T, R, m, off.get(step * len(SAMPLES[step]) + i))
                # k1 KL against reference log-probs 0: the per-token KL is log p = -ce
                total = total + (W["main"][i] * main - W["kl"][i] * ce).sum() + (W["entropy"][i] * entropy).sum()
                wrong = wrong + ((W["main"][i] - W["kl"][i]) * ce).sum() + (W["entropy"][i] * entropy).sum()
            names = [n for n, _ in model.named_parameters()]
            params = [p for _, p in model.named_parameters()]
            if not isinstance(wrong, torch.Tensor) or not wrong.requires_grad:
                wrong = sum(p.sum() for p in params) * 0
            w_ce = torch.autograd.grad(wrong, params, retain_graph=True, allow_unused=True)
            total.backward()
            torch.save({"want": {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                 for n, p in model.named_parameters()},
                        "want_cross_entropy": {n: torch.zeros_like(p) if g is None else g.detach().clone()
                                               for n, p, g in zip(names, params, w_ce)},
                        "got": grads, "seen": seen, "held": first}, os.path.join(out, f"ref-step{step}.pt"))
    ps.destroy_model_parallel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--reference")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--scenarios", default="pt,sm")
    ap.add_argument("--trainer", choices=("slime", "relax"), default="slime")
    ap.add_argument("--slime-src", help="a folder holding slime's real modules (slime/...): they replace the "
                                        "shape's (scripts/slime-src.sh)")
    ap.add_argument("--slime-source", help="a folder holding slime's real files as <commit>/<path> "
                                           "(scripts/slime-src.sh): slime's own training step at "
                                           "tests/trainers/slime_source_manifest.json's commit")
    ap.add_argument("--relax-src", help="a folder holding Relax's real files as <commit>/<path> "
                                        "(scripts/relax-src.sh): the manifest's tier replaces the shape's modules")
    a = ap.parse_args()
    global TRAINER, SLIME_SRC, RELAX_SRC, SRC_REAL, TRANSPLANTED, SLIME_SOURCE
    TRAINER = a.trainer
    if a.slime_source:
        assert TRAINER == "slime" and not a.slime_src, "--slime-source is slime's, alone"
        SLIME_SOURCE = os.path.abspath(a.slime_source)
        SRC_REAL = overlay_slime_source(SLIME_SOURCE)
    if a.slime_src:
        assert TRAINER == "slime", "--slime-src is slime's"
        SLIME_SRC = os.path.abspath(a.slime_src)
        SRC_REAL = overlay_slime(SLIME_SRC)
    if a.relax_src:
        assert TRAINER == "relax", "--relax-src is Relax's"
        RELAX_SRC = os.path.abspath(a.relax_src)
        with cuda_on_cpu():
            SRC_REAL, TRANSPLANTED = overlay_relax(RELAX_SRC)
    sys.modules.setdefault("slime_relax_driver", sys.modules[__name__])    # the hooks loaded by dotted path
    scenarios = [s for s in a.scenarios.split(",") if s]
    if a.reference:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        try:
            reference(a.reference, a.pp, [s for s in scenarios if s not in PLANTED and s not in SOURCE_PLANTS])
        finally:
            dist.destroy_process_group()
        return
    dist.init_process_group("gloo")
    try:
        if SLIME_SOURCE:
            with cuda_on_cpu():
                cpu_accelerator()
                for scenario in scenarios:
                    for adapter in ((True,) if scenario in PLANTED or scenario in SOURCE_PLANTS else (True, False)):
                        run_source(scenario, os.path.join(a.out, scenario, "adapter" if adapter else "plain"), a.pp,
                                   a.cp, adapter)
            return
        with cuda_on_cpu():
            for scenario in scenarios:
                for adapter in ((True,) if scenario in PLANTED else (True, False)):
                    run(scenario, os.path.join(a.out, scenario, "adapter" if adapter else "plain"), a.pp, a.cp, adapter)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
