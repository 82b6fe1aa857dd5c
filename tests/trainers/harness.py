"""What every trainer test shares (one harness, issue #56): the lossguard binary, the environment of a child
trainer process, a run of ``lossguard audit`` and the bit-for-bit equality of what two runs saved.

    from harness import LOSSGUARD, HAVE_BIN, needs_bin, child_env, audit, audit_json, same, assert_same_runs
"""
import json
import math
import os
import subprocess

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
#: the binary under test: $LOSSGUARD_BIN (ctest sets it), else the build tree's
LOSSGUARD = os.environ.get("LOSSGUARD_BIN", os.path.join(ROOT, "build", "cli", "lossguard"))
HAVE_BIN = os.path.isfile(LOSSGUARD) and os.access(LOSSGUARD, os.X_OK)
needs_bin = pytest.mark.skipif(not HAVE_BIN, reason="the lossguard binary is not built")


def child_env(quiet_warnings=True, **extra):
    """A child trainer's environment: one OpenMP thread per process (several ranks share two cores),
    unbuffered output; Python's warnings off unless a test reads them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    if quiet_warnings:
        env["PYTHONWARNINGS"] = "ignore"
    return env


def audit_json(*args):
    """``lossguard audit ARGS --json -``: (exit code, the JSON document or None, stderr)."""
    r = subprocess.run([LOSSGUARD, "audit", *args, "--json", "-"], capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else None
    return r.returncode, doc, r.stderr


def audit(*args):
    """:func:`audit_json` and the text report of the same run: (exit code, document, stderr, text)."""
    rc, doc, err = audit_json(*args)
    text = subprocess.run([LOSSGUARD, "audit", *args], capture_output=True, text=True, timeout=120).stdout
    return rc, doc, err, text


def step_checks(*args):
    """The first step of ``lossguard audit ARGS``: (exit code, its checks by name, the step)."""
    rc, doc, err = audit_json(*args)
    assert doc is not None, err
    step = doc["steps"][0]
    return rc, {c["name"]: c for c in step["checks"]}, step


def same(x, y):
    """Bit for bit: tensors of one dtype and shape with the same bytes (NaN equal to itself, -0.0 not
    to 0.0), dicts, lists and tuples element by element, floats with NaN == NaN, else ==."""
    if isinstance(x, torch.Tensor):
        return (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and
                torch.equal(x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8)))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    return x == y


def assert_same_runs(adapter_dir, plain_dir, world, steps):
    """The run with the adapter and the plain one from the same seed (slime_relax_driver.py's layout) saved the
    same bits: every rank's final parameters and each step's ``main_grad``, and the same result record once the
    adapter's ``user_hooks`` is taken out — the user's own hooks, chained after lossguard's
    (``LOSSGUARD_CHAIN_*``), ran once at init and once a step of rollout 0. Returns each rank's record."""
    records = []
    for r in range(world):
        for name in (f"final-rank{r}.pt", *[f"grads-step{n}-rank{r}.pt" for n in range(steps)]):
            assert same(torch.load(os.path.join(adapter_dir, name)), torch.load(os.path.join(plain_dir, name))), \
                (name, r)
        with open(os.path.join(adapter_dir, f"result-rank{r}.json")) as f, \
                open(os.path.join(plain_dir, f"result-rank{r}.json")) as g:
            ja, jp = json.load(f), json.load(g)
        assert ja.pop("user_hooks") == {"init": 1, "steps": [[0, n] for n in range(steps)]}, r
        assert ja == jp, r
        records.append(ja)
    return records
