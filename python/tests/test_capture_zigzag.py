"""zigzag_owned against SPEC §2's worked examples, written out by hand, plus the partition property."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lossguard_capture import owned_count, zigzag_owned, zigzag_owned_logit_positions, zigzag_slices  # noqa: E402

# (T, R, cp) -> owned response indices per CP rank, copied from the SPEC §2 table
SPEC_TABLE = [
    ((10, 4, 2), [[], [0, 1, 2, 3]]),
    ((16, 8, 2), [[5, 6, 7], [0, 1, 2, 3, 4]]),
    ((12, 5, 4), [[], [], [4], [0, 1, 2, 3]]),
    ((10, 0, 2), [[], []]),
    ((5, 4, 2), [[0, 1], [2, 3]]),
    ((7, 7, 2), [[0, 1], [2, 3, 4, 5]]),   # SFT: index 6 never owned
]


@pytest.mark.parametrize("case,want", SPEC_TABLE)
def test_spec_worked_examples(case, want):
    T, R, cp = case
    got = [zigzag_owned(T, R, cp, r) for r in range(cp)]
    assert got == want


def test_slices_spec_formula():
    # T=16, cp=2: cs=4; r0 holds [0,4) and [12,16); r1 holds [4,8) and [8,12)
    assert zigzag_slices(16, 2, 0) == [(0, 4), (12, 16)]
    assert zigzag_slices(16, 2, 1) == [(4, 8), (8, 12)]
    # T=10, cp=4: cs=2 (ceil(10/8)); r0: [0,2),[14,16)->clipped to [10,10); unclipped kept
    assert zigzag_slices(10, 4, 0) == [(0, 2), (10, 10)]
    assert zigzag_slices(10, 4, 0, clip=False) == [(0, 2), (14, 16)]
    assert zigzag_slices(10, 4, 3) == [(6, 8), (8, 10)]
    # padded length: cs = 32 / 4 = 8
    assert zigzag_slices(10, 2, 0, padded_total_length=32, clip=False) == [(0, 8), (24, 32)]
    assert zigzag_slices(5, 1, 0) == [(0, 5), (5, 5)]


def test_cp1_owns_everything_including_sft_last():
    assert zigzag_owned(10, 4, 1, 0) == [0, 1, 2, 3]
    assert zigzag_owned(7, 7, 1, 0) == list(range(7))
    assert zigzag_owned(0, 0, 1, 0) == []


def test_logit_positions():
    # RL: T=16, R=8, P=8: response index j is predicted by logit P-1+j
    assert zigzag_owned_logit_positions(16, 8, 2, 0) == [12, 13, 14]
    assert zigzag_owned_logit_positions(16, 8, 2, 1) == [7, 8, 9, 10, 11]
    # SFT: predictor index == logit position
    assert zigzag_owned_logit_positions(7, 7, 2, 1) == [2, 3, 4, 5]


def test_partition_exactly_once():
    for T in range(0, 30):
        for R in range(0, T + 1):
            for cp in (1, 2, 3, 4, 8):
                owned = [j for r in range(cp) for j in zigzag_owned(T, R, cp, r)]
                if R == T and cp > 1 and T > 0:      # SFT: 0..T-2 covered, T-1 never
                    want = list(range(T - 1))
                else:
                    want = list(range(R))
                assert sorted(owned) == want, (T, R, cp)
                assert len(set(owned)) == len(owned)
                assert sum(owned_count(T, R, cp, r) for r in range(cp)) == len(want)


def test_padded_partition():
    for T in range(1, 20):
        for R in range(0, T):
            owned = [j for r in range(2) for j in zigzag_owned(T, R, 2, r, padded_total_length=24)]
            assert sorted(owned) == list(range(R))


def test_invalid():
    with pytest.raises(ValueError):
        zigzag_owned(3, 4, 2, 0)
    with pytest.raises(ValueError):
        zigzag_owned(4, 2, 2, 2)
    with pytest.raises(ValueError):
        zigzag_owned(4, 2, 2, 0, padded_total_length=6)   # not a multiple of 2*cp


def test_local_logit_index():
    from lossguard_capture import zigzag_local_logit_index
    # T=16, cp=2, cs=4: r0's shard is positions [0,4) + [12,16); owned logits 12,13,14 -> local 4,5,6
    assert zigzag_local_logit_index(16, 8, 2, 0) == [4, 5, 6]
    # r1's shard is [4,8) + [8,12); owned logits 7..11 -> local 3, then 4..7
    assert zigzag_local_logit_index(16, 8, 2, 1) == [3, 4, 5, 6, 7]
    # padded: T=10 padded to 16 (cs=4); R=4, P=6: logits 5..8; r1 holds [4,8)+[8,12) -> 1,2,3,4
    assert zigzag_local_logit_index(10, 4, 2, 1, padded_total_length=16) == [1, 2, 3, 4]
    assert zigzag_local_logit_index(10, 4, 2, 0, padded_total_length=16) == []
    assert zigzag_local_logit_index(5, 4, 1, 0) == [0, 1, 2, 3]
