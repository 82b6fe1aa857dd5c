#!/usr/bin/env python3
"""Runs megatron-core's real training step at the shapes its RL trainers run — pipeline stages (the 1F1B
schedule, ``forward_backward_pipelining_without_interleaving``, and with ``--vpp`` model chunks the
interleaved one), tensor parallelism, context parallelism, packed (THD) micro-batches —
with a loss function over LOGITS that forms its own per-token losses (Megatron's
``tensor_parallel.vocab_parallel_cross_entropy`` over the TP group, as Relax's loss and slime's log-probs
use its fused twin), Megatron's ``OptimizerParamScheduler``, and a loop that makes the skip decision of
Relax PR #285 itself: a step whose global effective token count is 0 steps neither the optimizer nor the
scheduler, on every stage.  Each scenario twice from the same seed, with the adapter and without, as
tests/trainers/test_megatron_shapes.py compares; then ``--reference`` (one process) recomputes
``sum_t w_t grad(l_t)`` from the captures on the whole float64 model.

    torchrun --standalone --nproc-per-node $((PP*TP*CP*DP)) tests/trainers/megatron_shapes_driver.py \\
        --out DIR --pp 2 --tp 1 --cp 1 --scenarios pt,global,first-stage-src,sample-count
    python tests/trainers/megatron_shapes_driver.py --reference DIR --pp 2 --tp 1 --cp 1 --scenarios pt,global

The model: megatron_driver.py's tiny GPTModel (vocabulary 32, hidden 16, attention IdentityOp so that CP
runs without Transformer Engine), one layer per pipeline stage, untied output layer.  The batch: 4 rows of
8 positions (THD: THD_SAMPLES, 4 samples of 3-9 tokens), M = 2 micro-batches; step 0 has empty rows (a fully masked micro-batch at every layout) and a
row a CP rank owns no token of; step 1 has no effective token at all.

Scenarios (the loss function receives the logits ``[b, s/cp, V/tp]`` and hands its per-token cross entropy
to ``audit.per_token``):
  pt            calculate_per_token_loss: (sum_t m_t l_t, CP-local count, report)      w_t = m_t / N
  pt-entropy    pt minus ENTROPY_COEF x the per-token entropy of the logits, handed over as the declared term
                ``entropy`` (coef -ENTROPY_COEF): a second term of the objective (SPEC §11; TP 1)
  global        no per-token loss: (sum_t m_t l_t * M * dp*cp / N, 1, report), N the step's count, each DP
                rank's rows all-reduced over the DP group before the step (a global token mean; Megatron
                divides by M and DDP by dp*cp)
  first-stage-src  pt, the decision broadcast over the pipeline group from its FIRST stage (a pipeline-local
                source), which computes no loss: every stage skips the non-empty step 0 (planted bug; the seed's
                third).  A decision that differs between stages is not planted: the stepping stage's
                optimizer.step() waits forever in the gradient norm's all-reduce over the model-parallel
                group — the seed's deadlock, which no capture of that step can record
  sample-count  global, deciding from the 3-tuple's count (a constant 1 per micro-batch, slime's non-per-token
                contract): a fully masked step still steps (planted bug: the seed's review finding)
  thd, thd-owned, thd-dyncp   pt on packed (THD) micro-batches split per sample as slime splits them (each
                sample padded to a multiple of 2*CP, CP rank r holding chunks r and 2cp-1-r), handed over with
                audit.packed_loss_func: as the packed stream [1, L], as the owned response tokens in local order
                (slime's pg_loss), and with micro-batch 1 at CP size 1 (Relax's dynamic CP: each CP rank trains
                its own share of the samples)
  thd-dummy     thd whose micro-batch 1 is a padding micro-batch (Relax's __is_dummy__: micro-batch 0's
                samples again with their masks zeroed, the loss x 0, dummy=True): samples 2-3 are not in the
                step
  thd-off-by-one   thd with the loss mask read one stream position late (planted: a THD split off by one)
  thd-unannounced  a packed micro-batch handed to the row-wise audit.loss_func: refused (planted misuse)
  thd-split-off    a THD split off by one token (each piece starts one position late): the adapter, given
                the stream it was fed (stream_tokens=), refuses it naming the sample and position
  tp-as-dp      global with N all-reduced over the whole world: TP replicas counted as DP ranks (planted bug,
                transformers #39674's shape): w_t = m_t / (tp N) (at CP 1)

Per scenario and run (``DIR/<scenario>/{adapter,plain}/``): ``losses-rank{r}.pt``, ``grads-step{n}-rank{r}.pt``
(``main_grad`` after finalize_model_grads, by the WHOLE model's parameter names, with each tensor-parallel
parameter's partition), ``params-step{n}-rank{r}.pt``, ``final-rank{r}.pt``, ``opt-rank{r}.json`` (per step:
stepped or not, what optimizer.step() returned, the scheduler's learning rate after the step); adapter runs
``captures/step{n:06d}/``.  ``--reference`` writes ``<scenario>/adapter/ref-step{n}.pt``.
"""
import argparse
import json
import os
import sys
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)

