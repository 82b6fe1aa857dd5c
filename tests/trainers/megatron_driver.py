#!/usr/bin/env python3
"""Runs megatron-core's real training step — ``initialize_model_parallel``, ``get_batch_on_this_cp_rank``
(the zig-zag CP split), ``forward_backward_no_pipelining`` with M = 2 micro-batches, its
``DistributedDataParallel``, ``finalize_model_grads`` and ``get_megatron_optimizer`` — on a tiny
``GPTModel`` (CPU, Gloo), for several loss paths, each twice from the same seed: with the lossguard adapter
(``lossguard_capture.megatron``) and without it; writes what tests/trainers/test_megatron.py compares.

    torchrun --standalone --nproc-per-node $((DP*CP)) tests/trainers/megatron_driver.py --out DIR --cp CP \\
        --paths a,b,c,cnan,d

The model: a ``GPTModel`` built from a ``TransformerConfig`` (vocabulary 32, hidden 16, one layer, learned
absolute positions) whose layer is Megatron's local spec without self-attention (``IdentityOp``):
Megatron's local ``DotProductAttention`` refuses CP > 1 (transformer/dot_product_attention.py:57-59: "Context
parallelism is only supported by TEDotProductAttention"), and Transformer Engine does not run on the CPU.
Every other module is Megatron's: embeddings, the MLP's ColumnParallelLinear / RowParallelLinear, the
output layer and ``vocab_parallel_cross_entropy`` (``compute_language_model_loss`` returns the
per-token losses ``[b, s/cp]`` the loss_func receives).  Each position's loss depends on its token and
position only, so a CP shard computes exactly the losses of the full rows.

The batch: 4 rows of s = 8 positions per step, 2 steps; micro-batch k of DP rank d holds rows
(k*dp + d)*b ... + b-1 (b = 2/dp, Megatron's pretraining sampler order).  loss_mask[p] says whether the
loss at position p (of labels[p] = tokens[p+1]) counts; the last position never does.  Step 0: row 0 is
empty, row 1 has tokens only at positions 2-5 (CP rank 1 of 2), row 3 only at positions 0, 1, 6 (CP rank
0): at CP 2 a CP rank owns no token of some micro-batch, at DP 2 a micro-batch is empty.  Step 1: rows 0
and 1 are empty (an empty micro-batch at every layout).

Paths (``--paths``):
  a     calculate_per_token_loss=True, 3-tuple loss_func: (sum_t m_t l_t, CP-local count, report)
  b     calculate_per_token_loss=False, the same 3-tuple loss_func (Megatron's per-micro-batch mean)
  c     calculate_per_token_loss=False, 2-tuple loss_func: sum_t m_t l_t / max(n, 1), n the micro-batch's
        count all-reduced over the CP group (older slime)
  cnan  as c without the clamp: an empty micro-batch gives 0/0
  d     calculate_per_token_loss=True with c's 2-tuple loss_func (the misconfiguration)
  mtp-a a's loss path on a GPTModel with one multi-token-prediction layer (mtp_num_layers = 1,
        mtp_loss_scaling_factor = MTP_SCALE): Megatron's own MTP loss (gpt_model.py:611-661) is the term
        ``mtp``; the model is called with the CP-local loss_mask (its MTP mask is that mask rolled left by
        one, multi_token_prediction.py:158-161)
  mtp-b b's loss path on the same model (the MTP loss divided by each CP shard's rolled-mask count, / M)

The MTP paths use MTP_MASKS: rows as every path's (one sample per row, prompt 1, response s-1 — the whole
row but its first token: every position of the rolled mask lies in the response window), with some rows
loss-bearing at position 0 (so the MTP count differs from the main count) and gaps (so the rolled mask
m_{t+1} differs from m_t m_{t+1}), and no CP shard of any micro-batch without an MTP token at any layout:
Megatron divides by that count unclamped (gpt_model.py:659-661), 0/0 = NaN gradients in mtp-b.

The MTP model's layers (decoder and MTP) name their attention type as the MTP layer requires
(multi_token_prediction.py:624-625 reads ``self_attention.params['attn_mask_type']``): the same IdentityOp.

Per path and run (``DIR/<path>/{adapter,plain}/``): ``losses-rank{r}.pt`` (per step, the scalars the
schedule backpropagated, after its in-place scaling), ``reports-rank{r}.pt`` (forward_backward's return),
``grads-step{n}-rank{r}.pt`` (every parameter's ``main_grad`` after finalize_model_grads, before the
optimizer), ``params-step{n}-rank{r}.pt`` (the parameters the step's forward used), ``final-rank{r}.pt``,
``opt-rank{r}.json`` (optimizer.step()'s update_successful and grad_norm per step); adapter runs also
``captures/step{n:06d}/`` and, from rank 0, ``ref-grads-step{n}.pt``: ``sum_t w_t grad(l_t)`` with the
captured weights ``w_t = token_weight_t * grad_scale`` and ``l_t`` recomputed in float64 on the full rows
with the step's parameters.

``--guards`` (world 1) also runs the refusals and, when the lossguard binary is built (``$LOSSGUARD_BIN`` or
build/cli/lossguard), fail fast: ``attach(..., fail_fast=True)`` on path b (audit FAILs step 0: AuditFailed
from ``optimizer.step()``, the parameters unchanged) and on path a (PASS: the step is applied).
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
from harness import LOSSGUARD  # noqa: E402  (the binary under test: one definition)

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)

from lossguard_capture.megatron_cpu import HITS, cuda_on_cpu, import_megatron_core  # noqa: E402

import_megatron_core()      # before any megatron import (megatron-core 0.15.x: lossguard_capture.megatron_cpu)

SEED = 1234
VOCAB = 32
S = 8                 # positions per row (a multiple of 2*cp)
ROWS = 4              # rows per step
M = 2                 # micro-batches per step
STEPS = 2
PATHS = {             # path -> (calculate_per_token_loss, loss_func kind)
    "a": (True, "tuple3"),
    "b": (False, "tuple3"),
    "c": (False, "tuple2-cp"),
    "cnan": (False, "tuple2-cp-noclamp"),
    "d": (True, "tuple2-cp"),
    "mtp-a": (True, "tuple3"),
    "mtp-b": (False, "tuple3"),
}
MTP_PATHS = ("mtp-a", "mtp-b")
MTP_SCALE = 0.3       # mtp_loss_scaling_factor (mtp_num_layers = 1): the term's coefficient
LOCAL_KEYS = ("tokens", "labels", "loss_mask", "position_ids")      # what get_batch_on_this_cp_rank splits
MASKS = [
    [[0, 0, 0, 0, 0, 0, 0, 0],
     [0, 0, 1, 1, 0, 1, 0, 0],
     [0, 1, 1, 1, 1, 1, 1, 0],
     [1, 1, 0, 0, 0, 0, 1, 0]],
    [[0, 0, 0, 0, 0, 0, 0, 0],
     [0, 0, 0, 0, 0, 0, 0, 0],
     [1, 0, 1, 1, 0, 1, 1, 0],
     [0, 0, 0, 1, 1, 0, 0, 0]],
]


MTP_MASKS = [
    [[1, 1, 1, 1, 1, 1, 1, 0],
     [0, 0, 1, 1, 0, 1, 1, 0],
     [0, 1, 1, 1, 1, 1, 1, 0],
     [1, 0, 1, 0, 0, 1, 1, 0]],
    [[0, 0, 1, 1, 1, 1, 0, 0],
     [1, 1, 0, 0, 0, 0, 1, 0],
     [0, 1, 0, 1, 0, 1, 0, 0],
     [1, 1, 1, 1, 1, 1, 1, 0]],
]


def masks_of(path):
    return MTP_MASKS if path in MTP_PATHS else MASKS


def batch(step, masks=None):
    """The step's 4 rows: tokens [4, S], labels (tokens shifted, 0 after the row), loss_mask, position_ids."""
    g = torch.Generator().manual_seed(SEED + 17 * step)
    tokens = torch.randint(1, VOCAB, (ROWS, S), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.zeros(ROWS, 1, dtype=torch.int64)], dim=1)
    masks = MASKS if masks is None else masks
    return {"tokens": tokens, "labels": labels, "loss_mask": torch.tensor(masks[step], dtype=torch.float32),
            "position_ids": torch.arange(S).expand(ROWS, S).contiguous(),
            "sample_indices": torch.arange(ROWS)}


