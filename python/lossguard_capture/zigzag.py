"""Zig-zag context-parallel sharding and the token ownership rule (lossguard docs/semantics.md §2).

With CP size ``cp > 1`` each sample of ``T`` tokens is right-padded and cut into ``2*cp`` chunks of
``cs = ceil(T / (2*cp))`` positions (or ``padded_total_length / (2*cp)``); CP rank ``r`` holds chunk
``r`` and chunk ``2*cp-1-r``.  A response token at position ``t`` is *owned* by the rank holding the
logit that predicts it (position ``t-1``), not by the rank holding the token.

These helpers are plain Python (no torch) so a trainer can build its local order cheaply.
"""


__all__ = [
    "zigzag_chunk_size",
    "zigzag_slices",
    "zigzag_owned",
    "zigzag_owned_logit_positions",
    "owned_count",
    "zigzag_local_logit_index",
]


def _check(total_length: int, response_length: int, cp_size: int, cp_rank: int) -> None:
    if total_length < 0 or response_length < 0:
        raise ValueError(f"negative length: total_length={total_length}, response_length={response_length}")
    if response_length > total_length:
        raise ValueError(f"response_length {response_length} > total_length {total_length}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")


def zigzag_chunk_size(total_length: int, cp_size: int, padded_total_length: int | None = None) -> int:
    """``ceil(T / (2*cp))``, or ``padded_total_length / (2*cp)`` when a padded length is given."""
    if padded_total_length is not None:
        if padded_total_length < total_length or padded_total_length % (2 * cp_size):
            raise ValueError(
                f"padded_total_length {padded_total_length} must be >= total_length {total_length} "
                f"and a multiple of 2*cp = {2 * cp_size}")
        return padded_total_length // (2 * cp_size)
    return -(-total_length // (2 * cp_size))


def zigzag_slices(total_length: int, cp_size: int, cp_rank: int,
                  padded_total_length: int | None = None, clip: bool = True) -> list[tuple[int, int]]:
    """The two position ranges ``[start, end)`` CP rank ``cp_rank`` holds: chunk ``r`` then chunk ``2cp-1-r``.

    With ``clip=True`` (default) the ranges are clipped to the real positions ``[0, T)`` (the padding is
    not part of the sample; a range may then be empty, ``start == end``); with ``clip=False`` they are the
    chunks of the padded sequence.  ``cp_size == 1`` gives ``[(0, T), (T, T)]`` (clipped).
    """
    _check(total_length, 0, cp_size, cp_rank)
    if cp_size == 1:
        end = total_length if padded_total_length is None or clip else padded_total_length
        return [(0, end), (end, end)]
    cs = zigzag_chunk_size(total_length, cp_size, padded_total_length)
    out = []
    for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
        s, e = k * cs, (k + 1) * cs
        if clip:
            s, e = min(s, total_length), min(e, total_length)
        out.append((s, e))
    return out


def zigzag_owned_logit_positions(total_length: int, response_length: int, cp_size: int, cp_rank: int,
                                 padded_total_length: int | None = None) -> list[int]:
    """Logit positions (ascending) whose predicted response token this rank owns.

    For an RL sample (``R < T``) position ``p`` predicts response index ``p + 1 - P``; for an SFT sample
    (``R == T``) position ``p`` is predictor index ``p``.  At ``cp_size == 1`` the rank owns every
    response index, including an SFT sample's last index ``T-1`` (its logit has no target).
    """
    idx = zigzag_owned(total_length, response_length, cp_size, cp_rank, padded_total_length)
    if response_length == total_length:          # SFT: predictor indices are logit positions
        return idx
    prompt = total_length - response_length
    return [prompt - 1 + j for j in idx]


def zigzag_owned(total_length: int, response_length: int, cp_size: int, cp_rank: int,
                 padded_total_length: int | None = None) -> list[int]:
    """Response indices (mask indices) owned by ``cp_rank``, ascending — docs/semantics.md §2 exactly.

    For each chunk ``k`` of the rank: ``logits_k = [max(start, P-1), min(end, T-1))``; an RL sample
    (``R < T``) owns response indices ``logits_k + 1 - P``; an SFT sample (``R == T``) owns predictor
    indices ``logits_k`` (so index ``T-1`` is never owned at ``cp > 1``).  ``cp_size == 1`` owns all
    ``0 .. R-1``.  ``R == 0`` owns nothing.
    """
    _check(total_length, response_length, cp_size, cp_rank)
    T, R = total_length, response_length
    if R == 0:
        return []
    if cp_size == 1:
        return list(range(R))
    P = T - R
    sft = R == T
    owned = []
    for s, e in zigzag_slices(T, cp_size, cp_rank, padded_total_length, clip=False):
        lo, hi = max(s, P - 1), min(e, T - 1)
        for pos in range(lo, hi):
            owned.append(pos if sft else pos + 1 - P)
    owned.sort()
    return owned


def owned_count(total_length: int, response_length: int, cp_size: int, cp_rank: int,
                padded_total_length: int | None = None) -> int:
    """``len(zigzag_owned(...))``: the number of response tokens (masked or not) this rank owns."""
    return len(zigzag_owned(total_length, response_length, cp_size, cp_rank, padded_total_length))


def zigzag_local_logit_index(total_length: int, response_length: int, cp_size: int, cp_rank: int,
                             padded_total_length: int | None = None) -> list[int]:
    """Where the owned tokens' logits sit in the rank's local shard of the sample, ascending.

    The local shard is chunk ``r`` followed by chunk ``2cp-1-r`` of the padded sample (``2*cs``
    positions: Megatron's THD layout per sample); a logit at position ``p`` is at local index ``p - s0``
    in the first chunk and ``cs + p - s1`` in the second.  At ``cp_size == 1`` the local index is the
    position.  Add the sample's offset in the rank's packed stream to index a packed per-token tensor.
    """
    pos = zigzag_owned_logit_positions(total_length, response_length, cp_size, cp_rank, padded_total_length)
    if cp_size == 1:
        return pos
    cs = zigzag_chunk_size(total_length, cp_size, padded_total_length)
    (s0, e0), (s1, _) = zigzag_slices(total_length, cp_size, cp_rank, padded_total_length, clip=False)
    return [p - s0 if s0 <= p < e0 else cs + p - s1 for p in pos]