import megatron_driver as base  # noqa: E402  (imports megatron.core through megatron_cpu.import_megatron_core)
from lossguard_capture.megatron_cpu import HITS, cuda_on_cpu  # noqa: E402

SEED, VOCAB, S, ROWS, M, STEPS = base.SEED, base.VOCAB, base.S, base.ROWS, 2, 2
ZERO = [[0] * S for _ in range(ROWS)]
#: step 0: rows 0 and 1 empty (a fully masked micro-batch at every DP size: micro-batch 0 holds rows 0-1 at
#: DP 1, row 0 or row 1 at DP 2), row 3's tokens all on CP rank 0 at CP 2 (CP rank 1 owns none of it);
#: step 1: no effective token at all
MASKS = [[[0] * S, [0] * S, [0, 1, 1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 1, 0]], ZERO]
LOCAL_KEYS = base.LOCAL_KEYS
ENTROPY_COEF = 0.05                      # pt-entropy: the loss is pg - ENTROPY_COEF * entropy (an entropy bonus)
SCENARIOS = {                            # scenario -> (calculate_per_token_loss, loss kind, decision)
    "pt": (True, "sum", "broadcast"),
    "pt-entropy": (True, "sum-entropy", "broadcast"),
    "global": (False, "global-dpcp", "broadcast"),
    "first-stage-src": (True, "sum", "first-stage-src"),
    "sample-count": (False, "global-dpcp", "sample-count"),
    "tp-as-dp": (False, "global-world", "broadcast"),
}
PLANTED = ("first-stage-src", "sample-count", "sample-count-ff", "tp-as-dp", "thd-off-by-one",
           "thd-unannounced", "thd-split-off")   # with the adapter only
REFUSED = ("thd-unannounced", "thd-split-off")          # the adapter must refuse these at run time
SCENARIOS["sample-count-ff"] = SCENARIOS["sample-count"]        # with fail fast on step 1
from harness import LOSSGUARD  # noqa: E402  (the binary under test: one definition)
#: THD (packed) scenarios: slime's layout, per-token loss, the loop's decision broadcast as in pt
THD = {"thd": "stream", "thd-owned": "owned", "thd-dyncp": "stream", "thd-dummy": "stream",
       "thd-off-by-one": "stream", "thd-unannounced": "stream", "thd-split-off": "stream"}
for _name in THD:
    SCENARIOS[_name] = (True, "sum", "broadcast")
#: each step's 4 samples (T, R, response mask): step 0 with a sample shorter than 2*CP (T = 3), a fully
#: masked micro-batch (samples 2 and 3) and, at CP 2, a CP rank that owns no token of a sample (T = 7, R = 2:
#: rank 0's chunks hold logits 0-1 and 6-7, the response's logits are 4-5); step 1 without an effective
#: token (an empty response among them)
THD_SAMPLES = [
    [(7, 2, [1, 1]), (3, 2, [1, 1]), (9, 5, [0, 0, 0, 0, 0]), (6, 4, [0, 0, 0, 0])],
    [(5, 2, [0, 0]), (4, 0, []), (8, 3, [0, 0, 0]), (3, 1, [0])],
]
THD_MAXLEN = 16                     # learned positions: a padded sample's local positions stay below it


