"""Relax's CP helpers (redai-studio/Relax relax/backends/megatron/cp_utils.py @55634da): slime's per-sample
zig-zag split at a CP size chosen per micro-batch (``dynamic_cp_size`` / ``dynamic_cp_rank``, default the
static ones; the real signatures, L146-548, so the real module can stand in for this one: test_relax_source.py); ``get_cp_local_num_tokens`` (L352-390: the tokens THIS CP rank owns, an empty response counts
0 — PR #285); ``get_sum_of_sample_mean`` (L232-313: each sample over ``sample_denoms``, default its own mask
total, clamped to 1; per-token: the masked sum); ``dynamic_cp_split_data`` (L563-629: a power-of-two CP size
from the longest sample, MAX over DP, grown until no sub-group is empty; the micro-batch's samples split into
static/dynamic sub-groups of consecutive CP ranks, this rank keeping sub-group static_rank // dynamic's)."""
import torch
import torch.distributed as dist
from megatron.core import mpu


def _cp(cp_size, cp_rank):
    """Relax's rule: the dynamic CP size and rank where given, each else the static one."""
    return (mpu.get_context_parallel_world_size() if cp_size is None else cp_size,
            mpu.get_context_parallel_rank() if cp_rank is None else cp_rank)


def get_logits_and_tokens_offset_with_cp(total_length, response_length, qkv_format="thd", max_seq_len=None,
                                         padded_total_length=None, dynamic_cp_size=None, dynamic_cp_rank=None):
    cp_size, cp_rank = _cp(dynamic_cp_size, dynamic_cp_rank)
    prompt = total_length - response_length
    size = -(-total_length // (2 * cp_size))
    chunks = [(cp_rank * size, (cp_rank + 1) * size), ((2 * cp_size - 1 - cp_rank) * size, (2 * cp_size - cp_rank) * size)]
    logits, tokens = [], []
    for lo, hi in chunks:
        a, b = max(lo, prompt - 1), min(hi, total_length - 1)
        logits.append((a, b) if a < b else (0, 0))
        tokens.append((a + 1, b + 1) if a < b else (0, 0))
    return size, tuple(chunks), tuple(logits), tuple(tokens)


def slice_with_cp(tokens, pad_value, qkv_format="thd", max_seq_len=None, dynamic_cp_size=None, dynamic_cp_rank=None):
    cp_size, cp_rank = _cp(dynamic_cp_size, dynamic_cp_rank)
    if cp_size == 1:
        return tokens
    size, chunks, _, _ = get_logits_and_tokens_offset_with_cp(len(tokens), 0, dynamic_cp_size=cp_size,
                                                              dynamic_cp_rank=cp_rank)
    padded = torch.nn.functional.pad(tokens, (0, 2 * cp_size * size - len(tokens)), value=pad_value)
    return torch.cat([padded[lo:hi] for lo, hi in chunks])


def slice_log_prob_with_cp(values, total_length, response_length, qkv_format="thd", max_token_len=None,
                           padded_total_length=None, dynamic_cp_size=None, dynamic_cp_rank=None):
    cp_size, cp_rank = _cp(dynamic_cp_size, dynamic_cp_rank)
    if cp_size == 1:
        return values
    prompt = total_length - response_length
    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total_length, response_length, dynamic_cp_size=cp_size,
                                                           dynamic_cp_rank=cp_rank)
    return torch.cat([values[a - (prompt - 1):b - (prompt - 1)] for a, b in logits])


def _local_masks(total_lengths, response_lengths, loss_masks, cp_size, cp_rank):
    return [slice_log_prob_with_cp(m, T, R, dynamic_cp_size=cp_size, dynamic_cp_rank=cp_rank)
            for T, R, m in zip(total_lengths, response_lengths, loss_masks)]


def get_cp_local_num_tokens(total_lengths, response_lengths, loss_masks, qkv_format="thd", max_seq_lens=None,
                            padded_total_lengths=None, dynamic_cp_size=None, dynamic_cp_rank=None):
    local = _local_masks(total_lengths, response_lengths, loss_masks, *_cp(dynamic_cp_size, dynamic_cp_rank))
    return sum((m.sum() for m in local), torch.tensor(0)).to(torch.int)


def get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False, qkv_format="thd",
                           max_seq_lens=None, padded_total_lengths=None, dynamic_cp_size=None, dynamic_cp_rank=None,
                           sample_denoms=None):
    cp_size, cp_rank = _cp(dynamic_cp_size, dynamic_cp_rank)
    local = _local_masks(total_lengths, response_lengths, loss_masks, cp_size, cp_rank)
    lengths = [int(m.numel()) for m in local]
    denoms = [m.sum() for m in loss_masks] if sample_denoms is None else [torch.as_tensor(d) for d in sample_denoms]

    def sum_of_sample_mean(x):
        return sum((xi * m).sum() / torch.clamp_min(d, 1) for xi, m, d in zip(x.split(lengths), local, denoms))

    def sum_of_token(x):
        return sum((xi * m).sum() for xi, m in zip(x.split(lengths), local))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean


def compute_dynamic_cp_size(max_seq_len, max_tokens_per_gpu):
    need = -(-max_seq_len // max_tokens_per_gpu)
    return 1 << (need - 1).bit_length()


def dynamic_cp_split_data(batch, max_tokens_per_gpu):
    static, rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    lengths = batch["total_lengths"]
    n = len(lengths)
    size, fewest = compute_dynamic_cp_size(max(lengths), max_tokens_per_gpu), n
    if mpu.get_data_parallel_world_size() > 1:
        t = torch.tensor([size, -n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group())
        size, fewest = int(t[0]), -int(t[1])
    while size < static and static // size > fewest:
        size *= 2
    if size >= static:
        return static
    parts = static // size
    order = sorted(range(n), key=lambda i: -lengths[i])            # longest first, dealt round robin
    partitions = [order[k::parts] for k in range(parts)]
    keep = partitions[rank // size]
    for key, value in list(batch.items()):
        if isinstance(value, (list, tuple)) and len(value) == n:
            batch[key] = [value[i] for i in keep]
    batch["_dcp_partition_order"] = [i for p in partitions for i in p]
    return size
