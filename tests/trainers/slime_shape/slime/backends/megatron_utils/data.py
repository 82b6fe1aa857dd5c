"""slime's micro-batch iterator and packed (THD) batch (THUDM/slime slime/backends/megatron_utils/data.py
@1c81073, main; 2f4bd0d (#1926) later dropped the ``micro_batch_size`` window: DataIterator.get_next selects
rows by ``micro_batch_indices[offset]`` or a contiguous window of ``micro_batch_size``; get_batch keeps the
samples whole as ``unconcat_tokens``, cuts each with slice_with_cp, concatenates them, pads the stream to a
multiple of TP x pad_multiplier and passes ``PackedSeqParams(qkv_format="thd")`` with the cumulative lengths
times CP). On the CPU here: no ``.cuda()``."""
import torch
from megatron.core import mpu
from megatron.core.packed_seq_params import PackedSeqParams

from .cp_utils import slice_with_cp


class DataIterator:
    def __init__(self, rollout_data, micro_batch_size=None, micro_batch_indices=None):
        assert micro_batch_size is None or micro_batch_indices is None
        self.rollout_data, self.micro_batch_size, self.micro_batch_indices = rollout_data, micro_batch_size, micro_batch_indices
        self.offset = 0

    def get_next(self, keys):
        if self.micro_batch_indices is not None:
            rows = self.micro_batch_indices[self.offset]
            self.offset += 1
        else:
            rows = list(range(self.offset, self.offset + self.micro_batch_size))
            self.offset += self.micro_batch_size
        out = {}
        for key in keys:
            values = self.rollout_data.get(key)
            out[key] = None if values is None else [values[i] for i in rows]
        return out

    def reset(self):
        self.offset = 0
        return self


def get_batch(data_iterator, keys, pad_multiplier=128, qkv_format="thd"):
    assert "tokens" in keys and qkv_format == "thd"
    batch = data_iterator.get_next(keys)
    samples = batch["tokens"]
    batch["unconcat_tokens"] = samples
    pieces = [slice_with_cp(t, 0) for t in samples]
    bounds = [0]
    for p in pieces:
        bounds.append(bounds[-1] + p.numel())
    stream = torch.cat(pieces)
    multiple = mpu.get_tensor_model_parallel_world_size() * pad_multiplier
    pad = (-stream.numel()) % multiple
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
        bounds.append(bounds[-1] + pad)
    cu = torch.tensor(bounds, dtype=torch.int32) * mpu.get_context_parallel_world_size()
    longest = int((cu[1:] - cu[:-1]).max())
    batch["tokens"] = stream.unsqueeze(0)
    batch["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                 max_seqlen_q=longest, max_seqlen_kv=longest)
    return batch
