"""slime's training step (THUDM/slime slime/backends/megatron_utils/model.py @172db7d, with
step_global_batch_size as @00b5ed0 passes it): ``train`` sets ``config.grad_scale_func`` and
``config.finalize_model_grads_func`` anew at every call (once per rollout) and runs ``train_one_step`` per
step; ``train_one_step`` zeroes the gradient buffers and the optimizer, calls the
--custom-megatron-before-train-step-hook-path hook with (args, rollout_id, step_id, model, optimizer,
opt_param_scheduler), runs forward_backward_func over one DataIterator per model chunk with a forward step
that returns ``partial(loss_function, args, batch, num_microbatches, step_global_batch_size)``, steps the
optimizer (asserting success) and the scheduler by step_global_batch_size, zeroes the gradients again and, on
the last stage, all-reduces the reported values over DP x CP.  No zero-token skip (slime has none)."""
from functools import partial

import torch
from megatron.core import mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from slime.utils.misc import load_function

from .data import get_batch
from .loss import loss_function

TRAIN_KEYS = ["tokens", "packed_seq_params", "total_lengths", "response_lengths", "loss_masks", "log_probs",
              "ref_log_probs", "advantages", "rollout_mask_sums"]


def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                   num_microbatches, step_global_batch_size):
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
        return output, partial(loss_function, args, batch, num_microbatches, step_global_batch_size)

    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                                         num_microbatches=num_microbatches, seq_length=args.seq_length,
                                         micro_batch_size=args.micro_batch_size, forward_only=False)
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful
    opt_param_scheduler.step(increment=step_global_batch_size)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        keys = losses[0]["keys"]
        values = sum(x["values"] for x in losses)
        torch.distributed.all_reduce(values, group=mpu.get_data_parallel_group(with_context_parallel=True))
        return dict(zip(["count"] + keys, values.tolist())), grad_norm
    return {}, grad_norm


def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches,
          step_global_batch_sizes, args):
    for it in data_iterator:
        it.reset()
    for chunk in model:
        chunk.train()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    out = []
    for step_id in range(len(num_microbatches)):
        out.append(train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                                  num_microbatches[step_id], step_global_batch_sizes[step_id]))
    return out
