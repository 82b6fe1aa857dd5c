"""Stand-in for slime/utils/memory_utils.py @624b824, which imports psutil at the top (memory_utils.py:4; not
installed here). slime/backends/megatron_utils/model.py:32 imports ``clear_memory`` from it; only
``initialize_model_and_optimizer`` (model.py:1002, 1014) calls it, which the tier does not run (it loads a
checkpoint). On the CPU there is no device cache to clear: a garbage collection."""
import gc


def clear_memory(clear_host_memory: bool = False):
    """memory_utils.py:13 @624b824's signature; here a gc.collect() (not called on the tier's path)."""
    gc.collect()
