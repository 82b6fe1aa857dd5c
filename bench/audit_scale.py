#!/usr/bin/env python3
"""Audit at scale: `lossguard audit` on one step of a 16k-GPU job against reading its capture files alone.

    python bench/audit_scale.py BUILD_DIR [--dp 16384] [--cp 1] [--microbatches 8] [--samples-per-mb 16]
                                          [--max-response 24] [--contiguous] [--rounds 3] [--seed 0]
                                          [--keep DIR]

Writes the captures of ONE correct step directly (docs/semantics.md §10, the files
python/lossguard_capture/recorder.py writes; no torchrun, no torch): world = DP x CP (TP = PP = 1), every
rank M micro-batches of S samples each (global sample indices a random permutation, or with --contiguous
DP rank after DP rank, as a plain distributed sampler hands them out), prompts of
1..8 tokens, responses of 1..--max-response tokens, random 0/1 loss masks (80% ones), the objective
`per-token` as a correct trainer records it: token_weight = m_t / N over the rank's owned tokens in local
order (zig-zag ownership at CP > 1), grad_scale = 1, num_tokens = the micro-batch's owned effective count,
num_tokens_reduced = N, token_loss and loss = sum(token_weight * token_loss). Then, in this one run, with
the page cache warm (every file read once first), the median of --rounds rounds of:
  * reading alone, two ways: `cat` of every file to /dev/null (the page-cache cost of the bytes), and a
    Python safetensors load of every file (safe_open + get_tensor of every tensor, numpy);
  * `lossguard audit DIR --json /dev/null` end to end under /usr/bin/time (wall time, peak RSS).
The ratios: audit over the faster of the two reads (`cat`, the bytes alone), and over the Python load of
every tensor (target: within 3x of reading). The first audit run (not timed)
must pass with every check that ran ok (the generator's own check). Prints a JSON summary.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file


def capture_filename(step, rank):
    """lossguard_capture.recorder.capture_filename (not imported: that module imports torch)."""
    return f"step{int(step):06d}-rank{int(rank):05d}.safetensors"


def owner_cp_rank(T, R, cp):
    """Per response token (packed, sample after sample): the CP rank that owns it (docs/semantics.md §2).
    Every sample has 0 < R < T (RL), so response index j is predicted by logit position P-1+j, held by
    zig-zag chunk (P-1+j) // ceil(T / 2cp): rank `chunk`, or `2cp-1-chunk` for the second half."""
    if cp == 1:
        return None
    cs = -(-T // (2 * cp))
    starts = np.cumsum(R) - R                                   # each sample's first response token
    j = np.arange(int(R.sum()), dtype=np.int64) - np.repeat(starts, R)
    chunk = (np.repeat(T - R - 1, R) + j) // np.repeat(cs, R)
    return np.where(chunk < cp, chunk, 2 * cp - 1 - chunk).astype(np.int8)


def generate(out, dp, cp, M, S, max_response, seed, contiguous=False):
    """Write one correct per-token step; returns (files, samples, tokens, response tokens, N, bytes)."""
    rng = np.random.default_rng(seed)
    n = dp * M * S
    P = rng.integers(1, 9, n, dtype=np.int64)
    R = rng.integers(1, max_response + 1, n, dtype=np.int64)
    T = P + R
    index = rng.permutation(n).astype(np.int64)                 # sample (d, k, s) is sample[(d*M+k)*S+s]
    if contiguous:
        index = np.arange(n, dtype=np.int64)
    mask = (rng.random(int(R.sum()), dtype=np.float32) < 0.8).astype(np.int64)
    N = int(mask.sum())
    weight = mask.astype(np.float32) / np.float32(N)             # m_t / N, the per-token truth
    token_loss = rng.random(mask.size, dtype=np.float32) * np.float32(4.0)
    owner = owner_cp_rank(T, R, cp)
    toff = np.concatenate(([0], np.cumsum(T)))
    roff = np.concatenate(([0], np.cumsum(R)))
    world = dp * cp
    meta_common = {"lossguard.schema": "audit/1", "step": "0", "world_size": str(world), "tp": "1", "pp": "1",
                   "cp": str(cp), "dp": str(dp), "tp_rank": "0", "pp_rank": "0", "cp_layout": "zigzag",
                   "reduce": "per-token", "num_microbatches": str(M), "dtype": "float32"}
    scalar = {"cp_size": np.array(cp, dtype=np.int64), "dummy": np.array(0, dtype=np.int64),
              "grad_scale": np.array(1.0, dtype=np.float64), "N": np.array(N, dtype=np.int64)}
    total = 0
    for d in range(dp):
        s_lo = d * M * S
        tokens = rng.integers(0, 151936, int(toff[s_lo + M * S] - toff[s_lo]), dtype=np.int64)
        per_cp = [{"grad_scale": scalar["grad_scale"], "num_tokens_reduced": scalar["N"]} for _ in range(cp)]
        for k in range(M):
            a, b = s_lo + k * S, s_lo + (k + 1) * S
            ra, rb = int(roff[a]), int(roff[b])
            shared = {"sample_indices": index[a:b], "total_lengths": T[a:b], "response_lengths": R[a:b],
                      "tokens": tokens[int(toff[a] - toff[s_lo]):int(toff[b] - toff[s_lo])],
                      "loss_masks": mask[ra:rb], "cp_size": scalar["cp_size"], "dummy": scalar["dummy"]}
            for c in range(cp):
                if owner is None:
                    w, tl, m = weight[ra:rb], token_loss[ra:rb], mask[ra:rb]
                else:
                    sel = owner[ra:rb] == c
                    w, tl, m = weight[ra:rb][sel], token_loss[ra:rb][sel], mask[ra:rb][sel]
                rec = dict(shared, token_weight=w, token_loss=tl,
                           num_tokens=np.array(int(m.sum()), dtype=np.int64),
                           loss=np.array(float(np.dot(w.astype(np.float64), tl.astype(np.float64)))))
                for name, arr in rec.items():
                    per_cp[c][f"mb.{k}.{name}"] = arr
        for c in range(cp):
            rank = d * cp + c
            meta = dict(meta_common, rank=str(rank), cp_rank=str(c), dp_rank=str(d))
            path = os.path.join(out, capture_filename(0, rank))
            save_file(per_cp[c], path, metadata=meta)
            total += os.path.getsize(path)
    return world, n, int(T.sum()), int(R.sum()), N, total


def read_cat(files):
    """Every file's bytes through `cat` to /dev/null (few processes: xargs)."""
    t = time.perf_counter()
    subprocess.run(["xargs", "-0", "cat"], input=b"\0".join(f.encode() for f in files),
                   stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def read_safetensors(files):
    """Every file opened with safetensors, its metadata and every tensor loaded (numpy)."""
    t = time.perf_counter()
    for f in files:
        with safe_open(f, framework="numpy") as h:
            h.metadata()
            for key in h.keys():
                h.get_tensor(key)
    return time.perf_counter() - t


def run_audit(lg, capdir, json_path, tmp):
    """(wall s, peak RSS MiB, exit status, stdout) of one `lossguard audit` under /usr/bin/time."""
    tfile = os.path.join(tmp, "time.txt")
    p = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", tfile, lg, "audit", capdir, "--json", json_path],
                       capture_output=True, text=True)
    wall, rss = open(tfile).read().split()[-2:]
    return float(wall), int(rss) / 1024, p.returncode, p.stdout + p.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--dp", type=int, default=16384)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--samples-per-mb", type=int, default=16)
    ap.add_argument("--max-response", type=int, default=24, help="responses of 1..N tokens (prompts 1..8)")
    ap.add_argument("--contiguous", action="store_true",
                    help="sample indices in rank order (default: a random permutation)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds; medians reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", metavar="DIR", help="write the captures here (kept) instead of a temp folder")
    args = ap.parse_args()
    lg = os.path.join(args.build, "cli", "lossguard")
    tmp = tempfile.mkdtemp(prefix="audit_scale-")
    try:
        capdir = args.keep or os.path.join(tmp, "caps")
        os.makedirs(capdir, exist_ok=True)
        if any(n.endswith(".safetensors") for n in os.listdir(capdir)):
            sys.exit(f"{capdir} already holds captures; give an empty folder")
        t = time.perf_counter()
        files_n, samples, tokens, resp, N, nbytes = generate(capdir, args.dp, args.cp, args.microbatches,
                                                              args.samples_per_mb, args.max_response, args.seed,
                                                              args.contiguous)
        gen_s = time.perf_counter() - t
        files = sorted(os.path.join(capdir, n) for n in os.listdir(capdir) if n.endswith(".safetensors"))

        read_cat(files)                                          # warm the page cache
        report = os.path.join(tmp, "audit.json")
        _, _, rc, text = run_audit(lg, capdir, report, tmp)      # warm the binary; the generator's check
        if rc != 0:
            sys.exit(f"lossguard audit exited {rc} on the generated captures:\n{text[-3000:]}")
        checks = {c["name"]: c["ok"] for c in json.load(open(report))["steps"][0]["checks"]}
        if checks.get("weights") is not True or any(ok is False for ok in checks.values()):
            sys.exit(f"lossguard audit did not pass the generated captures: {checks}")

        cat_s, st_s, audit_s, audit_mb = [], [], [], []
        for _ in range(args.rounds):
            cat_s.append(read_cat(files))
            st_s.append(read_safetensors(files))
            w, mb, rc, text = run_audit(lg, capdir, "/dev/null", tmp)
            if rc != 0:
                sys.exit(f"lossguard audit exited {rc}:\n{text[-3000:]}")
            audit_s.append(w)
            audit_mb.append(mb)
        cat_m, st_m, audit_m = (statistics.median(x) for x in (cat_s, st_s, audit_s))
        ref_name, ref_s = min((("cat", cat_m), ("safetensors", st_m)), key=lambda x: x[1])
        out = {
            "ranks": files_n, "dp": args.dp, "cp": args.cp, "microbatches": args.microbatches,
            "samples_per_mb": args.samples_per_mb, "contiguous": args.contiguous, "samples": samples,
            "tokens": tokens,
            "response_tokens": resp, "effective_tokens": N, "files": len(files), "bytes": nbytes,
            "generate_s": round(gen_s, 2),
            "read_cat_s": round(cat_m, 3), "read_safetensors_s": round(st_m, 3),
            "audit_s": round(audit_m, 3), "audit_peak_MiB": round(max(audit_mb), 1),
            "audit_us_per_rank": round(audit_m * 1e6 / files_n, 1),
            "reference": ref_name,
            "audit_vs_read": round(audit_m / ref_s, 1) if ref_s > 0 else None,
            # a parse of every tensor, as a trainer-side script reading the captures would do
            "audit_vs_safetensors_load": round(audit_m / st_m, 2) if st_m > 0 else None,
            "rounds": args.rounds, "checks": checks,
        }
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
