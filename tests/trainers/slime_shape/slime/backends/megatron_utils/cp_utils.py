"""slime's per-sample zig-zag CP split and its reducer factory (THUDM/slime
slime/backends/megatron_utils/cp_utils.py @624b824, main: get_logits_and_tokens_offset_with_cp, slice_with_cp,
slice_log_prob_with_cp; get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks, sample_denoms,
calculate_per_token_loss), cp_utils.py:47-124: ``sample_denoms`` each sample's denominator — loss.py:1319-1325
passes the rollout's ``rollout_mask_sums``, one float32 tensor (actor.py:264-268), of which the DataIterator
hands each micro-batch its samples' entries; None: each sample's own mask count)."""
import torch
from megatron.core import mpu


def _pieces(total_length, cp_size, cp_rank):
    """Sample positions [start, end) of this CP rank's two chunks: a sample padded to 2*cp chunks of
    ceil(T / 2cp); rank r holds chunks r and 2cp-1-r."""
    size = -(-total_length // (2 * cp_size))
    return size, [(cp_rank * size, (cp_rank + 1) * size), ((2 * cp_size - 1 - cp_rank) * size, (2 * cp_size - cp_rank) * size)]


def get_logits_and_tokens_offset_with_cp(total_length, response_length):
    """Per chunk: its sample positions, the logit positions of the response it holds (a logit at p predicts
    token p+1; the response's logits are prompt-1 .. T-2) and those tokens' positions; an empty piece (0, 0)."""
    cp_size, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    prompt = total_length - response_length
    size, chunks = _pieces(total_length, cp_size, cp_rank)
    logits, tokens = [], []
    for lo, hi in chunks:
        a, b = max(lo, prompt - 1), min(hi, total_length - 1)
        if a < b:
            logits.append((a, b))
            tokens.append((a + 1, b + 1))
        else:
            logits.append((0, 0))
            tokens.append((0, 0))
    return size, tuple(chunks), tuple(logits), tuple(tokens)


def slice_with_cp(tokens, pad_value):
    cp_size, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    if cp_size == 1:
        return tokens
    size, chunks = _pieces(len(tokens), cp_size, cp_rank)
    padded = torch.nn.functional.pad(tokens, (0, 2 * cp_size * size - len(tokens)), value=pad_value)
    return torch.cat([padded[lo:hi] for lo, hi in chunks])


def slice_log_prob_with_cp(values, total_length, response_length):
    """A per-response-token tensor cut to this CP rank's owned tokens, local order."""
    if mpu.get_context_parallel_world_size() == 1:
        return values
    prompt = total_length - response_length
    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total_length, response_length)
    return torch.cat([values[a - (prompt - 1):b - (prompt - 1)] for a, b in logits])


def _local_masks(total_lengths, response_lengths, loss_masks):
    if mpu.get_context_parallel_world_size() == 1:
        return list(loss_masks)
    return [slice_log_prob_with_cp(m, T, R) for T, R, m in zip(total_lengths, response_lengths, loss_masks)]


def get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks, sample_denoms=None,
                           calculate_per_token_loss=False):
    """The reducer over this rank's owned response tokens (per sample, local order): per-token, the masked
    sum; otherwise each sample's masked sum over its denominator (clamped to 1 at the division), summed."""
    local = _local_masks(total_lengths, response_lengths, loss_masks)
    lengths = [int(m.numel()) for m in local]
    denoms = [m.sum() for m in loss_masks] if sample_denoms is None else sample_denoms

    def sum_of_sample_mean(x):
        return sum((xi * m).sum() / torch.clamp_min(torch.as_tensor(d), 1)
                   for xi, m, d in zip(x.split(lengths), local, denoms))

    def sum_of_token(x):
        return sum((xi * m).sum() for xi, m in zip(x.split(lengths), local))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean
