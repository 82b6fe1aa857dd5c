#!/usr/bin/env python3
"""Faults in real jobs: a rank killed mid-protocol (kill -9), a rank that never arrives, and the store
disappearing (rank 0, which serves it, killed). Every surviving rank must exit 3 within --timeout + 10 s
of its own start (each rank writes when its deadline began to LOSSGUARD_TIMING_FILE: start-up on a loaded
machine is not a hang, and is not counted),
rank 0's report (when rank 0 survives) must name the missing ranks, and nothing may be left running.

Each fault runs under a plain launcher (this script starts the ranks, so it sees every exit code and no
launcher intervenes) and, given TORCHRUN, under real `torchrun --standalone`, whose agent stops the other
workers (SIGTERM) once one fails: there every survivor must still exit 3 (torchrun's failure summary lists
each rank's exit code), torchrun must name the lost rank as the root cause, and when the lost rank never
arrived rank 0's report must name it. (Under torchrun the store is the agent's, so it cannot vanish.)

A planted overshoot (LOSSGUARD_INJECT_FAULT=overshoot:RANK:S holds one rank S seconds past its verdict)
must be caught by the same timing check: the self-test at the end.

    multiproc_faults.py LOSSGUARD DUMP [TORCHRUN]
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 4
WORLD = 4  # TP2 PP2
SLACK_S = 10  # a rank's exit after its deadline: the exit-code agreement and process teardown


def rank_starts(timing_file):
    """rank -> wall-clock time its deadline began, from the lines the ranks wrote."""
    starts = {}
    if os.path.exists(timing_file):
        for line in open(timing_file):
            rec = json.loads(line)
            starts[rec["rank"]] = rec["start"]
    return starts


def late_ranks(starts, ends, ranks):
    """The ranks (of `ranks`) that ended more than --timeout + SLACK_S after their own start."""
    late = {}
    for r in ranks:
        if r in starts and r in ends and ends[r] - starts[r] > TIMEOUT_S + SLACK_S:
            late[r] = round(ends[r] - starts[r], 1)
    return late


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(lossguard, dump, report, ranks, fault=None):
    """Starts the ranks; returns their exit codes, how long each ran past its own start, and outputs."""
    port = str(free_port())
    timing = report + ".timing"
    procs = {}
    for rank in ranks:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOCAL_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   LOSSGUARD_TIMING_FILE=timing)
        if fault:
            env["LOSSGUARD_INJECT_FAULT"] = fault
        cmd = [lossguard, "replay", dump, "--tp", "2", "--pp", "2", "--backend", "gloo", "--timeout", str(TIMEOUT_S),
               "--json", report]
        procs[rank] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Each rank's end, polled (a blocking wait on one would hide when the others ended).
    give_up = time.monotonic() + TIMEOUT_S + 60
    ends = {}
    while len(ends) < len(procs) and time.monotonic() < give_up:
        for r, p in procs.items():
            if r not in ends and p.poll() is not None:
                ends[r] = time.time()
        time.sleep(0.05)
    codes = {r: p.wait(timeout=5) for r, p in procs.items()}
    starts = rank_starts(timing)
    missing = [r for r in ranks if r not in starts and codes[r] == 3]
    late = late_ranks(starts, ends, ranks)
    late.update({r: "never started its deadline" for r in missing})
    return codes, late, {r: p.stdout.read() + p.stderr.read() for r, p in procs.items()}


def launch_torchrun(torchrun, lossguard, dump, report, fault):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOCAL_", "MASTER_"))}
    env["LOSSGUARD_INJECT_FAULT"] = fault
    timing = report + ".timing"
    env["LOSSGUARD_TIMING_FILE"] = timing
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(WORLD), "--no-python", lossguard, "replay", dump, "--tp", "2",
           "--pp", "2", "--backend", "gloo", "--timeout", str(TIMEOUT_S), "--json", report]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 120)
    end = time.time()
    out = p.stdout + p.stderr
    # torchrun ends when its last worker has; no survivor may outlive its own deadline, so the job's
    # end is bounded by the latest start among the ranks plus --timeout + SLACK_S.
    starts = rank_starts(timing)
    elapsed = end - max(starts.values()) if starts else float("inf")
    # torchrun's summary: "rank : R (local_rank: L)" then "exitcode : C" for every failed worker; the root
    # cause comes after "Root Cause".
    codes = {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out)}
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out, re.S)
    return p.returncode, codes, (int(root.group(1)), int(root.group(2))) if root else None, elapsed, out


def torchrun_scenarios(torchrun, lossguard, dump, tmp):
    failures = []
    scenarios = [
        ("torchrun: rank 2 killed after the token-count all-reduce", "kill:2:2", 2, -9),
        ("torchrun: rank 0 (the report's writer) killed before its first collective", "kill:0:1", 0, -9),
        ("torchrun: rank 3 never arrives", "hang:3", 3, None),
    ]
    for name, fault, lost, lost_code in scenarios:
        report = os.path.join(tmp, f"torchrun-{time.monotonic_ns()}.json")
        rc, codes, root, elapsed, out = launch_torchrun(torchrun, lossguard, dump, report, fault)
        survivors = [r for r in range(WORLD) if r != lost]
        if rc == 0:
            failures.append(f"{name}: torchrun exited 0")
        bad = {r: codes.get(r) for r in survivors if codes.get(r) != 3}
        if bad:
            failures.append(f"{name}: surviving ranks exited {bad} (torchrun's summary), expected 3; output: {out[-3000:]}")
        if lost_code is not None and root != (lost, lost_code):
            failures.append(f"{name}: torchrun's root cause is {root}, expected rank {lost} with exit code {lost_code}")
        if elapsed > TIMEOUT_S + SLACK_S:
            failures.append(f"{name}: ended {elapsed:.1f} s after the last rank's start > --timeout {TIMEOUT_S} + "
                            f"{SLACK_S} s")
        if lost_code is None:  # nobody failed before the deadline: rank 0 reports, naming the absent rank
            doc = json.load(open(report))
            if doc["ranks"][lost]["outcome"] != "error" or "never reported" not in doc["ranks"][lost]["detail"]:
                failures.append(f"{name}: rank 0's report does not name rank {lost} as missing: {doc['ranks'][lost]}")
        left = subprocess.run(["pgrep", "-f", report], capture_output=True, text=True).stdout.split()
        if left:
            failures.append(f"{name}: processes left behind: {left}")
        print(f"{name}: survivors {survivors} exited {[codes.get(r) for r in survivors]}, root cause {root}, "
              f"{elapsed:.1f} s after the last rank's start", flush=True)
    return len(scenarios), failures


def main():
    lossguard, dump = sys.argv[1], sys.argv[2]
    torchrun = sys.argv[3] if len(sys.argv) > 3 else None
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
            codes, late, outputs = launch(lossguard, dump, report, ranks, fault)
            survivors = [r for r in ranks if r not in lost]
            bad = {r: codes[r] for r in survivors if codes[r] != 3}
            if bad:
                failures.append(f"{name}: surviving ranks exited {bad}, expected 3; output: {outputs}")
            late = {r: v for r, v in late.items() if r in survivors}
            if late:
                failures.append(f"{name}: ranks ran past --timeout {TIMEOUT_S} + {SLACK_S} s of their own start: "
                                f"{late} (seconds)")
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
            print(f"{name}: surviving ranks {survivors} exited {[codes[r] for r in survivors]}, each within its "
                  f"deadline", flush=True)
        # Self-test of the timing check: rank 1 held 20 s past its verdict must be named late.
        name = "planted overshoot (rank 1 held 20 s past its verdict) is caught"
        codes, late, outputs = launch(lossguard, dump, os.path.join(tmp, "overshoot.json"), [0, 1, 2],
                                      "overshoot:1:20")
        if set(late) != {1}:
            failures.append(f"{name}: the timing check named {late}, expected rank 1 only")
        print(f"{name}: late ranks {late}", flush=True)
        scenarios.append(None)
        if torchrun:
            n, more = torchrun_scenarios(torchrun, lossguard, dump, tmp)
            scenarios += [None] * n
            failures += more
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print(f"{len(scenarios) - len({f.split(':')[0] for f in failures})} passed, {len({f.split(':')[0] for f in failures})} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
