"""Test-only, pure-torch stand-in for the ``flash_attn.bert_padding`` functions verl <= 0.9.0 imports
(``verl/utils/attention_utils.py:30`` in 0.8.0 and 0.9.0), written from their documented behaviour: remove
the padding of a ``[batch, seqlen, ...]`` tensor by its attention mask, and put it back.  It exists only so
that verl <= 0.9.0 runs on a CPU machine (see ../README.md); the tests check it
(tests/trainers/test_verl.py::test_cpu_stand_in_bert_padding, ::test_dense_layout_is_the_nested_one)."""
from typing import Any

import torch


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows ``indices`` of ``tensor`` (its first axis), in that order; differentiable."""
    return torch.index_select(tensor, 0, indices.to(device=tensor.device, dtype=torch.long))


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int,
                                                                  torch.Tensor]:
    """``hidden_states`` ``[batch, seqlen, ...]`` without its padding.  A position is kept where
    ``attention_mask`` (or ``unused_mask``, positions kept but not counted as used) is non-zero.

    Returns ``(kept [nnz, ...], indices [nnz] (int64 positions in the flattened batch * seqlen),
    cu_seqlens [batch + 1] (int32, the running count of kept positions, from 0), max_seqlen (int, the most
    kept positions of one row), seqused [batch] (int32, the positions of each row attention_mask marks))``."""
    used = attention_mask != 0
    keep = used if unused_mask is None else (used | (unused_mask != 0))
    batch, seqlen = keep.shape
    per_row = keep.sum(dim=1).to(torch.int32)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=keep.device)
    cu_seqlens[1:] = torch.cumsum(per_row, dim=0)
    indices = torch.arange(batch * seqlen, device=keep.device)[keep.reshape(-1)]
    max_seqlen = int(per_row.max().item()) if batch else 0
    flat = hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used.sum(dim=1).to(torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of :func:`unpad_input`: ``hidden_states`` ``[nnz, ...]`` written at ``indices`` of a zero
    ``[batch, seqlen, ...]`` tensor; differentiable."""
    rest = tuple(hidden_states.shape[1:])
    out = torch.zeros((batch * seqlen, *rest), dtype=hidden_states.dtype, device=hidden_states.device)
    out = out.index_put((indices.to(device=out.device, dtype=torch.long),), hidden_states)
    return out.reshape(batch, seqlen, *rest)


def rearrange(tensor: Any, pattern: str, **axes_lengths: Any) -> Any:
    """flash-attn re-exports ``einops.rearrange``; verl imports the name with the others but the tested path
    never calls it.  Delegates to einops when it is installed."""
    try:
        import einops
    except ImportError as e:
        raise NotImplementedError("the CPU stand-in of flash_attn.bert_padding has no rearrange without einops "
                                  "(tests/trainers/cpu_stand_ins/README.md)") from e
    return einops.rearrange(tensor, pattern, **axes_lengths)