def make_config(pp, tp, cp, per_token, vpp=1):
    from megatron.core.transformer.transformer_config import TransformerConfig
    extra = dict(virtual_pipeline_model_parallel_size=vpp) if vpp > 1 else {}
    return TransformerConfig(num_layers=pp * vpp, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                             use_cpu_initialization=True, calculate_per_token_loss=per_token,
                             context_parallel_size=cp, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                             batch_p2p_comm=False, hidden_dropout=0.0, attention_dropout=0.0, **extra)


def make_model(config, pre_process=True, post_process=True, vp_stage=None):
    from megatron.core.models.gpt import GPTModel
    torch.manual_seed(SEED)
    extra = {} if vp_stage is None else dict(vp_stage=vp_stage)
    return GPTModel(config=config, transformer_layer_spec=base.layer_spec(), vocab_size=VOCAB,
                    max_sequence_length=THD_MAXLEN, position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=False, pre_process=pre_process, post_process=post_process,
                    **extra)


def named_params(chunks):
    """Every parameter of this rank's model chunks by its name in the WHOLE model: a chunk's local layer ``j``
    is the whole model's layer ``layer_number - 1`` (Megatron numbers its layers globally, from 1)."""
    for ddp in chunks:
        layers = ddp.module.decoder.layers
        for n, p in ddp.module.named_parameters():
            parts = n.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(layers[int(parts[2])].layer_number - 1)
            yield ".".join(parts), p


