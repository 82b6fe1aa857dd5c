"""Relax's micro-batch iterator and packed batch (redai-studio/Relax relax/backends/megatron/data.py
@36882ca: DataIterator.get_next L930-961 — rows by ``micro_batch_indices[offset]``, ``__is_dummy__`` for the
offsets in ``dummy_micro_batch_offsets`` (a repeated partition that keeps every DP rank's micro-batch count
equal), ``__loss_scale__`` from ``micro_batch_loss_scales`` (as Relax's streaming iterators inject it); get_batch L407-807 — with a dynamic CP size per micro-batch (``dynamic_cp_split_data`` when
``max_tokens_per_gpu`` is set: ``dynamic_cp_size``, ``dynamic_cp_rank`` in the batch), each sample cut by
slice_with_cp at that size, the stream padded, ``PackedSeqParams(qkv_format="thd")`` with the lengths x CP,
and the per-token fields (advantages, reference log-probs) re-sliced to the micro-batch's CP layout).
``MAX_TOKENS_PER_GPU`` stands for Relax's ``args.max_tokens_per_gpu`` (it reads get_args()); no ``.cuda()``."""
import torch
from megatron.core import mpu
from megatron.core.packed_seq_params import PackedSeqParams

from .cp_utils import dynamic_cp_split_data, slice_log_prob_with_cp, slice_with_cp

MAX_TOKENS_PER_GPU = None
PER_TOKEN_KEYS = ("advantages", "ref_log_probs", "log_probs", "rollout_log_probs")


class DataIterator:
    def __init__(self, rollout_data, micro_batch_size=None, micro_batch_indices=None, dummy_micro_batch_offsets=(),
                 micro_batch_loss_scales=None):
        self.rollout_data, self.micro_batch_size, self.micro_batch_indices = rollout_data, micro_batch_size, micro_batch_indices
        self.dummy_micro_batch_offsets = set(dummy_micro_batch_offsets)
        self.micro_batch_loss_scales = micro_batch_loss_scales
        self.offset = 0

    def get_next(self, keys):
        ordinal = self.offset if self.micro_batch_indices is not None else self.offset // self.micro_batch_size
        rows = (self.micro_batch_indices[self.offset] if self.micro_batch_indices is not None
                else range(self.offset, self.offset + self.micro_batch_size))
        batch = {k: None if self.rollout_data.get(k) is None else [self.rollout_data[k][i] for i in rows] for k in keys}
        if self.micro_batch_indices is not None:
            if self.offset in self.dummy_micro_batch_offsets:
                batch["__is_dummy__"] = True
            if self.micro_batch_loss_scales is not None:          # the rollout-mini path (Relax tests' version)
                batch["__loss_scale__"] = self.micro_batch_loss_scales[self.offset]
            self.offset += 1
        else:
            self.offset += self.micro_batch_size
        batch["replay_micro_batch_index"] = ordinal
        return batch

    def reset(self):
        self.offset = 0
        return self


def get_batch(data_iterator, keys, pad_multiplier=128, qkv_format="thd", allgather_cp=False, is_vl_model=False,
              pack_device=None):
    assert "tokens" in keys and qkv_format == "thd" and not allgather_cp
    batch = data_iterator.get_next(keys)
    cp_size, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    if MAX_TOKENS_PER_GPU is not None and cp_size > 1:
        size = dynamic_cp_split_data(batch, MAX_TOKENS_PER_GPU)
        cp_size, cp_rank = size, cp_rank % size
        batch["dynamic_cp_size"], batch["dynamic_cp_rank"] = cp_size, cp_rank
    batch["unconcat_tokens"] = batch["tokens"]
    pieces = [slice_with_cp(t, 0, dynamic_cp_size=cp_size, dynamic_cp_rank=cp_rank) for t in batch["tokens"]]
    bounds = [0]
    for p in pieces:
        bounds.append(bounds[-1] + p.numel())
    stream = torch.cat(pieces)
    pad = (-stream.numel()) % (mpu.get_tensor_model_parallel_world_size() * pad_multiplier)
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
        bounds.append(bounds[-1] + pad)
    cu = torch.tensor(bounds, dtype=torch.int32) * cp_size
    longest = int((cu[1:] - cu[:-1]).max())
    batch["tokens"] = stream.unsqueeze(0)
    batch["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                 max_seqlen_q=longest, max_seqlen_kv=longest)
    for key in PER_TOKEN_KEYS:
        if batch.get(key) is not None:
            batch[key] = [slice_log_prob_with_cp(v, T, R, dynamic_cp_size=cp_size, dynamic_cp_rank=cp_rank)
                          for v, T, R in zip(batch[key], batch["total_lengths"], batch["response_lengths"])]
    return batch
