"""slime's metric logger, the call ``train`` makes (THUDM/slime slime/observability/logging_utils.py @624b824:
``log(args, metrics, step_key)``, model.py:898), kept in a list here (no wandb / tensorboard)."""
LOGGED = []


def log(args, metrics, step_key):
    LOGGED.append(dict(metrics))