def build(pp, tp, cp, per_token, vpp=1):
    """This stage's model chunks (one, or ``vpp`` with the interleaved schedule; the same initial weights at
    every layout), each in Megatron's DDP, the optimizer and the LR scheduler, wired as Megatron-LM's
    training loop wires them."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    config = make_config(pp, tp, cp, per_token, vpp)
    if vpp > 1:
        models = [make_model(config, ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                             ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i), vp_stage=i)
                  for i in range(vpp)]
    else:
        models = [make_model(config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())]
    chunks = [DDP(config, DistributedDataParallelConfig(), m, disable_bucketing=i > 0) for i, m in enumerate(models)]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, min_lr=0.05, weight_decay=0.0,
                                                 clip_grad=0.0, bf16=False, fp16=False), chunks)
    sched = OptimizerParamScheduler(opt, init_lr=0.5, max_lr=0.5, min_lr=0.05, lr_warmup_steps=0,
                                    lr_decay_steps=4, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=4, wd_incr_style="constant")
    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return config, chunks, opt, sched


# ---- the user's loss function: logits in, its own per-token cross entropy --------------------------------
# ---- THD: slime's packing, written here from its description (docs/semantics.md §2), not from lossguard ----
def thd_tokens(step):
    g = torch.Generator().manual_seed(SEED + 31 * step)
    return [torch.randint(1, VOCAB, (T,), generator=g) for T, _, _ in THD_SAMPLES[step]]


def thd_pieces(T, cp, r, shift=False):
    """The positions of a sample this CP rank holds, in local order (padding positions >= T included):
    chunks r and 2cp-1-r of the sample padded to a multiple of 2cp (cp 1: the sample, unpadded).
    ``shift`` (planted): every piece one position late."""
    if cp == 1:
        return list(range(T))
    cs = -(-T // (2 * cp))
    return [p + shift for k in (r, 2 * cp - 1 - r) for p in range(k * cs, (k + 1) * cs)]


def thd_microbatches(step, scenario, dp, dp_rank, cp, cp_rank):
    """This rank's packed micro-batches: micro-batch k of DP rank d holds samples (k*dp + d)*b ... (b = 4 / (M dp));
    thd-dyncp trains micro-batch 1 at CP size 1, the CP ranks of the group each on their own share of its
    samples (consecutive CP ranks form the sub-groups)."""
    toks = thd_tokens(step)
    b = len(THD_SAMPLES[step]) // (M * dp)
    out = []
    for k in range(M):
        ids = list(range((k * dp + dp_rank) * b, (k * dp + dp_rank) * b + b))
        cpk, r = cp, cp_rank
        dummy = scenario == "thd-dummy" and k == 1
        if dummy:       # a padding micro-batch: micro-batch 0's samples again, masked, the loss x 0 (SPEC §10)
            ids = list(range(dp_rank * b, dp_rank * b + b))
        if scenario == "thd-dyncp" and k == 1 and cp > 1:
            cpk, r = 1, 0
            share = len(ids) // cp
            ids = ids[cp_rank * share:(cp_rank + 1) * share]
        stream_tok, stream_pos, stream_lab, stream_mask, owned = [], [], [], [], []
        for i in ids:
            T, R, m = THD_SAMPLES[step][i]
            if dummy:
                m = [0] * R
            P = T - R
            for p in thd_pieces(T, cpk, r, shift=scenario == "thd-split-off"):
                if P - 1 <= p < T - 1:          # a logit predicting response token p+1 (SPEC §2's ownership)
                    owned.append(len(stream_tok))
                stream_tok.append(int(toks[i][p]) if p < T else 0)
                stream_pos.append(p)
                stream_lab.append(int(toks[i][p + 1]) if p + 1 < T else 0)
                stream_mask.append(float(m[p + 1 - P]) if P - 1 <= p < T - 1 else 0.0)
        if scenario == "thd-off-by-one":        # planted: the mask read one position late (a split off by one)
            stream_mask = [0.0] + stream_mask[:-1]
        while len(stream_tok) % 4:              # the stream padded to a multiple of tp x 2 (ignored)
            stream_tok.append(0), stream_pos.append(0), stream_lab.append(0), stream_mask.append(0.0)
        out.append({"tokens": torch.tensor([stream_tok]), "position_ids": torch.tensor([stream_pos]),
                    "labels": torch.tensor([stream_lab]), "loss_mask": torch.tensor([stream_mask]),
                    "owned": torch.tensor(owned, dtype=torch.int64), "cp_size": cpk, "dummy": dummy,
                    "sample_indices": torch.tensor(ids, dtype=torch.int64),
                    "full_tokens": [toks[i] for i in ids],
                    "total_lengths": torch.tensor([THD_SAMPLES[step][i][0] for i in ids]),
                    "response_lengths": torch.tensor([THD_SAMPLES[step][i][1] for i in ids]),
                    "loss_masks": [torch.tensor([0] * THD_SAMPLES[step][i][1] if dummy else THD_SAMPLES[step][i][2],
                                                dtype=torch.int64) for i in ids]})
    return out


def step_count(kind, mbs):
    """N for the global mean (kinds global-*), known before the step as slime knows its rollouts' mask sums:
    this DP rank's full rows' mask total, all-reduced over the DP group — or, planted (global-world), over
    the whole world, where every TP (and CP) replica adds the same rows again."""
    from megatron.core import parallel_state as ps
    n = sum(mb["loss_mask"].sum() for mb in mbs).double().reshape(())
    group = None if kind == "global-world" else ps.get_data_parallel_group()
    dist.all_reduce(n, group=group)
    return n


def loss_over_logits(kept, kind, audit, step_n, local, logits):
    """``logits`` [b, s/cp, V/tp] (GPTModel without labels); the per-token cross entropy over the TP group."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    entropy = None
    if kind == "sum-entropy":
        # before the cross entropy: Megatron's vocab_parallel_cross_entropy turns its input into the softmax in
        # place (tensor_parallel/cross_entropy.py: exp and div into the logits' storage), so an entropy taken
        # from the same logits afterwards is the entropy of other numbers (slime clones the logits first)
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)                                   # [b, s/cp] (TP 1)
    token_loss = vocab_parallel_cross_entropy(logits.float(), local["labels"])        # [b, s/cp]; THD [1, L]
    if audit is not None and local.get("owned_order"):
        # slime's shape: the owned response tokens of each sample, in local order, as their own tensor
        owned = token_loss[0, local["owned"]]
        audit.per_token(owned)
        token_loss = torch.zeros_like(token_loss).index_put((torch.zeros_like(local["owned"]), local["owned"]), owned)
    elif audit is not None:
        token_loss = audit.per_token(token_loss)
    mask = local["loss_mask"].float()
    total = torch.sum(token_loss * mask)
    count = mask.sum().to(torch.int)
    if entropy is not None:         # slime's policy loss shape: pg - entropy_coef * entropy, each summed per token
        if audit is not None:
            entropy = audit.per_token(entropy, term="entropy")
        total = total - ENTROPY_COEF * torch.sum(entropy * mask)
    if kind in ("sum", "sum-entropy"):
        loss, num_tokens = total, count.clone().detach()
    else:
        dpcp = ps.get_data_parallel_world_size(with_context_parallel=True)
        loss = total * (M * dpcp) / torch.clamp(step_n[0], min=1)
        num_tokens = torch.tensor(1, dtype=torch.int)           # slime's non-per-token contract: a constant 1
    if local.get("dummy"):                      # Relax's __is_dummy__: the loss times 0, nothing counted
        loss, num_tokens = loss * 0, torch.zeros_like(num_tokens)
    kept.append(loss)
    return loss, num_tokens, {"count": count.view(1).clone().detach(), "num_tokens": num_tokens.view(1)}


