"""relax.utils.misc.load_function (redai-studio/Relax relax/utils/misc.py @b71db72, L29-37): by dotted path."""
import importlib


def load_function(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
