"""`lossguard audit` as the audit tests call it: the binary ($LOSSGUARD_BIN, else build/cli/lossguard), its
JSON report, and the checks and terms in it."""
import json
import os
import subprocess

from safetensors import safe_open
from safetensors.torch import load_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
LOSSGUARD = os.environ.get("LOSSGUARD_BIN", os.path.join(ROOT, "build", "cli", "lossguard"))


def audit(*args):
    """(exit code, the JSON report or None, stderr) of `lossguard audit ARGS --json -`."""
    assert os.path.exists(LOSSGUARD), f"{LOSSGUARD} not built (set LOSSGUARD_BIN)"
    r = subprocess.run([LOSSGUARD, "audit", *[str(a) for a in args], "--json", "-"], capture_output=True,
                       text=True, timeout=120)
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else None
    return r.returncode, doc, r.stderr


def check_of(step_doc, name):
    """The check `name` of one step of the report (an assertion error listing them when absent)."""
    found = [c for c in step_doc["checks"] if c["name"] == name]
    assert found, f"no check {name!r} among {[c['name'] for c in step_doc['checks']]}"
    return found[0]


def term_of(step_doc, name):
    """The term `name` of one step of the report."""
    found = [t for t in step_doc.get("terms", []) if t["name"] == name]
    assert found, f"no term {name!r} among {[t['name'] for t in step_doc.get('terms', [])]}"
    return found[0]


def load_step(directory, step, world):
    """Every rank's capture of one step: ({rank: tensors}, {rank: metadata})."""
    cap, meta = {}, {}
    for r in range(world):
        path = os.path.join(directory, f"step{step:06d}-rank{r:05d}.safetensors")
        cap[r] = load_file(path)
        with safe_open(path, framework="pt") as f:
            meta[r] = f.metadata()
    return cap, meta
