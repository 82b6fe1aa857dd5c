"""Stand-in for relax.utils.env.Envs (redai-studio/Relax relax/utils/env.py): the one setting the real
relax/engine/sft/runtime.py reads (inside a function the tiers do not call), at its default."""


class Envs:
    RELAX_SFT_TQ_SHARDS = 1
