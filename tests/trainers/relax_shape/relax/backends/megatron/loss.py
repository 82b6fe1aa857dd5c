"""Relax's loss module, the paths the tests drive (redai-studio/Relax relax/backends/megatron/loss.py
@36882ca): normalize_reduced_loss_metrics (L56-76: 0/0 -> zeros, non-zero/0 -> error), get_log_probs_and_entropy
at the micro-batch's CP size, policy_loss_function (L830-1176: the policy loss's reducer first — a custom one
loaded by --custom-pg-loss-reducer-function-path with four arguments — then pg_clipfrac, ppo_kl, the entropy,
the KL under --use-kl-loss; loss = pg - entropy_coef * entropy + kl_loss_coef * kl) and loss_function
(L1545-1730: the CP-local count; the reducer with ``sample_index_mask_sums`` as denominators; a dummy
micro-batch's loss x 0 and its count 0; without per-token loss x ``__loss_scale__`` when the batch carries it,
else x num_microbatches / global batch size x DP x CP; per-token: as is, no x CP; the 3-tuple with the count
also in the report)."""
from functools import partial

import torch
from megatron.core import mpu

from relax.utils.misc import load_function
from relax.utils.training.ppo_utils import compute_approx_kl

from .cp_utils import get_cp_local_num_tokens, get_logits_and_tokens_offset_with_cp, get_sum_of_sample_mean


def normalize_reduced_loss_metrics(keys, values):
    if len(keys) + 1 != len(values):
        raise ValueError(f"Expected one denominator plus {len(keys)} metric values, got {len(values)} values.")
    if values[0] == 0:
        bad = [k for k, v in zip(keys, values[1:]) if v != 0]
        if bad:
            raise RuntimeError(f"Zero loss-metric denominator with nonzero numerator(s): {bad}.")
        return dict.fromkeys(keys, 0.0)
    return {k: v / values[0] for k, v in zip(keys, values[1:])}


def get_responses(logits, *, unconcat_tokens, total_lengths, response_lengths, cp_size, cp_rank):
    logits = logits.squeeze(0)
    end = 0
    for tokens, T, R in zip(unconcat_tokens, total_lengths, response_lengths):
        if cp_size == 1:
            start, end = end, end + T
            yield logits[start + T - R - 1:end - 1], tokens[T - R:]
            continue
        size, chunks, logit_pieces, token_pieces = get_logits_and_tokens_offset_with_cp(
            T, R, dynamic_cp_size=cp_size, dynamic_cp_rank=cp_rank)
        parts_l, parts_t = [], []
        for half, ((c0, _), (a, b), (ta, tb)) in enumerate(zip(chunks, logit_pieces, token_pieces)):
            base = end + half * size
            parts_l.append(logits[base + a - c0:base + b - c0] if b > a else logits[0:0])
            parts_t.append(tokens[ta:tb])
        end += 2 * size
        yield torch.cat(parts_l), torch.cat(parts_t)


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False,
                              dynamic_cp_size=None, dynamic_cp_rank=None, lm_head_forward=None, **_):
    cp_size = dynamic_cp_size or mpu.get_context_parallel_world_size()
    cp_rank = dynamic_cp_rank if dynamic_cp_size else mpu.get_context_parallel_rank()
    res = {"log_probs": [], "entropy": []}
    for rows, tokens in get_responses(logits, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths,
                                      response_lengths=response_lengths, cp_size=cp_size, cp_rank=cp_rank):
        if lm_head_forward is not None:     # loss.py:417-444: rows are hidden states; the head runs per sub-chunk
            k = getattr(args, "sft_logits_chunk_size", 1024)
            k = k if k > 0 else 1024
            parts = []
            for s in range(0, rows.size(0), k):
                sub, _ = lm_head_forward(rows[s:s + k].unsqueeze(1))
                logp = torch.log_softmax(sub.squeeze(1).float(), dim=-1)
                parts.append(logp.gather(-1, tokens[s:s + k].long().unsqueeze(-1)).squeeze(-1))
            res["log_probs"].append(torch.cat(parts) if parts else rows.new_zeros((0,), dtype=torch.float32))
            continue
        logp = torch.log_softmax(rows.float(), dim=-1)
        res["log_probs"].append(logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            res["entropy"].append(-(logp.exp() * logp).sum(-1))
    return torch.empty((0,)), res


def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high):
    ratio = (-ppo_kl).exp()
    plain, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return torch.maximum(plain, clipped), (clipped > plain).float()


#: the advantage estimators whose normalisation is token-global (Relax relax/algorithms/spec.py:267-297
#: @53a6045: reinforce_plus_plus, reinforce_plus_plus_baseline): their reducers are made mask-safe
TOKEN_GLOBAL = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _get_reinforce_plus_plus_mask_safe_reducer(reducer, loss_masks):
    """Relax loss.py:810-827 @36882ca, restated: a reducer that zeroes the masked positions (so a NaN there cannot
    leak through x * mask) before reducing — it reduces a new tensor, not the one it is handed. The masks are the
    whole samples' (CP 1: the token-global estimators do not support CP)."""
    valid = torch.cat([torch.as_tensor(m).reshape(-1) != 0 for m in loss_masks])

    def reduce_masked(values):
        if values.shape[0] != valid.numel():
            raise ValueError(f"{values.shape[0]} values for {valid.numel()} mask entries")
        return reducer(torch.where(valid.to(values.device), values, torch.zeros_like(values)))
    return reduce_masked