def microbatches(step, dp, dp_rank, masks=None):
    b = ROWS // (M * dp)
    full = batch(step, masks)
    out = []
    for k in range(M):
        first = (k * dp + dp_rank) * b
        out.append({key: v[first:first + b].clone() for key, v in full.items()})
    return out


def layer_spec(mtp=False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = IdentityOp
    # the MTP layer reads the attention's mask type from its spec (multi_token_prediction.py:624-625)
    spec.submodules.self_attention = (ModuleSpec(module=IdentityOp, params={"attn_mask_type": AttnMaskType.causal})
                                      if mtp else IdentityOp)
    spec.submodules.self_attn_bda = IdentityFuncOp
    return spec


def make_config(cp, per_token, tp=1, mtp=False):
    from megatron.core.transformer.transformer_config import TransformerConfig
    extra = dict(mtp_num_layers=1, mtp_loss_scaling_factor=MTP_SCALE) if mtp else {}
    return TransformerConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                             use_cpu_initialization=True, calculate_per_token_loss=per_token,
                             context_parallel_size=cp, tensor_model_parallel_size=tp, hidden_dropout=0.0,
                             attention_dropout=0.0, **extra)


def make_model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    torch.manual_seed(SEED)
    mtp = config.mtp_num_layers is not None
    spec = layer_spec(mtp)
    extra = dict(mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)) if mtp else {}
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=S,
                    position_embedding_type="learned_absolute", **extra)


