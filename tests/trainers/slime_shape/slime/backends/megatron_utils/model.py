"""slime's training step (THUDM/slime slime/backends/megatron_utils/model.py @624b824, main, with its
step_global_batch_size): ``train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator,
num_microbatches, global_batch_sizes)`` (model.py:703-940) reads the args with ``get_args()`` (L738), resets the
iterators, sets ``config.grad_scale_func`` and ``config.finalize_model_grads_func`` anew at every call (once per
rollout), runs ``train_one_step`` per step, logs each step's report and gradient norm through
``logging_utils.log`` (L874-898, on the DP x CP rank 0 of the last stage) and returns nothing;
``train_one_step(rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler, num_microbatches,
step_global_batch_size)`` (L526-700; args by ``get_args()``, L550) zeroes the gradient buffers and the
optimizer, calls the --custom-megatron-before-train-step-hook-path hook with (args, rollout_id, step_id, model,
optimizer, opt_param_scheduler), runs forward_backward_func over one DataIterator per model chunk with a forward
step that passes the batch's ``full_loss_masks`` to the model as ``loss_mask`` (L630) and returns
``partial(loss_function, args, batch, num_microbatches, step_global_batch_size)``, steps the optimizer (asserting
success; slime's valid_step is always true with --check-for-nan-in-loss-and-grad at its default, L659-686) and
the scheduler by step_global_batch_size, zeroes the gradients again and, on the last stage, returns
``reduce_train_step_metrics``' report (L694-700) with the gradient norm. No zero-token skip (slime has none).

For slime's real loss module at older commits (tests/trainers/test_slime_history.py, the driver's
--slime-src): there ``loss_function(args, batch, num_microbatches, logits)`` takes no step_global_batch_size
(the forward step passes ``partial(loss_function, args, batch, num_microbatches)``, model.py:437 @9e5a857 and
@f9f00b2) and the policy loss reads the old log-probs from the batch, which slime's actor computes before
training with ``forward_only(get_log_probs_and_entropy, ...)`` (actor.py:365-375 @9e5a857): both here."""
import inspect
from functools import partial

import torch
from megatron.core import mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config
from megatron.training.global_vars import get_args

from slime.observability import logging_utils, train_metric_utils
from slime.utils.misc import load_function

from .data import get_batch
from .loss import loss_function

TRAIN_KEYS = ["tokens", "packed_seq_params", "total_lengths", "response_lengths", "loss_masks", "log_probs",
              "ref_log_probs", "advantages", "rollout_mask_sums"]       # model.py:580-601, those the shape's loss reads


def train_one_step(rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler, num_microbatches,
                   step_global_batch_size):
    args = get_args()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if args.custom_megatron_before_train_step_hook_path:
        load_function(args.custom_megatron_before_train_step_hook_path)(
            args, rollout_id, step_id, model, optimizer, opt_param_scheduler)

    def forward_step(data_iterator, model, return_schedule_plan=False):
        batch = get_batch(data_iterator, TRAIN_KEYS, args.data_pad_size_multiplier, args.allgather_cp)
        output = model(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                       packed_seq_params=batch["packed_seq_params"], loss_mask=batch["full_loss_masks"])
        # step_global_batch_size only to a loss_function that takes it (module docstring)
        takes_gbs = "step_global_batch_size" in inspect.signature(loss_function).parameters
        extra = (step_global_batch_size,) if takes_gbs else ()
        return output, partial(loss_function, args, batch, num_microbatches, *extra)

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
        return train_metric_utils.reduce_train_step_metrics(
            losses, calculate_per_token_loss=args.calculate_per_token_loss,
            step_global_batch_size=step_global_batch_size, cp_size=mpu.get_context_parallel_world_size(),
            dp_with_cp_group=mpu.get_data_parallel_group(with_context_parallel=True)), grad_norm
    return {}, grad_norm


def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches, global_batch_sizes):
    args = get_args()
    assert len(num_microbatches) == len(global_batch_sizes)
    for it in data_iterator:
        it.reset()
    for chunk in model:
        chunk.train()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    for step_id in range(len(num_microbatches)):
        report, grad_norm = train_one_step(rollout_id, step_id, data_iterator, model, optimizer,
                                           opt_param_scheduler, num_microbatches[step_id],
                                           global_batch_sizes[step_id])
        if (mpu.get_data_parallel_rank(with_context_parallel=True) == 0 and mpu.get_tensor_model_parallel_rank() == 0
                and mpu.is_pipeline_last_stage(ignore_virtual=True)):
            logged = {f"train/{k}": v for k, v in report.items()}
            logged.update({"train/grad_norm": grad_norm, "train/global_batch_size": global_batch_sizes[step_id],
                           "train/step": rollout_id * len(num_microbatches) + step_id})
            logging_utils.log(args, logged, step_key="train/step")


@torch.no_grad()
def forward_only(f, args, model, data_iterator, num_microbatches, store_prefix=""):
    """slime's forward-only pass collecting ``f``'s outputs per sample (model.py:156-288 @9e5a857/@f9f00b2):
    without autograd (L156), the iterators reset, eval mode, a forward step over get_batch's ``tokens``/
    ``total_lengths``/``response_lengths`` returning ``partial(f, args=, unconcat_tokens=, total_lengths=,
    response_lengths=, with_entropy=args.use_rollout_entropy)`` (L212-235), forward_backward_func(forward_only=True,
    collect_non_loss_data=True) once per step (L252-263), train mode again, and on the last stage each key's
    per-sample lists concatenated in micro-batch order, put back in rollout order by ``micro_batch_indices``
    (L271-287; slime does that under --use-dynamic-batch-size, the only case its iterator has them)."""
    for it in data_iterator:
        it.reset()

    def forward_step(data_iterator, model, return_schedule_plan=False):
        batch = get_batch(data_iterator, ["tokens", "loss_masks", "total_lengths", "response_lengths"],
                          args.data_pad_size_multiplier, args.allgather_cp)
        output = model(input_ids=batch["tokens"], position_ids=None, attention_mask=None, labels=None,
                       packed_seq_params=batch["packed_seq_params"], loss_mask=batch["full_loss_masks"])
        return output, partial(f, args=args, unconcat_tokens=batch["unconcat_tokens"],
                               total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
                               with_entropy=args.use_rollout_entropy)

    for chunk in model:
        chunk.eval()
    store = []
    for n in num_microbatches:
        store += get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                                             num_microbatches=n, seq_length=args.seq_length,
                                             micro_batch_size=args.micro_batch_size, forward_only=True,
                                             collect_non_loss_data=True)
    for chunk in model:
        chunk.train()
    out = {}
    if mpu.is_pipeline_last_stage():
        for key in store[0]:
            values = [v for x in store for v in x[key]]
            order = data_iterator[0].micro_batch_indices
            if order is not None:
                placed = [None] * len(values)
                for v, i in zip(values, [i for mb in order for i in mb]):
                    placed[i] = v
                values = placed
            out[f"{store_prefix}{key}"] = values
    return out