def decide_skip(decision, reports):
    """The loop's skip decision (every rank).  ``broadcast``: the count the last stage's reports hold,
    all-reduced over DP x CP, broadcast from the last stage's GLOBAL rank over the pipeline group (Relax after
    PR #285).  ``first-stage-src``: broadcast from the pipeline group's first stage, which has no reports
    (planted).  ``sample-count``: from the 3-tuple's num_tokens, a constant 1 per micro-batch (planted)."""
    from megatron.core import parallel_state as ps
    key = "num_tokens" if decision == "sample-count" else "count"
    t = torch.tensor(sum(int(r[key].sum()) for r in reports), dtype=torch.int64)
    dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        src = (ps.get_pipeline_model_parallel_first_rank() if decision == "first-stage-src"
               else ps.get_pipeline_model_parallel_last_rank())
        dist.broadcast(t, src=src, group=ps.get_pipeline_model_parallel_group())
    return int(t) == 0


def save_grads(chunks, path, tp_rank):
    out = {}
    for n, p in named_params(chunks):
        out[n] = {"grad": p.main_grad.detach().clone(),
                                       "partition_dim": int(getattr(p, "partition_dim", -1))
                                       if getattr(p, "tensor_model_parallel", False) else -1, "tp_rank": tp_rank}
    torch.save(out, path)


