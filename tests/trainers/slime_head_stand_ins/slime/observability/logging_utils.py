"""Stand-in for slime/observability/logging_utils.py @624b824, which imports wandb and slime's TensorBoard adapter
at the top (logging_utils.py:3-6; neither installed here). slime's ``train`` logs every step's reduced losses,
grad norm, learning rates and step through ``logging_utils.log(args, log_dict, step_key="train/step")``
(model.py:874-898 @624b824, on the DP-rank-0 / TP-rank-0 / last-stage rank); the real ``log``
(logging_utils.py:45-51) sends them to wandb and TensorBoard only when ``args.use_wandb`` / ``args.use_tensorboard``
(both off in the tier). This one keeps them in :data:`LOGGED` — what the tier compares with and without the
audit — and sends them nowhere."""

LOGGED = []


def log(args, metrics, step_key: str):
    """logging_utils.py:45 @624b824's signature: (args, metrics, step_key)."""
    LOGGED.append(dict(metrics))
