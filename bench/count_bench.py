#!/usr/bin/env python3
"""Counting benchmark: lossguard count against the per-sample PyTorch loop a trainer-side script would write.

    python bench/count_bench.py BUILD_DIR [--samples 100000] [--max-response 240] [--cp 1,2,4,8]

Generates a large masks-only dump with `lossguard gen`, then measures in this one run:
  * the Python reference (torch, per sample, per CP rank, zig-zag slices, as Relax/slime do it) end to end,
  * `lossguard count` end to end (process start, load, validation, counting, report),
  * the counting pass alone (the oracle's, and the token-count kernel's CPU twin, checked equal) against a
    memcpy of the same bytes on as many threads as each uses (bench/count_throughput).
and checks that both give the same denominators. Prints a JSON summary.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file


def reference_counts(path, cp_sizes):
    """What a trainer does: per sample, per CP rank, sum the loss mask over the rank's zig-zag chunks."""
    d = load_file(path)
    tl, rl, masks = d["total_lengths"].tolist(), d["response_lengths"].tolist(), d["loss_masks"]
    totals = {cp: 0 for cp in cp_sizes}
    off = 0
    for t, r in zip(tl, rl):
        mask = masks[off:off + r]
        off += r
        p = t - r
        for cp in cp_sizes:
            if cp == 1:
                totals[cp] += int(mask.sum())
                continue
            cs = math.ceil(t / (2 * cp))
            for rank in range(cp):
                for chunk in (rank, 2 * cp - 1 - rank):
                    lo, hi = max(chunk * cs, p - 1), min((chunk + 1) * cs, t - 1)  # logit positions
                    if lo >= hi:
                        continue
                    a, b = (lo, hi) if r == t else (lo + 1 - p, hi + 1 - p)
                    totals[cp] += int(mask[a:b].sum())
    return totals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--samples", type=int, default=100000)
    ap.add_argument("--max-response", type=int, default=240)
    ap.add_argument("--cp", default="1,2,4,8")
    args = ap.parse_args()
    lg = os.path.join(args.build, "cli", "lossguard")
    cps = [int(x) for x in args.cp.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "big.safetensors")
        subprocess.run([lg, "gen", "--samples", str(args.samples), "--min-prompt", "16", "--max-prompt", "128",
                        "--max-response", str(args.max_response), "--masks-only", "--out", dump], check=True,
                       stdout=subprocess.DEVNULL)
        t = time.perf_counter()
        ref = reference_counts(dump, cps)
        ref_s = time.perf_counter() - t

        report = os.path.join(tmp, "count.json")
        t = time.perf_counter()
        subprocess.run([lg, "count", dump, "--cp", args.cp, "--json", report], stdout=subprocess.DEVNULL)
        lg_s = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run([lg, "count", dump, "--cp", args.cp], stdout=subprocess.DEVNULL)
        lg_text_s = time.perf_counter() - t
        got = json.load(open(report))["totals"]
        assert all(got[str(cp)] == ref[cp] for cp in cps), (got, ref)

        tp = json.loads(subprocess.run([os.path.join(args.build, "bench", "count_throughput"), dump, args.cp],
                                       check=True, capture_output=True, text=True).stdout)
    out = {
        "samples": tp["samples"], "response_tokens": tp["response_tokens"], "cp_sizes": cps,
        "python_reference_s": round(ref_s, 3),
        "lossguard_end_to_end_s": round(lg_s, 3),
        "lossguard_end_to_end_text_only_s": round(lg_text_s, 3),
        "speedup_end_to_end": round(ref_s / lg_s, 1),
        "speedup_end_to_end_text_only": round(ref_s / lg_text_s, 1),
        "count_pass_s": round(tp["count_s"], 4),
        "count_GB_per_s": round(tp["count_bytes_per_s"] / 1e9, 2),
        "memcpy_GB_per_s": round(tp["memcpy_bytes_per_s"] / 1e9, 2),
        "count_vs_memcpy": round(tp["count_vs_memcpy"], 2),
        "kernel_count_pass_s": round(tp["kernel_count_s"], 4),
        "kernel_count_GB_per_s": round(tp["kernel_count_bytes_per_s"] / 1e9, 2),
        "threaded_memcpy_GB_per_s": round(tp["memcpy_threaded_bytes_per_s"] / 1e9, 2),
        "kernel_count_vs_threaded_memcpy": round(tp["kernel_count_vs_threaded_memcpy"], 2),
        "kernel_threads": tp["kernel_threads"],
        "denominators_agree": True,
        "torch": torch.__version__,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