def run(scenario, out, pp, tp, cp, adapter, vpp=1):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.utils import get_batch_on_this_cp_rank

    rank = dist.get_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    per_token, kind, decision = SCENARIOS[scenario]
    os.makedirs(out, exist_ok=True)
    config, chunks, opt, sched = build(pp, tp, cp, per_token, vpp)
    audit = None
    if adapter:
        import lossguard_capture.megatron as lcm
        ff = scenario.endswith("-ff")
        # a refused scenario's step 0 is audited with fail fast: what the adapter cannot measure stops it (without
        # fail fast it would be a warning and the run would go on: lossguard_capture.megatron._fail)
        refused = scenario in REFUSED
        terms = {"entropy": dict(reduce="per-token", coef=-ENTROPY_COEF)} if kind == "sum-entropy" else None
        audit = lcm.attach(config, os.path.join(out, "captures"),
                           steps=(1,) if ff else (0,) if refused else range(STEPS),
                           fail_fast=ff or refused, model=chunks, optimizer=opt, scheduler=sched, lossguard_bin=LOSSGUARD,
                           timeout=120, terms=terms)
    kept = []

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if scenario in THD:
            from megatron.core.packed_seq_params import PackedSeqParams
            local = dict(mb, owned_order=THD[scenario] == "owned")
            L = mb["tokens"].shape[1]
            cu = torch.tensor([0, L], dtype=torch.int32)
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=L, max_seqlen_kv=L)
            output = model(mb["tokens"], mb["position_ids"], None, packed_seq_params=psp)
            fn = partial(loss_over_logits, kept, kind, audit, step_n, local)
            if audit is not None and scenario == "thd-unannounced":     # the packed stream handed over as a row
                return output, audit.loss_func(fn, tokens=mb["tokens"], loss_mask=mb["loss_mask"],
                                               sample_indices=mb["sample_indices"][:1])
            if audit is not None:
                fn = audit.packed_loss_func(fn, sample_indices=mb["sample_indices"], tokens=mb["full_tokens"],
                                            total_lengths=mb["total_lengths"], response_lengths=mb["response_lengths"],
                                            loss_masks=mb["loss_masks"], cp_size=mb["cp_size"], dummy=mb["dummy"],
                                            stream_tokens=mb["tokens"])
            return output, fn
        local = get_batch_on_this_cp_rank({k: mb[k].clone() for k in LOCAL_KEYS})
        output = model(local["tokens"], local["position_ids"], None)     # no labels: logits (last stage)
        fn = partial(loss_over_logits, kept, kind, audit, step_n, local)
        if audit is not None:
            fn = audit.loss_func(fn, tokens=mb["tokens"], loss_mask=mb["loss_mask"],
                                 sample_indices=mb["sample_indices"])
        return output, fn

    fb = get_forward_backward_func()
    step_n = [None]
    if scenario in REFUSED:
        err = None
        try:
            with audit.step(0, global_batch_size=ROWS):
                fb(forward_step_func=forward_step,
                   data_iterator=iter(thd_microbatches(0, scenario, dp, dp_rank, cp, ps.get_context_parallel_rank())),
                   model=chunks, num_microbatches=M, seq_length=THD_MAXLEN, micro_batch_size=1)
        except RuntimeError as e:
            err = str(e)
        with open(os.path.join(out, f"guard-rank{rank}.json"), "w") as f:
            json.dump({"error": err, "captures": os.path.exists(os.path.join(out, "captures"))}, f)
        dist.barrier()
        return
    losses, opt_out = [], []
    for step in range(STEPS):
        if scenario in THD:
            mbs = thd_microbatches(step, scenario, dp, dp_rank, cp, ps.get_context_parallel_rank())
        else:
            mbs = base.microbatches(step, dp, dp_rank, MASKS)
        if kind != "sum":
            step_n[0] = step_count(kind, mbs)
        torch.save({n: p.detach().clone() for n, p in named_params(chunks)},
                   os.path.join(out, f"params-step{step}-rank{rank}.pt"))
        for ddp in chunks:
            ddp.zero_grad_buffer()
        opt.zero_grad()
        kept.clear()
        gbs = ROWS // 2 if scenario == "thd-dummy" else ROWS        # the dummy micro-batch repeats samples
        ctx = audit.step(step, global_batch_size=gbs) if audit is not None else base._Null()
        before = {n: p.detach().clone() for n, p in named_params(chunks)}
        try:
            rec = train_step(ctx, fb, forward_step, mbs, chunks, opt, sched, scenario, decision, out, step, rank,
                             tp_rank, cp, dp)
        except Exception as e:          # fail fast: AuditFailed from optimizer.step(), before the update
            from lossguard_capture import AuditFailed
            if not isinstance(e, AuditFailed):
                raise
            rec = {"audit_failed": {"step": e.step, "exit_code": e.exit_code}, "params_unchanged": all(
                torch.equal(p.detach(), before[n]) for n, p in named_params(chunks)),
                "lr": float(opt.param_groups[0]["lr"])}
        losses.append([x.detach().clone() for x in kept])
        opt_out.append(rec)
    torch.save(losses, os.path.join(out, f"losses-rank{rank}.pt"))
    torch.save({n: p.detach().clone() for n, p in named_params(chunks)}, os.path.join(out, f"final-rank{rank}.pt"))
    with open(os.path.join(out, f"opt-rank{rank}.json"), "w") as f:
        json.dump(opt_out, f)
    dist.barrier()


def train_step(ctx, fb, forward_step, mbs, chunks, opt, sched, scenario, decision, out, step, rank, tp_rank, cp, dp):
    """One iteration inside the adapter's step (or a null context): forward-backward, then the loop's own
    decision — the optimizer and the scheduler step together, or neither."""
    with ctx:
        seq = max(mb["tokens"].shape[1] for mb in mbs) * cp if scenario in THD else S
        reports = fb(forward_step_func=forward_step,
                     data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs), model=chunks,
                     num_microbatches=M, seq_length=seq,
                     micro_batch_size=1 if scenario in THD else ROWS // (M * dp))
        save_grads(chunks, os.path.join(out, f"grads-step{step}-rank{rank}.pt"), tp_rank)
        skip = decide_skip(decision, reports)
        rec = {"skipped": skip}
        if not skip:
            ok, grad_norm, _ = opt.step()
            sched.step(increment=1)
            rec.update(update_successful=bool(ok), grad_norm=None if grad_norm is None else float(grad_norm))
        rec["lr"] = float(opt.param_groups[0]["lr"])
    return rec


