"""Relax's Megatron initialisation, the part the adapter sees (redai-studio/Relax
relax/backends/megatron/initialize.py @78973a5, L140-144: the last statement of ``init(args)`` loads
--custom-megatron-init-path and calls it with ``args``)."""
from megatron.core import parallel_state as mpu

from relax.utils.misc import load_function


def init(args):
    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                  context_parallel_size=args.context_parallel_size)
    if args.custom_megatron_init_path:
        load_function(args.custom_megatron_init_path)(args)
