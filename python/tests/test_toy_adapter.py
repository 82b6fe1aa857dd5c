"""examples/toy_adapter.py, the "write an adapter" page's whole adapter (docs/adapters/write-an-adapter.md), as
a user runs it: the right loop passes and its step is applied; the loop that divides each micro-batch by its own
count is stopped by fail fast before the update, with the parameters unchanged, and audit names the unit and
the trainer's function. Needs the lossguard binary (LOSSGUARD_BIN or build/cli/lossguard)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "toy_adapter.py")
LOSSGUARD = os.environ.get("LOSSGUARD_BIN", os.path.join(ROOT, "build", "cli", "lossguard"))
needs_bin = pytest.mark.skipif(not os.path.exists(LOSSGUARD), reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")


def run(out, *flags):
    r = subprocess.run([sys.executable, EXAMPLE, "--out", str(out), "--lossguard-bin", LOSSGUARD, *flags],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(out, "audit-step000000.json")) as f:
        return r, json.load(f)


@needs_bin
def test_the_right_loop_passes_and_steps(tmp_path):
    r, report = run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "training finished; step 0 audited: pass" in r.stdout, r.stdout
    assert report["verdict"] == "pass"
    assert os.path.exists(tmp_path / "step000000" / "step000000-rank00000.safetensors")
    assert not os.path.exists(tmp_path / "step000001")                # steps=(0,): step 1 is not recorded


@needs_bin
def test_a_mean_per_micro_batch_is_stopped_before_the_update(tmp_path):
    r, report = run(tmp_path, "--bug")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "training stopped at step 0 by lossguard audit (exit 1); parameters unchanged" in r.stdout, r.stdout
    assert report["verdict"] == "fail"
    step = report["steps"][0]
    weights = [c for c in step["checks"] if c["name"] == "weights"][0]
    assert weights["ok"] is False and "per-micro-batch normalisation" in weights["detail"], weights
    assert "in ToyLoop.train_step" in (step["diagnosis"]["advice"] or ""), step["diagnosis"]
