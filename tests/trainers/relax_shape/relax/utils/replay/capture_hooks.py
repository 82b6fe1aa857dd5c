"""Stand-in for relax.utils.replay.capture_hooks (redai-studio/Relax @53ad8a4): the real loss.py calls
``capture_policy_loss(...)`` on every micro-batch, a no-op unless Relax's trajectory-replay capture is enabled
(it is not here)."""


def capture_policy_loss(**_):
    return None
