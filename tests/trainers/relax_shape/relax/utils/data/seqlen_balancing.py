"""Stand-in for relax.utils.data.seqlen_balancing.get_seqlen_balanced_partitions (redai-studio/Relax), which the
real cp_utils.py's dynamic CP split calls to share a micro-batch's samples among CP sub-groups: longest first,
dealt round robin (the shape's own rule). Which sample lands in which sub-group is the data layer's choice; the
adapter finds each sample by its tokens."""


def get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size=False):
    order = sorted(range(len(seqlen_list)), key=lambda i: -seqlen_list[i])
    return [order[k::k_partitions] for k in range(k_partitions)]
