"""What the adapter overhead benchmarks share (bench/adapter_overhead.py: the HF Trainer;
bench/megatron_overhead.py: megatron-core's schedule at PP 1 and 2): the four modes, a timer around one module
function, the count of host-sync-prone calls made by lossguard_capture's own code, and the summary of a mode's
step times as ratios to ``plain`` measured in the same run.
"""
import os
import statistics
import sys
import time

import torch

#: plain: no adapter (the reference); attached: installed, no step recorded; recording: every step recorded and
#: written, never audited; default: step 0 recorded and audited (fail fast) before its update
MODES = ("plain", "attached", "recording", "default")
#: tensor methods that read a value on the host (on a device: a synchronisation each), and functions whose
#: output size or value depends on the data: torch.equal, nonzero, masked_select, indexing with a bool mask
SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "nonzero", "masked_select")
SYNC_FUNCTIONS = ("equal", "nonzero", "masked_select")


class Timed:
    """Wraps a module function, summing its wall time."""

    def __init__(self, module, name):
        self.module, self.name, self.total = module, name, 0.0
        self.orig = getattr(module, name)

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return self.orig(*a, **k)
            finally:
                self.total += time.perf_counter() - t
        setattr(module, name, wrapped)

    def restore(self):
        setattr(self.module, self.name, self.orig)


class SyncCounter:
    """Counts host-sync-prone tensor calls made by lossguard_capture's code (the first caller outside torch's
    own Python code is a lossguard_capture file: the trainer's own calls under the adapter's wrapper are not),
    split by ``at_step_end``, which the benchmark sets when the adapter's step end begins."""

    def __init__(self, host_only_functions=()):
        #: adapter functions whose calls read only tensors the adapter built on the host itself (no device
        #: memory): counted apart, in host_only
        self.host_only_functions = frozenset(host_only_functions)
        self.before_end = self.at_end = self.host_only = 0
        self.at_step_end = False
        self._saved = {}
        self._inside = False
        self.where_before = {}         # file:line -> calls before the step's end

    def _count(self):
        f = sys._getframe(1)          # the first caller outside torch's own Python code and this file
        while f is not None and (f"{os.sep}torch{os.sep}" in f.f_code.co_filename
                                 or f.f_code.co_filename == __file__):
            f = f.f_back
        if f is not None and "lossguard_capture" in f.f_code.co_filename:
            if f.f_code.co_name in self.host_only_functions:
                self.host_only += 1
            elif self.at_step_end:
                self.at_end += 1
            else:
                self.before_end += 1
                where = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
                self.where_before[where] = self.where_before.get(where, 0) + 1

    def __enter__(self):
        targets = [(torch.Tensor, n) for n in SYNC_METHODS] + [(torch, n) for n in SYNC_FUNCTIONS]
        for owner, name in targets:
            orig = getattr(owner, name)
            self._saved[(owner, name)] = orig

            def counted(*a, _orig=orig, **k):
                if self._inside:          # the same call again, through the mode below: counted once
                    return _orig(*a, **k)
                self._count()
                self._inside = True
                try:
                    return _orig(*a, **k)
                finally:
                    self._inside = False
            setattr(owner, name, counted)
        # indexing with a bool mask, seen through a TorchFunctionMode: replacing Tensor.__getitem__ by a Python
        # function would make torch.tensor([t0, t1]) read 0-d tensors as sequences (megatron-core's grad norm)
        self._mode = _BoolIndexMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(None, None, None)
        for (owner, name), orig in self._saved.items():
            setattr(owner, name, orig)


class _BoolIndexMode(torch.overrides.TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) > 1 and not self.counter._inside:
            parts = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self.counter._count()
        return func(*args, **(kwargs or {}))


def summarise(steps):
    """``steps``: mode -> step times (s). Per mode: min, median, their ratios to plain's (the min's is the steadier
    on a loaded machine: noise only adds time), count."""
    ref, ref_min = statistics.median(steps["plain"]), min(steps["plain"])
    return {m: {"min_ms": min(t) * 1e3, "median_ms": statistics.median(t) * 1e3,
                "ratio_median": statistics.median(t) / ref, "ratio_min": min(t) / ref_min, "n": len(t)}
            for m, t in steps.items()}


def show_modes(modes):
    print(f"  {'mode':<10} {'min ms':>9} {'median ms':>10} {'x plain (min)':>14} {'x plain (median)':>17} {'steps':>6}")
    for m, v in modes.items():
        print(f"  {m:<10} {v['min_ms']:9.1f} {v['median_ms']:10.1f} {v['ratio_min']:14.3f} {v['ratio_median']:17.3f} "
              f"{v['n']:6d}")
