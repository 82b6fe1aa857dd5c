"""Stand-in for Megatron-LM's megatron/training/checkpointing.py: slime's real checkpoint.py imports its
``load_checkpoint`` and ``save_checkpoint`` at the top (checkpoint.py:7-8 @624b824) and calls them only from
``initialize_model_and_optimizer`` and ``save`` (model.py:963, 1003), which the tier does not run: here they refuse."""


def load_checkpoint(*args, **kwargs):
    raise NotImplementedError("the slime source tier loads no checkpoint (stand-in of megatron.training.checkpointing)")


def save_checkpoint(*args, **kwargs):
    raise NotImplementedError("the slime source tier saves no checkpoint (stand-in of megatron.training.checkpointing)")
