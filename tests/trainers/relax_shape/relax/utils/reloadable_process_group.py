"""Stand-in for relax.utils.reloadable_process_group (redai-studio/Relax @53ad8a4): the real cp_utils.py only
asks ``isinstance(group, ReloadableProcessGroup)`` (its warm-up of reloadable groups); Megatron's groups here
are plain torch.distributed groups, never one of these."""


class ReloadableProcessGroup:
    pass
