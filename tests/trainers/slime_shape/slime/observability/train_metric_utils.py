"""slime's per-step report (THUDM/slime slime/observability/train_metric_utils.py @624b824,
``reduce_train_step_metrics``, L18-59): the micro-batches' ``values`` ([count, metric...]) summed on this rank,
all-reduced over DP x CP, then each metric divided — per-token: by the all-reduced token count (values[0]) and
multiplied by CP (every CP rank counted the whole masks); otherwise by the step's global batch size."""
import torch.distributed as dist


def reduce_train_step_metrics(losses_reduced, *, calculate_per_token_loss, step_global_batch_size, cp_size,
                              dp_with_cp_group):
    keys = losses_reduced[0]["keys"]
    total = sum(x["values"] for x in losses_reduced)
    assert total.numel() == len(keys) + 1
    dist.all_reduce(total, group=dp_with_cp_group)
    count, *metrics = total.tolist()
    factor, divisor = (cp_size, count) if calculate_per_token_loss else (1, step_global_batch_size)
    return {k: v * factor / divisor for k, v in zip(keys, metrics)}
