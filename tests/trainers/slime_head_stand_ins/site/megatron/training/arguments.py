"""Stand-in for Megatron-LM's megatron/training/arguments.py: slime's real model_provider.py imports
``core_transformer_config_from_args`` at the top (model_provider.py:18 @624b824) and calls it only for its own
model (model_provider.py:134); the tier builds its tiny model through slime's ``--custom-model-provider-path``
branch instead (model_provider.py:97-116), so here it refuses."""


def core_transformer_config_from_args(args, config_class=None):
    raise NotImplementedError("the slime source tier builds its model with --custom-model-provider-path")
