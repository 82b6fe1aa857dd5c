"""Stand-in for Megatron-LM's megatron/training/global_vars.py: the process-wide args.

slime @624b824 imports ``set_args`` and ``_build_tokenizer`` in initialize.py:9 (``init`` calls ``set_args(args)`` at
initialize.py:57 and ``_build_tokenizer(args)`` at :77) and ``get_args`` in model.py:23 and checkpoint.py:9
(``train_one_step`` reads its args back with it at model.py:550, ``train`` at :738). Megatron-LM keeps them in a
module global; so does this. The tier feeds token ids, so no tokenizer is built (``_build_tokenizer`` returns None,
as Megatron's does when none is asked for)."""

_GLOBAL_ARGS = None


def set_args(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def get_args():
    assert _GLOBAL_ARGS is not None, "args is not initialized (slime's init calls set_args first)"
    return _GLOBAL_ARGS


def _build_tokenizer(args):
    return None