# ---- the user's loss functions (as a Megatron training script writes them) ---------------------------
def loss_tuple3(kept, loss_mask, output_tensor):
    """pretrain_gpt-style: the CP-local sum and count; Megatron normalises (or not) from there."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    kept.append(loss)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}


def loss_tuple2_cp(kept, clamp, loss_mask, output_tensor):
    """Older slime: the micro-batch's mean, its count all-reduced over the CP group; Megatron then
    multiplies by the CP size and divides by the number of micro-batches (schedules.py:264-269)."""
    from megatron.core import parallel_state as ps
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    n = mask.sum().clone().detach()
    dist.all_reduce(n, group=ps.get_context_parallel_group())
    loss = torch.sum(losses * mask) / (torch.clamp(n, min=1) if clamp else n)
    kept.append(loss)
    return loss, {"lm loss": loss.clone().detach().view(1)}


def build(cp, per_token, mtp=False):
    """A fresh model, DDP wrapper and optimizer, wired as Megatron-LM's training loop wires them."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    config = make_config(cp, per_token, ps.get_tensor_model_parallel_world_size(), mtp)
    model = make_model(config)
    ddp = DDP(config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0,
                                                 bf16=False, fp16=False), [ddp])
    # as Megatron-LM's training loop wires them (training.py: train())
    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return config, ddp, opt


