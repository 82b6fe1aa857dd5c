"""slime's loss module, the paths the tests drive (THUDM/slime slime/backends/megatron_utils/loss.py
@624b824, main): get_responses / get_log_probs_and_entropy (per sample, the owned response tokens in local order:
at CP > 1 the two chunks' logits and tokens by get_logits_and_tokens_offset_with_cp), policy_loss_function
(PPO-clip, the old log-probs the batch's or this forward's detached: the reducer of the policy loss
first — a custom one loaded by --custom-pg-loss-reducer-function-path with (total_lengths, response_lengths,
loss_masks, calculate_per_token_loss) — then pg_clipfrac and ppo_kl as metrics, the entropy, the k1 KL under
--use-kl-loss; loss = pg - entropy_coef * entropy + kl_loss_coef * kl), sft_loss_function (minus the reduced
log-probabilities) and loss_function (the reducer built from the batch's rollout_mask_sums; the count
sum of clamp_min(mask.sum(), 1) over the full masks; per-token: loss x CP, else x num_microbatches /
step_global_batch_size x DP x CP; the 3-tuple).  Single TP rank: the log-softmax is local."""
import torch
from megatron.core import mpu

from slime.utils.misc import load_function

from .cp_utils import get_logits_and_tokens_offset_with_cp, get_sum_of_sample_mean


def get_responses(logits, *, args, unconcat_tokens, total_lengths, response_lengths):
    logits = logits.squeeze(0)
    cp_size = mpu.get_context_parallel_world_size()
    end = 0
    for tokens, T, R in zip(unconcat_tokens, total_lengths, response_lengths):
        if cp_size == 1:
            start, end = end, end + T
            yield logits[start + T - R - 1:end - 1], tokens[T - R:]
            continue
        size, chunks, logit_pieces, token_pieces = get_logits_and_tokens_offset_with_cp(T, R)
        parts_l, parts_t = [], []
        for half, ((c0, _), (a, b), (ta, tb)) in enumerate(zip(chunks, logit_pieces, token_pieces)):
            base = end + half * size
            parts_l.append(logits[base + a - c0:base + b - c0] if b > a else logits[0:0])
            parts_t.append(tokens[ta:tb])
        end += 2 * size
        yield torch.cat(parts_l), torch.cat(parts_t)


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False,
                              non_loss_data=True):
    """(an empty tensor, {"log_probs", "entropy"}: per sample) as loss.py:513-604 @624b824 returns them."""
    assert non_loss_data
    out = {"log_probs": [], "entropy": []}
    for rows, tokens in get_responses(logits, args=args, unconcat_tokens=unconcat_tokens,
                                      total_lengths=total_lengths, response_lengths=response_lengths):
        logp = torch.log_softmax(rows.float(), dim=-1)
        out["log_probs"].append(logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            out["entropy"].append(-(logp.exp() * logp).sum(-1))
    return logits.new_empty((0,)), out


def compute_approx_kl(log_probs, log_probs_base, kl_loss_type="k1", importance_ratio=None):
    assert kl_loss_type == "k1"
    return log_probs - log_probs_base


def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high):
    ratio = (-ppo_kl).exp()
    plain = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return torch.maximum(plain, clipped), (clipped > plain).float()


def policy_loss_function(args, batch, logits, sum_of_sample_mean):
    advantages = torch.cat(batch["advantages"])
    _, lpe = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"], with_entropy=True)
    # the old log-probs: the batch's (the actor's forward_only before training), else this forward's, detached
    # (loss.py:965, 985-986 @624b824)
    old = batch.get("log_probs") or [lp.detach() for lp in lpe["log_probs"]]
    log_probs = torch.cat(lpe["log_probs"])
    old = torch.cat(old)
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
    report = {"loss": None, "pg_loss": pg_loss.detach(), "entropy_loss": entropy_loss.detach(),
              "pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach()}
    if args.use_kl_loss:
        kl = compute_approx_kl(log_probs, torch.cat(batch["ref_log_probs"]), kl_loss_type=args.kl_loss_type)
        kl_loss = sum_of_sample_mean(kl)
        loss = loss + args.kl_loss_coef * kl_loss
        report["kl_loss"] = kl_loss.detach()
    if log_probs.numel() == 0:
        loss = loss + 0 * logits.sum()
    report["loss"] = loss.detach()
    return loss, report


def sft_loss_function(args, batch, logits, sum_of_sample_mean):
    _, lpe = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"])
    log_probs = torch.cat(lpe["log_probs"])
    loss = -sum_of_sample_mean(log_probs)
    if log_probs.numel() == 0:
        loss = loss + 0 * logits.sum()
    return loss, {"loss": loss.detach()}


def loss_function(args, batch, num_microbatches, step_global_batch_size, logits):
    num_tokens = sum(torch.clamp_min(m.sum(), 1) for m in batch["loss_masks"])
    sum_of_sample_mean = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"],
                                                batch["loss_masks"], batch["rollout_mask_sums"],
                                                args.calculate_per_token_loss)
    func = {"policy_loss": policy_loss_function, "sft_loss": sft_loss_function}.get(args.loss_type)
    if args.loss_type == "custom_loss":
        func = load_function(args.custom_loss_function_path)
    loss, log = func(args, batch, logits, sum_of_sample_mean)
    if args.calculate_per_token_loss:
        loss = loss * mpu.get_context_parallel_world_size()
    else:
        loss = loss * num_microbatches / step_global_batch_size * mpu.get_data_parallel_world_size(with_context_parallel=True)
    count = torch.as_tensor(num_tokens) if args.calculate_per_token_loss else torch.tensor(1)
    values = torch.stack([torch.as_tensor(num_tokens if args.calculate_per_token_loss else 0, dtype=torch.float32)]
                         + [torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in log.values()])
    return loss, count, {"keys": list(log.keys()), "values": values}
