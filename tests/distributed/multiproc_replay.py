#!/usr/bin/env python3
"""Real multi-process replay against the simulator: for one topology and every protocol, run
`lossguard replay --backend sim` and the same replay under real `torchrun --no-python` (Gloo on CPU), and
assert that every rank's outcome is the one the simulator predicts; deadlocking protocols must end within
--timeout + 10 s with exit code 3 and leave no process behind. With --plain, launch the ranks with only
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, as a plain launcher would.

Every rank the simulator sees blocked must be released through the store (fail fast: a member that
failed, finished or waits in a cycle), not by --timeout. The participation protocols (--protocols) run on
replay_participation.json, whose DP rank 1 holds a last micro-batch with no effective token and more
tokens than DP rank 0 (uneven micro-batch counts under --max-tokens-per-mb 9), with the arguments below.

    multiproc_replay.py LOSSGUARD TORCHRUN DUMP_DIR --tp 2 --pp 2 [--cp 1] [--dp 1] [--ep 1] [--plain]
                        [--backend nccl] [--protocols a,b,...]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

PROTOCOLS = ["pr285", "pr285-src-local", "pr285-always-broadcast", "values0", "no-skip"]
# The data-dependent participation protocols and what each needs to show its hazard.
PARTICIPATION_ARGS = {
    "microbatch-skip": ["--microbatches", "2"],
    "microbatch-skip-local": ["--microbatches", "2"],
    "microbatches-max": ["--max-tokens-per-mb", "9"],
    "microbatches-local": ["--max-tokens-per-mb", "9"],
    "nan-skip": ["--nan-ranks", "1"],
    "nan-skip-local": ["--nan-ranks", "1"],
    "nan-skip-rank0": ["--nan-ranks", "1"],
    "flag-broadcast": [],
    "flag-broadcast-src-local": [],
}
FIELDS = ["decision", "outcome", "optimizer_stepped", "scheduler_stepped", "update_successful",
          "unsynced_gradients"]
TIMEOUT_S = 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leftover(tag):
    """Processes whose command line holds tag (pgrep -f, read from /proc: a bare machine may lack procps)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if tag in cmdline:
            found.append(pid)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lossguard")
    ap.add_argument("torchrun")
    ap.add_argument("dumps")
    for k in ("tp", "pp", "cp", "dp", "ep"):
        ap.add_argument("--" + k, type=int, default=1)
    ap.add_argument("--protocols", default=None, help="comma-separated participation protocols")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()
    world = args.tp * args.pp * args.cp * args.dp
    topo = ["--tp", str(args.tp), "--pp", str(args.pp), "--cp", str(args.cp), "--dp", str(args.dp),
            "--ep", str(args.ep)]
    if args.protocols:
        def protocol_args(p):  # a NaN rank that exists: rank 1, or rank 0 in a world of one (one GPU, NCCL)
            return [a if a != "1" or i == 0 or PARTICIPATION_ARGS[p][i - 1] != "--nan-ranks" or world > 1 else "0"
                    for i, a in enumerate(PARTICIPATION_ARGS[p])]
        runs = [(b, p, protocol_args(p)) for b in ("gen_random.safetensors", "replay_participation.json")
                for p in args.protocols.split(",")]
    else:
        runs = [(b, p, []) for b in ("gen_zero-token.safetensors", "gen_random.safetensors") for p in PROTOCOLS]
    failures = []
    checked = 0
    with tempfile.TemporaryDirectory(prefix="lossguard-mp-") as tmp:
        for batch, protocol, extra in runs:
                dump = os.path.join(args.dumps, batch)
                common = [dump] + topo + ["--protocol", protocol, "--reduce", "sample-mean"] + extra
                sim_json = os.path.join(tmp, "sim.json")
                sim = subprocess.run([args.lossguard, "replay"] + common + ["--backend", "sim", "--json", sim_json],
                                     capture_output=True, text=True)
                want = json.load(open(sim_json))
                real_json = os.path.join(tmp, "real.json")
                if os.path.exists(real_json):
                    os.remove(real_json)
                cmd = [args.lossguard, "replay"] + common + ["--backend", args.backend, "--timeout", str(TIMEOUT_S), "--json", real_json]
                start = time.monotonic()
                if args.plain:
                    port = str(free_port())
                    procs = []
                    for rank in range(world):
                        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOCAL_"))}
                        env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                    codes = [p.wait(timeout=TIMEOUT_S + 60) for p in procs]
                    out0 = procs[0].stdout.read()
                else:
                    run = subprocess.run([args.torchrun, "--standalone", "--nproc-per-node", str(world), "--no-python"] + cmd,
                                         capture_output=True, text=True, timeout=TIMEOUT_S + 60)
                    codes = None
                    out0 = run.stdout
                elapsed = time.monotonic() - start
                name = (f"{batch} {protocol} {' '.join(extra)} TP{args.tp} PP{args.pp} CP{args.cp} DP{args.dp} EP{args.ep}"
                        f"{' plain' if args.plain else ''}")
                if not os.path.exists(real_json):
                    failures.append(f"{name}: rank 0 wrote no report; stdout: {out0[-2000:]}")
                    continue
                got = json.load(open(real_json))
                checked += 1
                if "ranks" not in want or "ranks" not in got:  # an error report (exit 2), not a replay
                    failures.append(f"{name}: no replay: simulated {want.get('error', want)}, real {got.get('error', got)}")
                    continue
                if got["backend"] != args.backend or len(got["ranks"]) != world:
                    failures.append(f"{name}: backend {got['backend']}, {len(got['ranks'])} ranks")
                for w, g in zip(want["ranks"], got["ranks"]):
                    diff = {f: (w[f], g[f]) for f in FIELDS if w[f] != g[f]}
                    if diff:
                        failures.append(f"{name}: rank {w['rank']}: simulator vs real {diff}; real detail: {g['detail']}")
                    elif g["outcome"] == "blocked" and "seen through the store" not in g["detail"]:
                        failures.append(f"{name}: rank {w['rank']} was not released through the store (fail fast): "
                                        f"{g['detail']}")
                if got["verdict"] != want["verdict"] or got["exit_code"] != want["exit_code"]:
                    failures.append(f"{name}: verdict {got['verdict']}/{got['exit_code']} vs simulated {want['verdict']}/{want['exit_code']}")
                if want["exit_code"] == 3 and elapsed > TIMEOUT_S + 10:
                    failures.append(f"{name}: a deadlocking replay took {elapsed:.1f} s (> --timeout {TIMEOUT_S} + 10 s)")
                if codes is not None and len(set(codes)) != 1:
                    failures.append(f"{name}: ranks exited with different codes {codes}")
                if codes is not None and codes[0] != want["exit_code"]:
                    failures.append(f"{name}: exit code {codes[0]}, simulated {want['exit_code']}")
                if leftover(real_json):
                    failures.append(f"{name}: processes left behind: {leftover(real_json)}")
                print(f"{name}: {got['verdict']} (exit {got['exit_code']}) in {elapsed:.1f} s, every rank as simulated"
                      if not failures else f"{name}: checked", flush=True)
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print(f"{checked - len({f.split(':')[0] for f in failures})} passed, {len({f.split(':')[0] for f in failures})} failed")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