# ---- the reference: sum_t w_t grad(l_t) on the whole float64 model ---------------------------------------
def whole(per_rank):
    """The whole model's tensors from every rank's {name: {grad|value, partition_dim, tp_rank}}: each
    tensor-parallel parameter concatenated over its TP ranks along its partition dimension."""
    parts = {}
    for d in per_rank:
        for name, e in d.items():
            parts.setdefault(name, {})[e["tp_rank"]] = e
    out = {}
    for name, by_tp in parts.items():
        first = by_tp[min(by_tp)]
        if first["partition_dim"] < 0:
            out[name] = first["grad"]
        else:
            out[name] = torch.cat([by_tp[r]["grad"] for r in sorted(by_tp)], dim=first["partition_dim"])
    return out


def reference(d, layers, scenarios):
    """One process: for each scenario's adapter run and step, the applied gradient every rank's main_grad
    assembles (one DP x CP replica: the ranks of DP 0 CP 0) and sum_t w_t grad(l_t) with the captured weights
    w_t = token_weight_t * grad_scale, l_t the float64 cross entropy of the whole model with the step's
    parameters on the full rows (``layers``: the whole model's, every stage's and chunk's)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import lossguard_capture as lc
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel()
    for scenario in scenarios:
        out = os.path.join(d, scenario, "adapter")
        for step in range(STEPS):
            caps = []
            sd = os.path.join(out, "captures", f"step{step:06d}")
            for f in sorted(os.listdir(sd)):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(sd, f), framework="pt") as h:
                        caps.append((load_file(os.path.join(sd, f)), h.metadata()))
            replica = [int(m["rank"]) for _, m in caps if m["dp_rank"] == "0" and m["cp_rank"] == "0"]
            grads = whole([torch.load(os.path.join(out, f"grads-step{step}-rank{r}.pt")) for r in replica])
            params = whole([{n: {"grad": v, **meta} for n, v, meta in
                             _with_partition(torch.load(os.path.join(out, f"params-step{step}-rank{r}.pt")),
                                             torch.load(os.path.join(out, f"grads-step{step}-rank{r}.pt")))}
                            for r in replica])
            model = _whole_model(layers)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n])
            model = model.double()
            if scenario in THD:
                thd_reference(out, step, model, caps, grads)
                continue
            full = base.batch(step, MASKS)
            W = torch.zeros(ROWS, S, dtype=torch.float64)
            W_ent = torch.zeros(ROWS, S, dtype=torch.float64)          # pt-entropy's second term
            seen = torch.zeros(ROWS, S, dtype=torch.int64)
            for t, meta in caps:
                if int(meta["pp_rank"]) != int(meta["pp"]) - 1 or int(meta["tp_rank"]) != 0:
                    continue
                r_cp = int(meta["cp_rank"])
                gs = t["grad_scale"].double().item()
                for k in range(int(meta["num_microbatches"])):
                    w = t[f"mb.{k}.token_weight"].double() * gs
                    w_ent = t.get(f"mb.{k}.term.entropy.token_weight")
                    w_ent = None if w_ent is None else w_ent.double() * gs
                    at = 0
                    for i, T, R in zip(t[f"mb.{k}.sample_indices"].tolist(), t[f"mb.{k}.total_lengths"].tolist(),
                                       t[f"mb.{k}.response_lengths"].tolist()):
                        for j in lc.zigzag_owned(T, R, int(t[f"mb.{k}.cp_size"]), r_cp):
                            W[i, j] += w[at]
                            if w_ent is not None:
                                W_ent[i, j] += w_ent[at]
                            seen[i, j] += 1
                            at += 1
            logits = model(full["tokens"], full["position_ids"], None)
            l = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), full["labels"].reshape(-1),
                                                  reduction="none").view(ROWS, S)
            logp = torch.log_softmax(logits, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)                      # [ROWS, S], float64
            ((W * l).sum() + (W_ent * entropy).sum()).backward()
            torch.save({"want": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
                        "got": grads, "seen": seen, "weights": W, "token_loss": l.detach()},
                       os.path.join(out, f"ref-step{step}.pt"))
    ps.destroy_model_parallel()


def thd_reference(out, step, model, caps, grads):
    """THD: each sample whole (positions 0..T-1; the attention is the identity, so a position's loss depends on
    its token and position only), its weights W[p] at the logit positions the captures own (each micro-batch
    at its own CP size; this rank's place in it the static CP rank modulo that size)."""
    import lossguard_capture as lc
    toks = thd_tokens(step)
    W = [torch.zeros(T, dtype=torch.float64) for T, _, _ in THD_SAMPLES[step]]
    seen = [torch.zeros(T, dtype=torch.int64) for T, _, _ in THD_SAMPLES[step]]
    for t, meta in caps:
        if int(meta["tp_rank"]) != 0:
            continue
        gs = t["grad_scale"].double().item()
        for k in range(int(meta["num_microbatches"])):
            if int(t[f"mb.{k}.dummy"]):
                assert float(t[f"mb.{k}.token_weight"].abs().sum()) == 0.0      # its loss is x 0
                continue
            cpk = int(t[f"mb.{k}.cp_size"])
            r = int(meta["cp_rank"]) % cpk
            w = t[f"mb.{k}.token_weight"].double() * gs
            at = 0
            for i, T, R in zip(t[f"mb.{k}.sample_indices"].tolist(), t[f"mb.{k}.total_lengths"].tolist(),
                               t[f"mb.{k}.response_lengths"].tolist()):
                for j in lc.zigzag_owned(T, R, cpk, r):
                    W[i][T - R - 1 + j] += w[at]
                    seen[i][T - R - 1 + j] += 1
                    at += 1
            assert at == w.numel()
    total = 0
    losses = []
    for i, (T, R, m) in enumerate(THD_SAMPLES[step]):
        logits = model(toks[i][None], torch.arange(T)[None], None)[0]           # [T, V]
        labels = torch.cat([toks[i][1:], torch.zeros(1, dtype=torch.int64)])
        l = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        losses.append(l.detach())
        total = total + (W[i] * l).sum()
    total.backward()
    torch.save({"want": {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                         for n, p in model.named_parameters()},
                "got": grads, "thd_seen": seen, "thd_weights": W, "thd_token_loss": losses},
               os.path.join(out, f"ref-step{step}.pt"))


def _with_partition(values, grads):
    for n, v in values.items():
        yield n, v, {"partition_dim": grads[n]["partition_dim"], "tp_rank": grads[n]["tp_rank"]}


def _whole_model(layers):
    with cuda_on_cpu():
        return make_model(make_config_whole(layers))


def make_config_whole(layers):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=layers, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--reference", help="one process: the float64 reference gradients of the runs in this folder")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1, help="model chunks per stage: the interleaved 1F1B schedule")
    ap.add_argument("--scenarios", default="pt,global")
    a = ap.parse_args()
    scenarios = [s for s in a.scenarios.split(",") if s]
    if a.reference:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        try:
            reference(a.reference, a.pp * a.vpp, [s for s in scenarios if s not in PLANTED])
        finally:
            dist.destroy_process_group()
        return
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                                 context_parallel_size=a.cp,
                                 virtual_pipeline_model_parallel_size=a.vpp if a.vpp > 1 else None)
    rank = dist.get_rank()
    try:
        with cuda_on_cpu():
            for scenario in scenarios:
                for adapter in ((True,) if scenario in PLANTED else (True, False)):
                    run(scenario, os.path.join(a.out, scenario, "adapter" if adapter else "plain"), a.pp, a.tp,
                        a.cp, adapter, a.vpp)
        if rank == 0:
            from importlib.metadata import version
            with open(os.path.join(a.out, "meta.json"), "w") as f:
                json.dump({"megatron_core": version("megatron-core"), "torch": torch.__version__,
                           "cuda_on_cpu_sites": sorted(HITS), "world": dist.get_world_size(), "pp": a.pp,
                           "tp": a.tp, "cp": a.cp, "vpp": a.vpp, "dp": ps.get_data_parallel_world_size(),
                           "schedule": get_forward_backward_func().__name__}, f, indent=1)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
