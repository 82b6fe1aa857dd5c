"""Relax's training step (redai-studio/Relax relax/backends/megatron/model.py @36882ca, train_one_step
L1058-1464): zero the gradient buffers and the optimizer; the --custom-megatron-before-train-step-hook-path
hook with (args, rollout_id, step_id, model, optimizer, opt_param_scheduler); forward_backward_func over one
DataIterator per model chunk, the forward step returning ``partial(loss_function, args, batch,
num_microbatches, lm_head_forward=None)``; ``_is_global_zero_token_step`` (L1023-1055, PR #285: the last
stage sums its micro-batches' ``num_tokens`` and all-reduces over DP x CP, the decision broadcast from the
pipeline's last GLOBAL rank over the pipeline group) skips the optimizer AND the scheduler; otherwise
optimizer.step() and, for a valid step, the scheduler by step_global_batch_size; zero again; on the last
stage the reported values all-reduced over DP x CP and normalised by normalize_reduced_loss_metrics with the
count (per-token) or step_global_batch_size as the denominator."""
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from relax.utils.misc import load_function

from .data import get_batch
from .loss import loss_function, normalize_reduced_loss_metrics

TRAIN_KEYS = ["tokens", "packed_seq_params", "total_lengths", "response_lengths", "loss_masks", "log_probs",
              "ref_log_probs", "advantages", "sample_index_mask_sums"]


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
        output = model(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                       packed_seq_params=batch["packed_seq_params"])
        return output, partial(loss_function, args, batch, num_microbatches, lm_head_forward=None)

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
