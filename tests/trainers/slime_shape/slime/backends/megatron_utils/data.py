"""slime's micro-batch iterator and packed (THD) batch (THUDM/slime slime/backends/megatron_utils/data.py
@624b824, main): ``DataIterator(rollout_data, micro_batch_indices)`` hands out the rows of
``micro_batch_indices[offset]`` (data.py:152-189; the ``micro_batch_size`` window of 1c81073 went in 2f4bd0d,
#1926); ``get_data_iterator`` builds one per virtual stage from ``rollout_data["micro_batch_indices"]``
(data.py:192-196); ``get_batch(data_iterator, keys, pad_multiplier, allgather_cp)`` (data.py:14-149) keeps the
samples whole as ``unconcat_tokens``, cuts each with slice_with_cp, concatenates them, pads the stream to a
multiple of TP x pad_multiplier, passes ``PackedSeqParams(qkv_format="thd")`` with the cumulative lengths times
CP, and lays each sample's loss mask on the stream's positions as ``full_loss_masks`` (data.py:106-134: the
mask shifted to its logit positions — prompt-1 zeros before, one after — cut like the tokens, padded like the
stream). The all-gather CP layout (``allgather_cp=True``, DSA models) is not restated (README.md). On the CPU
here: no ``.cuda()``."""
import torch
from megatron.core import mpu
from megatron.core.packed_seq_params import PackedSeqParams

from .cp_utils import slice_with_cp


class DataIterator:
    def __init__(self, rollout_data, micro_batch_indices):
        self.rollout_data, self.micro_batch_indices = rollout_data, micro_batch_indices
        self.offset = 0

    def get_next(self, keys):
        rows = self.micro_batch_indices[self.offset]
        self.offset += 1
        out = {}
        for key in keys:
            values = self.rollout_data.get(key)
            out[key] = None if values is None else [values[i] for i in rows]
        return out

    def reset(self):
        self.offset = 0
        return self


def get_data_iterator(rollout_data):
    stages = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    return [DataIterator(rollout_data, rollout_data["micro_batch_indices"]) for _ in range(stages)]


def _stream(pieces, multiple):
    """The pieces end to end, padded with zeros to a multiple of ``multiple``; the pad's length."""
    stream = torch.cat(pieces)
    pad = (-stream.numel()) % multiple
    return torch.nn.functional.pad(stream, (0, pad)), pad


def get_batch(data_iterator, keys, pad_multiplier=128, allgather_cp=False):
    assert "tokens" in keys and not allgather_cp, "the shape restates the per-sample zig-zag CP layout only"
    batch = data_iterator.get_next(keys)
    samples = batch["tokens"]
    batch["unconcat_tokens"] = samples
    pieces = [slice_with_cp(t, 0) for t in samples]
    bounds = [0]
    for p in pieces:
        bounds.append(bounds[-1] + p.numel())
    multiple = mpu.get_tensor_model_parallel_world_size() * pad_multiplier
    stream, pad = _stream(pieces, multiple)
    if pad:
        bounds.append(bounds[-1] + pad)
    cu = torch.tensor(bounds, dtype=torch.int32) * mpu.get_context_parallel_world_size()
    longest = int((cu[1:] - cu[:-1]).max())
    batch["tokens"] = stream.unsqueeze(0)
    batch["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                 max_seqlen_q=longest, max_seqlen_kv=longest)
    # each mask on its sample's token positions: a mask entry for response token t sits at t's logit (t - 1)
    masks = [slice_with_cp(torch.nn.functional.pad(m, (T - R - 1, 1)), 0)
             for m, T, R in zip(batch["loss_masks"], batch["total_lengths"], batch["response_lengths"])]
    full, _ = _stream(masks, multiple)
    assert full.shape == stream.shape
    batch["full_loss_masks"] = full.unsqueeze(0)
    return batch
