"""Relax's training step (redai-studio/Relax relax/backends/megatron/model.py @36882ca, train_one_step
L1058-1464): zero the gradient buffers and the optimizer; the --custom-megatron-before-train-step-hook-path
hook with (args, rollout_id, step_id, model, optimizer, opt_param_scheduler); forward_backward_func over one
DataIterator per model chunk, the forward step returning ``partial(loss_function, args, batch,
num_microbatches, lm_head_forward=None)``; ``_is_global_zero_token_step`` (L1023-1055, PR #285: the last
stage sums its micro-batches' ``num_tokens`` and all-reduces over DP x CP, the decision broadcast from the
pipeline's last GLOBAL rank over the pipeline group) skips the optimizer AND the scheduler; otherwise
optimizer.step() and, for a valid step, the scheduler by step_global_batch_size; zero again; on the last
stage the reported values all-reduced over DP x CP and normalised by normalize_reduced_loss_metrics with the
count (per-token) or step_global_batch_size as the denominator.

``--sft-chunked-logits`` (model.py L1249-1266 @36882ca: ``should_bypass_main_output_layer(args)``, runtime.py L184-193): the model is
called inside ``_bypass_output_layer`` (L118-206; the layer found by ``_find_lm_output_layer``, L88-115), which makes the main output layer hand back its input (the
hidden states) and yields a callable running the real output layer on a chunk; the forward step partials it into
``loss_function`` as ``lm_head_forward`` (L1281).  The two helpers below are restatements; the real-source tier compiles
Relax's own (tests/trainers/relax_source_manifest.json ``transplants``) over them."""
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config, unwrap_model

from relax.engine.sft.runtime import should_bypass_main_output_layer
from relax.utils.misc import load_function

from .data import get_batch
from .loss import loss_function, normalize_reduced_loss_metrics

TRAIN_KEYS = ["tokens", "packed_seq_params", "total_lengths", "response_lengths", "loss_masks", "log_probs",
              "ref_log_probs", "advantages", "rollout_log_probs", "sample_index_mask_sums"]


def _find_lm_output_layer(model):
    """The main output layer under the DDP / Float16 wrappers; None on a stage without one (an Identity)."""
    module = unwrap_model(model)
    for _ in range(4):
        layer = getattr(module, "output_layer", None)
        if layer is not None and not isinstance(layer, torch.nn.Identity):
            return layer
        module = getattr(module, "module", None)
        if module is None:
            return None
    return None


@contextmanager
def _bypass_output_layer(model, *, mtp_output_layer_calls=0, gather_passthrough=True) -> Iterator[Callable | None]:
    """While open, the output layer returns its input (the hidden states, no sequence parallelism here); yields
    ``lm_head(x)``: the layer's own forward on ``x``."""
    layer = _find_lm_output_layer(model)
    if layer is None:
        yield None
        return
    original = layer.forward

    def passthrough(input_, weight=None, runtime_gather_output=None, **kwargs):
        return input_, None

    def lm_head(input_, weight=None, runtime_gather_output=None):
        return original(input_, weight=weight, runtime_gather_output=runtime_gather_output)

    layer.forward = passthrough
    try:
        yield lm_head
    finally:
        del layer.forward


def _is_global_zero_token_step(losses_reduced):
    signal = torch.zeros(1, dtype=torch.int64)
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        count = torch.tensor([sum(int(x["num_tokens"]) for x in losses_reduced)], dtype=torch.int64)
        dist.all_reduce(count, group=mpu.get_data_parallel_group(with_context_parallel=True))
        signal = (count == 0).to(torch.int64)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(signal, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
    return bool(signal.item())


def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler, num_microbatches,
                   step_global_batch_size):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if args.custom_megatron_before_train_step_hook_path:
        load_function(args.custom_megatron_before_train_step_hook_path)(
            args, rollout_id, step_id, model, optimizer, opt_param_scheduler)

    def forward_step(data_iterator, model, return_schedule_plan=False):
        batch = get_batch(data_iterator, TRAIN_KEYS, args.data_pad_size_multiplier, args.qkv_format)
        kwargs = dict(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                      packed_seq_params=batch["packed_seq_params"])
        lm_head_forward = None
        if should_bypass_main_output_layer(args):
            with _bypass_output_layer(model) as lm_head_forward:
                output = model(**kwargs)
        else:
            output = model(**kwargs)
        return output, partial(loss_function, args, batch, num_microbatches, lm_head_forward=lm_head_forward)

    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                                         num_microbatches=num_microbatches, seq_length=args.seq_length,
                                         micro_batch_size=args.micro_batch_size, forward_only=False)
    if _is_global_zero_token_step(losses):
        update_successful, grad_norm = False, 0.0
    else:
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            opt_param_scheduler.step(increment=step_global_batch_size)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        keys = losses[0]["keys"]
        values = sum(x["values"] for x in losses)
        dist.all_reduce(values, group=mpu.get_data_parallel_group(with_context_parallel=True))
        values = values.tolist()
        denominator = values[0] if args.calculate_per_token_loss else step_global_batch_size
        return normalize_reduced_loss_metrics(keys, [denominator, *values[1:]]), grad_norm
    return {}, grad_norm


def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches, step_global_batch_sizes,
          args):
    for it in data_iterator:
        it.reset()
    for chunk in model:
        chunk.train()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return [train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                           num_microbatches[step_id], step_global_batch_sizes[step_id])
            for step_id in range(len(num_microbatches))]