def run(path, out, cp, adapter):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.utils import get_batch_on_this_cp_rank

    rank = dist.get_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_token, kind = PATHS[path]
    mtp = path in MTP_PATHS
    os.makedirs(out, exist_ok=True)
    config, ddp, opt = build(cp, per_token, mtp)
    audit = None
    if adapter:
        import lossguard_capture.megatron as lcm
        audit = lcm.attach(config, os.path.join(out, "captures"), steps=range(STEPS), fail_fast=False, model=[ddp],
                           optimizer=opt)

    kept = []
    if kind == "tuple3":
        user_loss = partial(loss_tuple3, kept)
    else:
        user_loss = partial(loss_tuple2_cp, kept, kind == "tuple2-cp")

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        local = get_batch_on_this_cp_rank({k: mb[k].clone() for k in LOCAL_KEYS})
        # with MTP the model takes the loss_mask too (pretrain_gpt passes it): its MTP mask is that one rolled
        kw = dict(loss_mask=local["loss_mask"]) if mtp else {}
        output = model(local["tokens"], local["position_ids"], None, labels=local["labels"], **kw)
        fn = partial(user_loss, local["loss_mask"])
        if audit is not None:
            fn = audit.loss_func(fn, tokens=mb["tokens"], loss_mask=mb["loss_mask"],
                                 sample_indices=mb["sample_indices"])
        return output, fn

    losses, reports, opt_out = [], [], []
    for step in range(STEPS):
        torch.save({n: p.detach().clone() for n, p in ddp.module.named_parameters()},
                   os.path.join(out, f"params-step{step}-rank{rank}.pt"))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        kept.clear()
        ctx = audit.step(step, global_batch_size=ROWS) if audit is not None else _Null()
        with ctx:
            rep = forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=iter(microbatches(step, dp, dp_rank, masks_of(path))),
                model=[ddp],
                num_microbatches=M, seq_length=S, micro_batch_size=ROWS // (M * dp))
            torch.save({n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()},
                       os.path.join(out, f"grads-step{step}-rank{rank}.pt"))
            ok, grad_norm, _ = opt.step()
        losses.append([x.detach().clone() for x in kept])
        reports.append(rep)
        opt_out.append({"update_successful": bool(ok), "grad_norm": None if grad_norm is None else float(grad_norm)})
    torch.save(losses, os.path.join(out, f"losses-rank{rank}.pt"))
    torch.save(reports, os.path.join(out, f"reports-rank{rank}.pt"))
    torch.save({n: p.detach().clone() for n, p in ddp.module.named_parameters()},
               os.path.join(out, f"final-rank{rank}.pt"))
    with open(os.path.join(out, f"opt-rank{rank}.json"), "w") as f:
        json.dump(opt_out, f)
    dist.barrier()
    if adapter and ps.get_tensor_model_parallel_world_size() == 1:
        reference_gradients(out, cp, path)
    dist.barrier()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def reference_gradients(out, cp, path):
    """On rank 0: sum_k sum_t w^k_t grad(l^k_t) over the terms k (main; mtp on the MTP paths), w^k_t from every
    rank's capture, l^k_t recomputed in float64 on the full rows."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import lossguard_capture as lc
    if dist.get_rank() != 0:
        return
    world = dist.get_world_size()
    mtp = path in MTP_PATHS
    terms = ("main", "mtp") if mtp else ("main",)
    for step in range(STEPS):
        params = torch.load(os.path.join(out, f"params-step{step}-rank0.pt"))
        model = make_model(make_config(cp, True, mtp=mtp))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        model = model.double()
        full = batch(step, masks_of(path))
        W = {k: torch.zeros(ROWS, S, dtype=torch.float64) for k in terms}
        seen = torch.zeros(ROWS, S, dtype=torch.int64)
        d = os.path.join(out, "captures", f"step{step:06d}")
        for r in range(world):
            file = os.path.join(d, f"step{step:06d}-rank{r:05d}.safetensors")
            t = load_file(file)
            with safe_open(file, framework="pt") as f:
                r_cp = int(f.metadata()["cp_rank"])
            gs = t["grad_scale"].double().item()
            k = 0
            while f"mb.{k}.sample_indices" in t:
                w = {term: t[f"mb.{k}.token_weight" if term == "main" else f"mb.{k}.term.{term}.token_weight"].double()
                     * gs for term in terms}
                at = 0
                for i, T, R in zip(t[f"mb.{k}.sample_indices"].tolist(), t[f"mb.{k}.total_lengths"].tolist(),
                                   t[f"mb.{k}.response_lengths"].tolist()):
                    for j in lc.zigzag_owned(T, R, cp, r_cp):       # response index j <-> position j
                        for term in terms:
                            W[term][i, j] += w[term][at]
                        seen[i, j] += 1
                        at += 1
                assert all(at == x.numel() for x in w.values())
                k += 1
        # the cross entropy in float64 here, since vocab_parallel_cross_entropy computes in float32
        # (tensor_parallel/cross_entropy.py)
        if not mtp:
            # the logits in float64 (without labels GPTModel returns them, [b, s, V])
            logits = model(full["tokens"], full["position_ids"], None)
            assert logits.dtype == torch.float64 and tuple(logits.shape) == (ROWS, S, VOCAB), (logits.dtype,
                                                                                             logits.shape)
            l = {"main": torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), full["labels"].reshape(-1),
                                                           reduction="none").view(ROWS, S)}
            sum((W[term] * l[term]).sum() for term in terms).backward()
        else:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
            saved = MTPLossAutoScaler.main_loss_backward_scale
            MTPLossAutoScaler.set_loss_scale(torch.zeros(1, dtype=torch.float64))   # see mtp_reference_losses
            try:
                l = mtp_reference_losses(model, full)
                sum((W[term] * l[term]).sum() for term in terms).backward()
            finally:
                MTPLossAutoScaler.set_loss_scale(saved)
        torch.save({"grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
                    "token_loss": l["main"].detach(), "weights": W["main"], "seen": seen,
                    "terms": {term: {"token_loss": l[term].detach(), "weights": W[term]} for term in terms[1:]}},
                   os.path.join(out, f"ref-grads-step{step}.pt"))


def mtp_reference_losses(model, full):
    """The main and the MTP per-token losses [ROWS, S] of the float64 model on the full rows: GPTModel's own
    forward (its MTP layer, the rolled labels, gpt_model.py:611-661), each cross entropy computed here in
    float64 from the logits it hands compute_language_model_loss (the MTP depth's first, gpt_model.py:640,
    then the main one, :714).  MTPLossAutoScaler's own gradient is switched off (scale 0) for this backward:
    the reference is sum_k sum_t w^k_t grad(l^k_t) with the captured weights, nothing else.  The rows are
    whole here (one process): the CP groups the model was built with are dropped (roll_tensor without CP,
    multi_token_prediction.py:158-161)."""
    for mod in model.modules():
        if getattr(mod, "cp_group", None) is not None:
            mod.cp_group = None
    got = []

    def ce(labels, logits):                 # logits [s, b, V], labels [b, s]
        assert logits.dtype == torch.float64
        out = torch.nn.functional.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), labels.reshape(-1),
                                                reduction="none").view(labels.shape)
        got.append(out)
        return out
    model.compute_language_model_loss = ce
    model.eval()                            # no MTP loss logging (gpt_model.py:642); dropout is 0 anyway
    main = model(full["tokens"], full["position_ids"], None, labels=full["labels"], loss_mask=full["loss_mask"])
    assert len(got) == 2 and main is got[1], len(got)
    return {"main": got[1], "mtp": got[0]}


# ---- guards: what the adapter refuses, and a step the loop skips ----------------------------------------
def guards(out, cp):
    """World 1: each scenario in turn; records the error (or None) and the capture files written, in
    ``out/guards.json``."""
    import glob

    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.utils import get_batch_on_this_cp_rank

    import lossguard_capture.megatron as lcm
    from lossguard_capture import AuditFailed
    results = {}

    def record(name, fn):
        d = os.path.join(out, "guards", name)
        os.makedirs(d, exist_ok=True)
        err = None
        extra = None
        try:
            extra = fn(d)
        except Exception as e:          # noqa: BLE001 - the message is what is checked
            err = f"{type(e).__name__}: {e}"
        files = sorted(os.path.relpath(f, d) for f in glob.glob(os.path.join(d, "**", "*.safetensors"), recursive=True))
        results[name] = {"error": err, "files": files, "extra": extra}

    def one_step(d, *, loss=None, mask=None, forward=None, step_it=True, packed=None, steps=(0,), step=0,
                 attach_model=True, mtp=False, per_token=True, model_loss_mask=True, fail_fast=False):
        config, ddp, opt = build(cp, per_token, mtp)
        audit = lcm.attach(config, os.path.join(d, "captures"), steps=steps, fail_fast=fail_fast,
                           model=[ddp] if attach_model else None, optimizer=opt, lossguard_bin=LOSSGUARD, timeout=60)
        full = microbatches(0, 1, 0)
        if mask is not None:
            for k, mb in enumerate(full):
                mb["loss_mask"] = mask(k, mb["loss_mask"])
        kept = []
        user_loss = loss or partial(loss_tuple3, kept)
        seen = {}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            local = get_batch_on_this_cp_rank({k: mb[k].clone() for k in LOCAL_KEYS})
            if forward == "logits":
                output = model(local["tokens"], local["position_ids"], None)         # no labels: logits
            else:
                kw = dict(loss_mask=local["loss_mask"]) if mtp and model_loss_mask else {}
                output = model(local["tokens"], local["position_ids"], None, labels=local["labels"], **kw)
            fn = partial(user_loss, local["loss_mask"])
            wrapped = audit.loss_func(fn, tokens=mb["tokens"], loss_mask=mb["loss_mask"],
                                      sample_indices=mb["sample_indices"], packed_seq_params=packed)
            seen["identity"] = wrapped is fn
            return output, wrapped
        ddp.zero_grad_buffer()
        opt.zero_grad()
        start = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        try:
            with audit.step(step, global_batch_size=ROWS):
                forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=iter(full), model=[ddp],
                                               num_microbatches=M, seq_length=S, micro_batch_size=ROWS // M)
                if step_it:
                    stepped = opt.step()
                    if fail_fast:           # what optimizer.step() returned (the capture was written before)
                        seen["opt_grad_norm"] = None if stepped[1] is None else float(stepped[1])
        except AuditFailed as e:        # fail fast: raised from opt.step() before the update
            seen["audit_failed"] = {"step": e.step, "exit_code": e.exit_code}
        if fail_fast:
            seen["params_unchanged"] = all(torch.equal(p.detach(), start[n]) for n, p in ddp.module.named_parameters())
            seen["verdicts"] = {str(k): v for k, v in audit.verdicts.items()}
            seen["paths"] = sorted(audit.paths)
        if mtp:
            from megatron.core.models.gpt import gpt_model
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
            seen["grad_finite"] = all(bool(torch.isfinite(p.main_grad).all()) for p in ddp.module.parameters())
            seen["scaler_restored"] = gpt_model.MTPLossAutoScaler is MTPLossAutoScaler
        return seen

    def no_finalize(d):
        config, ddp, opt = build(cp, True)
        config.finalize_model_grads_func = None
        lcm.attach(config, os.path.join(d, "captures"), fail_fast=False, model=[ddp], optimizer=opt)

    def not_ddp(d):
        config, ddp, opt = build(cp, True)
        lcm.attach(config, os.path.join(d, "captures"), fail_fast=False, model=[ddp.module], optimizer=opt)

    def last_position(d):
        def mask(k, m):
            m = m.clone()
            m[0, -1] = 1.0
            return m
        return one_step(d, mask=mask, fail_fast=True)

    def scalar_loss(d):
        def loss(loss_mask, output_tensor):
            return torch.sum(output_tensor.float().view(-1) * loss_mask.reshape(-1))
        return one_step(d, loss=loss, fail_fast=True)

    class Packed:
        qkv_format = "thd"

    def zero_tokens_skipped(d):
        # a Relax-style loop: every mask 0 (N = 0), and the loop does not step the optimizer
        return one_step(d, mask=lambda k, m: torch.zeros_like(m), step_it=False)

    def zero_tokens_stepped(d):
        # megatron-core's own behaviour on N = 0: finalize does not scale (N > 0 is false) and the optimizer steps
        return one_step(d, mask=lambda k, m: torch.zeros_like(m))

    def not_captured(d):
        return one_step(d, steps=(5,), step=0)

    def mtp_without_model(d):
        config, ddp, opt = build(cp, True, mtp=True)
        lcm.attach(config, os.path.join(d, "captures"), fail_fast=False, optimizer=opt)

    def mtp_empty_rolled_mask(d):
        # no per-token loss; micro-batch 0's rows carry loss at position 0 only: its main count is 2, its MTP
        # (rolled) count 0, which gpt_model.py:659-661 divides by unclamped
        def mask(k, m):
            if k == 0:
                m = torch.zeros_like(m)
                m[:, 0] = 1.0
            return m
        return one_step(d, mask=mask, mtp=True, per_token=False)

    def mtp_model_without_loss_mask(d):
        # the model called without loss_mask: Megatron's MTP mask is then all ones (gpt_model.py:615-617)
        return one_step(d, mtp=True, model_loss_mask=False)

    record("no-finalize", no_finalize)
    record("not-ddp", not_ddp)
    record("last-position-carries-loss", last_position)
    record("loss-not-a-tuple", scalar_loss)
    # what the adapter cannot measure stops the run where fail fast audits the step (these, step 0) ...
    record("logits-not-per-token", lambda d: one_step(d, forward="logits", fail_fast=True))
    record("thd", lambda d: one_step(d, packed=Packed(), fail_fast=True))
    # ... and otherwise is a warning: the step is not recorded, the trainer's own loss function runs, the run goes on
    record("thd-record-only", lambda d: one_step(d, packed=Packed()))
    record("zero-tokens-skipped", zero_tokens_skipped)
    record("zero-tokens-stepped", zero_tokens_stepped)
    record("not-captured", not_captured)
    record("mtp-without-model", mtp_without_model)
    record("mtp-empty-rolled-mask", mtp_empty_rolled_mask)
    record("mtp-model-without-loss-mask", mtp_model_without_loss_mask)
    if os.access(LOSSGUARD, os.X_OK):
        record("fail-fast-fail", lambda d: one_step(d, per_token=False, fail_fast=True))     # path b: FAIL
        record("fail-fast-pass", lambda d: one_step(d, fail_fast=True))                      # path a: PASS
    with open(os.path.join(out, "guards.json"), "w") as f:
        json.dump(results, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--guards", action="store_true", help="world 1: the refusals and the skip scenarios")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    import megatron.core
    ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=1,
                                 context_parallel_size=a.cp)
    rank = dist.get_rank()
    try:
        with cuda_on_cpu():
            for path in [p for p in a.paths.split(",") if p]:
                for adapter in (True, False):
                    run(path, os.path.join(a.out, path, "adapter" if adapter else "plain"), a.cp, adapter)
            if a.guards:
                guards(a.out, a.cp)
        if rank == 0:
            from importlib.metadata import version
            with open(os.path.join(a.out, "meta.json"), "w") as f:
                json.dump({"megatron_core": version("megatron-core"), "torch": torch.__version__,
                           "cuda_on_cpu_sites": sorted(HITS), "world": dist.get_world_size(), "cp": a.cp, "tp": a.tp,
                           "dp": ps.get_data_parallel_world_size(), "megatron_file": megatron.core.__file__}, f,
                          indent=1)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