def sft_loss_function(args, batch, logits, sum_of_sample_mean):
    """Relax loss.py:1238-1278 @36882ca (``--loss-type sft``): the negative log-likelihood of the response tokens,
    ``-sum_of_sample_mean(log_probs)``."""
    _, lpe = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
                                       with_entropy=False, dynamic_cp_size=batch.get("dynamic_cp_size"),
                                       dynamic_cp_rank=batch.get("dynamic_cp_rank"))
    log_probs = torch.cat(lpe["log_probs"])
    loss = -sum_of_sample_mean(log_probs)
    if log_probs.numel() == 0:
        loss = loss + 0 * logits.sum()
    return loss, {"loss": loss.detach()}


def sft_loss_function_chunked(args, batch, hidden_states, sum_of_sample_mean, *, lm_head_forward):
    """loss.py:1488-1530 @36882ca (``--sft-chunked-logits``): ``sft_loss_function`` on hidden states, the output
    layer run per sub-chunk of ``args.sft_logits_chunk_size`` tokens through ``lm_head_forward``."""
    _, lpe = get_log_probs_and_entropy(hidden_states, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
                                       with_entropy=False, dynamic_cp_size=batch.get("dynamic_cp_size"),
                                       dynamic_cp_rank=batch.get("dynamic_cp_rank"), lm_head_forward=lm_head_forward)
    log_probs = torch.cat(lpe["log_probs"])
    loss = -sum_of_sample_mean(log_probs)
    if log_probs.numel() == 0:
        loss = loss + 0 * hidden_states.sum()
    return loss, {"loss": loss.detach()}


def policy_loss_function(args, batch, logits, sum_of_sample_mean):
    if getattr(args, "advantage_estimator", "grpo") in TOKEN_GLOBAL:      # loss.py:871-874 @36882ca
        sum_of_sample_mean = _get_reinforce_plus_plus_mask_safe_reducer(sum_of_sample_mean, batch["loss_masks"])
    advantages = torch.cat(batch["advantages"])
    _, lpe = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
                                       with_entropy=True, dynamic_cp_size=batch.get("dynamic_cp_size"),
                                       dynamic_cp_rank=batch.get("dynamic_cp_rank"))
    log_probs = torch.cat(lpe["log_probs"])
    # loss.py:876-908: the actor's old log-probs (batch["log_probs"]); in true on-policy mode this forward's, detached
    old = log_probs.detach() if getattr(args, "true_on_policy_mode", True) else torch.cat(batch["log_probs"])
    ppo_kl = old - log_probs
    pg_loss, pg_clipfrac = compute_policy_loss(ppo_kl, advantages, args.eps_clip, args.eps_clip_high)
    if args.custom_pg_loss_reducer_function_path is not None:
        reducer = load_function(args.custom_pg_loss_reducer_function_path)(
            batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], args.calculate_per_token_loss)
    else:
        reducer = sum_of_sample_mean
    pg_loss = reducer(pg_loss)
    pg_clipfrac = sum_of_sample_mean(pg_clipfrac)
    ppo_kl = sum_of_sample_mean(ppo_kl)
    entropy_loss = sum_of_sample_mean(torch.cat(lpe["entropy"]))
    loss = pg_loss - args.entropy_coef * entropy_loss
    report = {"pg_loss": pg_loss.detach(), "entropy_loss": entropy_loss.detach(), "pg_clipfrac": pg_clipfrac.detach(),
              "ppo_kl": ppo_kl.detach()}
    if args.use_kl_loss:
        kl = compute_approx_kl(log_probs, torch.cat(batch["ref_log_probs"]), kl_loss_type=args.kl_loss_type)
        kl_loss = sum_of_sample_mean(kl)
        loss = loss + args.kl_loss_coef * kl_loss
        report["kl_loss"] = kl_loss.detach()
    if log_probs.numel() == 0:
        loss = loss + 0 * logits.sum()
    return loss, report


def loss_function(args, batch, num_microbatches, logits, *, lm_head_forward=None):
    dyn_size, dyn_rank = batch.get("dynamic_cp_size"), batch.get("dynamic_cp_rank")
    num_tokens = get_cp_local_num_tokens(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                         dynamic_cp_size=dyn_size, dynamic_cp_rank=dyn_rank)
    sum_of_sample_mean = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                                args.calculate_per_token_loss, args.qkv_format, None, None, dyn_size,
                                                dyn_rank, sample_denoms=batch.get("sample_index_mask_sums"))
    # loss.py:1615-1640 @36882ca: value_loss (the critic), dpo and rm (pair losses) are not restated here
    func = {"policy_loss": policy_loss_function, "sft": sft_loss_function}.get(args.loss_type) or \
        load_function(args.custom_loss_function_path)
    if args.loss_type == "sft" and getattr(args, "sft_chunked_logits", False) and lm_head_forward is not None:
        func = partial(sft_loss_function_chunked, lm_head_forward=lm_head_forward)     # loss.py:1630-1634
    loss, log = func(args, batch, logits, sum_of_sample_mean)
    dummy = bool(batch.get("__is_dummy__", False))
    if dummy:
        loss = 0 * loss
    elif not args.calculate_per_token_loss:
        if batch.get("__loss_scale__") is not None:
            loss = loss * batch["__loss_scale__"]
        else:
            gbs = batch.get("dynamic_global_batch_size") or args.global_batch_size
            loss = loss * num_microbatches / gbs * mpu.get_data_parallel_world_size(with_context_parallel=True)
    effective = torch.zeros_like(num_tokens) if dummy else num_tokens
    denominator = effective if args.calculate_per_token_loss else torch.tensor(0)
    values = torch.stack([torch.as_tensor(denominator, dtype=torch.float32)] +
                         [torch.zeros(()) if dummy else torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in log.values()])
    return (loss, effective if args.calculate_per_token_loss else torch.tensor(1),
            {"keys": list(log.keys()), "values": values, "num_tokens": effective})
