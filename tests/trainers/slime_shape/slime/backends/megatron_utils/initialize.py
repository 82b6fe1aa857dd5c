"""slime's Megatron initialisation, the part the adapter sees (THUDM/slime
slime/backends/megatron_utils/initialize.py @624b824: ``init`` keeps ``args`` as Megatron-LM's process-wide args
(``set_args``, initialize.py:57; ``train`` and ``train_one_step`` read them back with ``get_args``), sets up the
parallel state and loads --custom-megatron-init-path and calls it with ``args``). Megatron-LM's
``megatron.training.global_vars`` is the source tier's stand-in (tests/trainers/slime_head_stand_ins/site)."""
from megatron.core import parallel_state as mpu
from megatron.training.global_vars import set_args

from slime.utils.misc import load_function


def init(args):
    set_args(args)
    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                  context_parallel_size=args.context_parallel_size)
    if args.custom_megatron_init_path:
        load_function(args.custom_megatron_init_path)(args)
