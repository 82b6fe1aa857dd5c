#!/usr/bin/env python3
"""Faults in real jobs: a rank killed mid-protocol (kill -9), a rank that never arrives, and the store
disappearing (rank 0, which serves it, killed). Every surviving rank must exit 3 within --timeout + 10 s,
rank 0's report (when rank 0 survives) must name the missing ranks, and nothing may be left running.

    multiproc_faults.py LOSSGUARD DUMP
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 4
WORLD = 4  # TP2 PP2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(lossguard, dump, report, ranks, fault=None):
    port = str(free_port())
    procs = {}
    for rank in ranks:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOCAL_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if fault:
            env["LOSSGUARD_INJECT_FAULT"] = fault
        cmd = [lossguard, "replay", dump, "--tp", "2", "--pp", "2", "--backend", "gloo", "--timeout", str(TIMEOUT_S),
               "--json", report]
        procs[rank] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    codes = {r: p.wait(timeout=TIMEOUT_S + 60) for r, p in procs.items()}
    return codes, time.monotonic() - start, {r: p.stdout.read() + p.stderr.read() for r, p in procs.items()}


def main():
    lossguard, dump = sys.argv[1], sys.argv[2]
    failures = []
    scenarios = [
        ("rank 3 killed before its first collective", [0, 1, 2, 3], "kill:3:1", [3]),
        ("rank 2 killed after the token-count all-reduce", [0, 1, 2, 3], "kill:2:2", [2]),
        ("rank 3 never arrives", [0, 1, 2], None, [3]),
        ("the store disappears (rank 0 killed mid-protocol)", [0, 1, 2, 3], "kill:0:1", [0]),
    ]
    with tempfile.TemporaryDirectory(prefix="lossguard-faults-") as tmp:
        for name, ranks, fault, lost in scenarios:
            report = os.path.join(tmp, f"report-{len(failures)}-{time.monotonic_ns()}.json")
            codes, elapsed, outputs = launch(lossguard, dump, report, ranks, fault)
            survivors = [r for r in ranks if r not in lost]
            bad = {r: codes[r] for r in survivors if codes[r] != 3}
            if bad:
                failures.append(f"{name}: surviving ranks exited {bad}, expected 3; output: {outputs}")
            if elapsed > TIMEOUT_S + 10:
                failures.append(f"{name}: took {elapsed:.1f} s > --timeout {TIMEOUT_S} + 10 s")
            if 0 in survivors:
                doc = json.load(open(report))
                for r in lost:
                    detail = doc["ranks"][r]["detail"]
                    if doc["ranks"][r]["outcome"] != "error" or "never reported" not in detail:
                        failures.append(f"{name}: rank 0's report does not name rank {r} as missing: {doc['ranks'][r]}")
                if doc["verdict"] != "fault":
                    failures.append(f"{name}: verdict {doc['verdict']}")
            left = subprocess.run(["pgrep", "-f", report], capture_output=True, text=True).stdout.split()
            if left:
                failures.append(f"{name}: processes left behind: {left}")
            print(f"{name}: surviving ranks {survivors} exited {[codes[r] for r in survivors]} in {elapsed:.1f} s", flush=True)
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print(f"{len(scenarios) - len({f.split(':')[0] for f in failures})} passed, {len({f.split(':')[0] for f in failures})} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
