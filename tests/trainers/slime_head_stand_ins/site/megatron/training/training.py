"""Stand-in for Megatron-LM's ``megatron.training.training.get_model``, which slime's real
``setup_model_and_optimizer`` calls as ``get_model(get_model_provider_func(args, role), ModelType.encoder_or_decoder)``
(model.py:24, 293 @624b824). Like Megatron-LM's, it builds this pipeline stage's model with the provider —
``pre_process`` on the first stage, ``post_process`` on the last (one model chunk: no virtual pipeline) — and wraps
it in megatron-core's ``DistributedDataParallel`` with the model's config and a default
``DistributedDataParallelConfig`` (no overlap, no distributed optimizer: the tier's args leave them off), returning
the list of chunks slime's model functions take. The model's own parameters and the DDP wrapper are megatron-core's."""
from megatron.core import mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.utils import get_model_config


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    assert mpu.get_virtual_pipeline_model_parallel_world_size() in (None, 1), "one model chunk per stage here"
    model = model_provider_func(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    model.model_type = model_type
    if not wrap_with_ddp:
        return [model]
    return [DistributedDataParallel(get_model_config(model), DistributedDataParallelConfig(), model)]
