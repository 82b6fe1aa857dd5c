#!/usr/bin/env python3
"""Detection power of `lossguard check`: the smallest relative weight error it catches.

For each dtype of the logits, each unit (one token, one sample, one CP rank) and eps from 1e-1 down
to 1e-6, the candidate is run with that unit's token weights multiplied by 1 + eps (the test-only
LOSSGUARD_TEST_MUTATION=weight-<unit>:<eps>), and check's verdict on the loss and on the gradient is
recorded. A gate is as good as the smallest error it catches: a real normalisation bug of 1% that
passes is a defect of the gate, not of the trainer.

Usage: bench/detection_power.py LOSSGUARD [--impl kernels] [--vocab 4096] [--out FILE.md]
Prints a Markdown table: per dtype, unit and quantity, the smallest eps caught (and "none" when even
1e-1 passes).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

EPS = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6]


def check(lg, dump, impl, mutation):
    env = dict(os.environ, LOSSGUARD_TEST_MUTATION=mutation)
    r = subprocess.run([lg, "check", dump, "--cp", "2", "--loss", "nll", "--reduce", "per-token",
                        "--impl", impl, "--json", "-"], env=env, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        sys.exit(f"check failed ({r.returncode}): {r.stderr}")
    case = json.loads(r.stdout[r.stdout.find("{"):])["cases"][0]
    return (not case["loss_value"]["ok"]), (not case["grad"]["ok"]), case


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lossguard")
    ap.add_argument("--impl", default="kernels")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ["float32", "bfloat16", "float16"]:
            dump = os.path.join(tmp, f"b_{dtype}.safetensors")
            subprocess.run([a.lossguard, "gen", "--case", "random", "--seed", "7", "--samples", str(a.samples),
                            "--vocab", str(a.vocab), "--max-response", "64", "--max-prompt", "32",
                            "--dtype", dtype, "--out", dump], check=True, capture_output=True)
            loss_ok, grad_ok, clean = check(a.lossguard, dump, a.impl, "weight-token:0")
            assert not loss_ok and not grad_ok, f"{dtype}: the clean candidate must pass"
            for unit in ["token", "sample", "rank"]:
                # The smallest eps such that it and every larger one are caught.
                smallest = {"loss": None, "gradient": None}
                going = {"loss": True, "gradient": True}
                for eps in EPS:
                    loss_caught, grad_caught, _ = check(a.lossguard, dump, a.impl, f"weight-{unit}:{eps:g}")
                    for q, caught in (("loss", loss_caught), ("gradient", grad_caught)):
                        going[q] = going[q] and caught
                        if going[q]:
                            smallest[q] = eps
                    if not going["loss"] and not going["gradient"]:
                        break
                rows.append((dtype, unit, smallest["loss"], smallest["gradient"],
                             clean["loss_value"].get("bound"), clean["grad"]["rtol"]))
    head = ("| logits dtype | weight error on | smallest eps caught: loss | gradient | loss bound "
            "(abs) | gradient rtol |\n|---|---|---|---|---|---|")
    fmt = lambda e: "none (1e-1 passes)" if e is None else f"{e:g}"
    lines = [head] + [f"| {d} | one {u} | {fmt(l)} | {fmt(g)} | {b if b is None else f'{b:.3g}'} | {r:g} |"
                      for d, u, l, g, b, r in rows]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
