"""slime.utils.misc.load_function: a function by dotted path (how slime loads every --custom-*-path)."""
import importlib


def load_function(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
