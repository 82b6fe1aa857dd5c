#!/usr/bin/env python3
"""Benchmark `lossguard postmortem` against PyTorch's own Flight Recorder analyser (fr_trace) on a
synthetic Megatron job's dumps (TP8 x DP, one rank missing its last data-parallel call): wall time,
peak memory, and whether each tool names the planted divergence.

Each rank's dump is the dict torch 2.15's recorder writes (version "2.10"), pickled (protocol 2)
byte for byte as c10's pickler lays it out, into <dir>/fr_trace_rank_<rank>: pg_config lists the
default group and the rank's TP and DP groups (as an NCCL job's does, so fr_trace can run), every
entry carries the fields FlightRecorder.hpp writes, and the calls follow a Megatron step (TP
all-reduces forward and backward, a DP reduce-scatter of the gradients, a TP all-reduce of the
gradient norm, a DP all-gather of the parameters, a world all-reduce for logging). Every rank's
last call is the DP reduce-scatter; the culprit rank (--culprit) never issued it, so its DP peers
hang in it (state "started"): exactly one divergence. lossguard must exit 3 and name it as --json
divergences[0]; fr_trace must log "Not all ranks joining collective" for that call with the
culprit missing.

  bench/postmortem_bench.py                                  # 128 ranks x 2,000 calls, < 1 min
  bench/postmortem_bench.py --ranks 2048 --json out.json     # fr_trace: ~10 min, 8 GB
  bench/postmortem_bench.py --ranks 16384 --entries 2000 --skip-fr-trace --keep \\
      --dir /tmp/pm16k                                       # full scale: 6.4 GiB of dumps
  bench/postmortem_bench.py --ranks 16384 --entries 2000 --skip-fr-trace --dir /tmp/pm16k
                                                             # again, on the dumps kept

Dumps go to /tmp/lossguard_pm_bench_<ranks>x<entries>, removed afterwards unless --keep, or to
--dir, kept; a directory this script generated with the same parameters is reused. Generation runs
on every core (multiprocessing) and stops, before writing anything, if the dumps would leave less
than 5 GiB free. Times are wall clock; peak memory is the child's ru_maxrss (what /usr/bin/time -v
reports, read through os.wait4). fr_trace is stopped after --fr-trace-timeout seconds, or when its
resident memory passes --mem-cap-gib (it holds every entry as Python dicts), and reported as not
finished rather than given a ratio.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LOSSGUARD = REPO / "build" / "cli" / "lossguard"
DEFAULT_PYTHON = Path.home() / ".cache" / "lossguard" / "venv" / "bin" / "python"
PREFIX = "fr_trace_rank_"
MANIFEST = ".postmortem_bench.json"  # no trailing digits: neither tool takes it for a dump
GIB = 1 << 30

# ---------------------------------------------------------------------------------------------
# The pickle torch writes
# ---------------------------------------------------------------------------------------------

class C10Pickler:
    """Protocol-2 pickles laid out as torch's c10 pickler writes a Flight Recorder dump (Python's
    pickle reads them alike, but its own pickler memoises every list and dict, which c10 does not:
    that made the files 25% larger and lossguard 25% slower to read them). c10 memoises every
    string (BINPUT at its first use, BINGET after) and a container only when it is referenced
    twice: the top-level dict, and the frames the recorder interns once per dump and shares between
    stacks. Lists and dicts always open with MARK. Re-encoding torch 2.15's own dumps with this
    gives them back byte for byte."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.memo_size = 0
        self.strings: dict[str, bytes] = {}   # string -> its BINGET
        self.frames: dict[tuple, bytes] = {}  # (name, filename, line) -> its BINGET
        self.shared: set[tuple] = set()       # frames used more than once
        # id(list or tuple) -> (it, its bytes), once they no longer change (all memoised).
        self.steady: dict[int, tuple[object, bytes]] = {}

    def dumps(self, dump: dict) -> bytes:
        uses: dict[int, list] = {}  # id(frames list) -> [it, entries holding it]
        for e in dump.get("entries", ()):
            if e.get("frames"):
                uses.setdefault(id(e["frames"]), [e["frames"], 0])[1] += 1
        count: dict[tuple, int] = {}
        for frames, n in uses.values():
            for f in frames:
                key = (f["name"], f["filename"], f["line"])
                count[key] = count.get(key, 0) + n
        self.shared = {k for k, n in count.items() if n > 1}
        self.parts = [b"\x80\x02"]
        self._dict(dump)
        self._put()
        self.parts.append(b".")
        return b"".join(self.parts)

    def _put(self) -> bytes:
        """Memoises what was just written; returns the opcode that fetches it."""
        i = self.memo_size
        self.memo_size += 1
        if i < 256:
            self.parts.append(b"q" + bytes((i,)))
            return b"h" + bytes((i,))
        self.parts.append(b"r" + struct.pack("<I", i))
        return b"j" + struct.pack("<I", i)

    def _str(self, s: str) -> None:
        get = self.strings.get(s)
        if get is not None:
            self.parts.append(get)
            return
        data = s.encode("utf-8")
        self.parts.append(b"X" + struct.pack("<I", len(data)) + data)
        self.strings[s] = self._put()

    def _value(self, v) -> None:
        t = type(v)
        if t is str:
            self._str(v)
        elif t is int:
            if 0 <= v < 256:
                self.parts.append(b"K" + bytes((v,)))
            elif 0 <= v < 65536:
                self.parts.append(b"M" + struct.pack("<H", v))
            elif -(1 << 31) <= v < (1 << 31):
                self.parts.append(b"J" + struct.pack("<i", v))
            else:
                data = pickle.encode_long(v)
                self.parts.append(b"\x8a" + bytes((len(data),)) + data)
        elif t is bool:
            self.parts.append(b"\x88" if v else b"\x89")
        elif v is None:
            self.parts.append(b"N")
        elif t is dict:
            self._dict(v)
        elif t is list or t is tuple:
            self._sequence(v)
        else:
            raise TypeError(f"no c10 encoding for {t.__name__}")

    def _dict(self, d: dict) -> None:
        self.parts.append(b"}(")
        for k, v in d.items():
            self._str(k)
            if k == "frames" and type(v) is list:
                self._sequence(v, frames=True)
            else:
                self._value(v)
        self.parts.append(b"u")

    def _sequence(self, seq, frames: bool = False) -> None:
        cached = self.steady.get(id(seq))
        if cached is not None:
            self.parts.append(cached[1])
            return
        start, memo_before = len(self.parts), self.memo_size
        if frames:
            self.parts.append(b"](")
            for f in seq:
                key = (f["name"], f["filename"], f["line"])
                get = self.frames.get(key)
                if get is not None:
                    self.parts.append(get)
                    continue
                self._dict(f)
                if key in self.shared:
                    self.frames[key] = self._put()
            self.parts.append(b"e")
        elif type(seq) is list:
            self.parts.append(b"](")
            for x in seq:
                self._value(x)
            self.parts.append(b"e")
        else:
            if len(seq) > 3:
                self.parts.append(b"(")
            for x in seq:
                self._value(x)
            closing = (b")", b"\x85", b"\x86", b"\x87")  # TUPLE of 0 to 3 items
            self.parts.append(closing[len(seq)] if len(seq) <= 3 else b"t")
        # Written again it would be the same bytes, unless it memoised something just now (or
        # holds a frame used once: written in full each time, which is fine to repeat too).
        if self.memo_size == memo_before:
            self.steady[id(seq)] = (seq, b"".join(self.parts[start:]))


# ---------------------------------------------------------------------------------------------
# The synthetic job
# ---------------------------------------------------------------------------------------------

TORCH = "/usr/local/lib/python3.12/dist-packages/torch/distributed/"
MEGATRON = "/workspace/Megatron-LM/megatron/"


def _frames(*frames: tuple[str, str, int]) -> list[dict]:
    return [{"name": n, "filename": f, "line": line} for n, f, line in frames]


_WRAPPER = ("wrapper", TORCH + "c10d_logger.py", 83)
_ALL_REDUCE = ("all_reduce", TORCH + "distributed_c10d.py", 4174)

# One Megatron training step as the recorder sees it: (group, profiling name, dtype, input sizes,
# output sizes, thread, frames innermost first). "tp", "dp" and "world" are the rank's groups;
# the sizes are those of a 70B-class model at sequence 4096 (DP sizes are set per job).
HIDDEN = [[4096, 1, 8192]]
STEP = [
    ("tp", "nccl:all_reduce", "BFloat16", HIDDEN, HIDDEN, "fwd", _frames(
        _ALL_REDUCE, _WRAPPER,
        ("_reduce", MEGATRON + "core/tensor_parallel/mappings.py", 34),
        ("forward", MEGATRON + "core/tensor_parallel/mappings.py", 241))),
    ("tp", "nccl:all_reduce", "BFloat16", HIDDEN, HIDDEN, "fwd", _frames(
        _ALL_REDUCE, _WRAPPER,
        ("_reduce", MEGATRON + "core/tensor_parallel/mappings.py", 34),
        ("forward", MEGATRON + "core/tensor_parallel/layers.py", 1004))),
    ("tp", "nccl:all_reduce", "BFloat16", HIDDEN, HIDDEN, "bwd", _frames(
        _ALL_REDUCE, _WRAPPER,
        ("_reduce", MEGATRON + "core/tensor_parallel/mappings.py", 34),
        ("backward", MEGATRON + "core/tensor_parallel/mappings.py", 222))),
    ("tp", "nccl:all_reduce", "BFloat16", HIDDEN, HIDDEN, "bwd", _frames(
        _ALL_REDUCE, _WRAPPER,
        ("linear_with_grad_accumulation_and_async_allreduce_backward",
         MEGATRON + "core/tensor_parallel/layers.py", 520))),
    ("dp", "nccl:_reduce_scatter_base", "Float", None, None, "fwd", _frames(
        ("reduce_scatter_tensor", TORCH + "distributed_c10d.py", 4896), _WRAPPER,
        ("start_grad_sync", MEGATRON + "core/distributed/param_and_grad_buffer.py", 393),
        ("finish_grad_sync", MEGATRON + "core/distributed/distributed_data_parallel.py", 436))),
    ("tp", "nccl:all_reduce", "Float", [[1]], [[1]], "fwd", _frames(
        _ALL_REDUCE, _WRAPPER,
        ("get_grad_norm_fp32", MEGATRON + "core/optimizer/clip_grads.py", 125),
        ("clip_grad_norm", MEGATRON + "core/optimizer/optimizer.py", 297))),
    ("dp", "nccl:_all_gather_base", "BFloat16", None, None, "fwd", _frames(
        ("all_gather_into_tensor", TORCH + "distributed_c10d.py", 4287), _WRAPPER,
        ("start_param_sync", MEGATRON + "core/distributed/param_and_grad_buffer.py", 301),
        ("step", MEGATRON + "core/optimizer/distrib_optimizer.py", 2061))),
    ("world", "nccl:all_reduce", "Float", [[2]], [[2]], "fwd", _frames(
        _ALL_REDUCE, _WRAPPER,
        ("train_step", MEGATRON + "training/training.py", 1277),
        ("train", MEGATRON + "training/training.py", 1795))),
]
LAST_STEP_POS = 4  # every rank's last call is the DP reduce-scatter
DESC = {"world": "default_pg", "dp": "DATA_PARALLEL_GROUP", "tp": "TENSOR_MODEL_PARALLEL_GROUP"}
PG_ID = {"world": 0, "dp": 1, "tp": 2}  # ProcessGroupNCCL::uid_: the order a rank built them
STEP_NS = 5_000_000  # 5 ms between calls
T0_NS = 1_796_452_214_395_836_014


class Job:
    """The layout (Megatron's rank order: TP innermost) and what every rank records."""

    def __init__(self, ranks: int, entries: int, tp: int, culprit: int,
                 grad_sync: str = "reduce_scatter"):
        self.ranks, self.entries, self.tp, self.culprit = ranks, entries, tp, culprit
        # The DP gradient sync: the distributed optimizer's reduce-scatter, or DDP's all-reduce of
        # the bucket (the call a skip-decision protocol issues: postmortem's naming then
        # simulates every layout that holds the job's groups instead of ruling them out at once).
        self.grad_sync = grad_sync
        self.step = list(STEP)
        if grad_sync == "all_reduce":
            _, _, dtype, _, _, thread, frames = STEP[LAST_STEP_POS]
            self.step[LAST_STEP_POS] = ("dp", "nccl:all_reduce", dtype, None, None, thread, frames)
        self.dp = ranks // tp
        self.default_ranks = str(list(range(ranks)))  # c10d writes "[0, 1, ...]"
        bucket = -(-40_000_000 // self.dp) * self.dp  # gradient bucket, a multiple of DP
        self.rs = ([[bucket]], [[bucket // self.dp]])
        self.ar = ([[bucket]], [[bucket]])
        self.ag = ([[bucket // self.dp]], [[bucket]])
        # Call i of every rank holds step position (i - (entries - 1) + LAST) % len(STEP).
        self.kinds = [(i - (entries - 1) + LAST_STEP_POS) % len(self.step) for i in range(entries)]
        # collective_seq_id per group kind, the same on every rank (one counter per group).
        self.seqs, counters = [], {"world": 0, "dp": 0, "tp": 0}
        for k in self.kinds:
            counters[self.step[k][0]] += 1
            self.seqs.append(counters[self.step[k][0]])
        self.last_seq = dict(counters)

    def group(self, kind: str, rank: int) -> tuple[str, list[int]]:
        """The name and members of `rank`'s group of a kind. Names as torch numbers groups: in
        Megatron's order of new_group() calls (DP groups, then TP), which every rank makes."""
        if kind == "world":
            return "0", []
        if kind == "dp":
            j = rank % self.tp
            return str(1 + j), list(range(j, self.ranks, self.tp))
        g = rank // self.tp
        return str(1 + self.tp + g), list(range(g * self.tp, (g + 1) * self.tp))

    def dump(self, rank: int) -> dict:
        """The dict rank `rank`'s recorder would dump (torch 2.15, FlightRecorder version 2.10)."""
        names = {k: self.group(k, rank)[0] for k in DESC}
        pgs = {k: (names[k], DESC[k]) for k in DESC}
        pg_config = {"0": {"name": "0", "desc": "default_pg", "ranks": self.default_ranks}}
        for k in ("dp", "tp"):
            name, members = self.group(k, rank)
            pg_config[name] = {"name": name, "desc": DESC[k], "ranks": str(members)}
        n = self.entries - 1 if rank == self.culprit else self.entries
        # The culprit's DP peers hang in the call it never issued: started, never completed.
        hung_group = rank != self.culprit and rank % self.tp == self.culprit % self.tp
        threads = {"fwd": ("python", str(139_870_000_000_000 + 4096 * rank)),
                   "bwd": ("pt_autograd_0", str(139_860_000_000_000 + 4096 * rank))}
        jitter = (rank * 7919) % 100_000  # ranks reach a call at slightly different times
        dtypes = {d: [d] for d in ("BFloat16", "Float")}
        entries = []
        for i in range(n):
            kind, prof, dtype, ins, outs, thread, frames = self.step[self.kinds[i]]
            if ins is None:
                ins, outs = (self.rs if "reduce_scatter" in prof else
                             self.ar if "all_reduce" in prof else self.ag)
            hung = hung_group and i == self.entries - 1
            created = T0_NS + i * STEP_NS + jitter
            # Lists shared between entries are written in full each time all the same (c10
            # memoises only the frames), and let the pickler reuse their bytes.
            entries.append({
                "frames": frames,
                "record_id": i,
                "pg_id": PG_ID[kind],
                "process_group": pgs[kind],
                "thread_name": threads[thread][0],
                "thread_id": threads[thread][1],
                "collective_seq_id": self.seqs[i],
                "p2p_seq_id": 0,
                "op_id": self.seqs[i],
                "profiling_name": prof,
                "time_created_ns": created,
                "input_sizes": ins,
                "input_dtypes": dtypes[dtype],
                "output_sizes": outs,
                "output_dtypes": dtypes[dtype],
                "state": "started" if hung else "completed",
                "time_discovered_started_ns": created + 40_000,
                "time_discovered_completed_ns": None if hung else created + 1_500_000,
                "retired": not hung,
                "timeout_ms": 600_000,
                "is_p2p": False,
            })
        pg_status = {}
        for k in DESC:
            last = self.last_seq[k] - (1 if k == "dp" and rank == self.culprit else 0)
            pg_status[str(PG_ID[k])] = {
                "last_enqueued_collective": last,
                "last_started_collective": last,
                "last_completed_collective": last - 1 if k == "dp" and hung_group else last,
            }
        return {"version": "2.10", "pg_config": pg_config, "comm_lib_version": "2.27.5",
                "pg_status": pg_status, "entries": entries}

    def expected(self) -> dict:
        """The planted divergence: the culprit's DP group, its last call, the culprit missing."""
        name, members = self.group("dp", self.culprit)
        return {"group": name, "group_desc": DESC["dp"], "seq": self.last_seq["dp"],
                "op": self.grad_sync, "not_issued": [self.culprit],
                "issued": [r for r in members if r != self.culprit]}


_JOB: Job | None = None  # each worker's copy


def _init_worker(job: Job) -> None:
    global _JOB
    _JOB = job


def _write_ranks(args: tuple[str, range]) -> tuple[int, int]:
    directory, ranks = args
    total = 0
    for r in ranks:
        data = C10Pickler().dumps(_JOB.dump(r))
        with open(os.path.join(directory, f"{PREFIX}{r}"), "wb") as f:
            f.write(data)
        total += len(data)
    return len(ranks), total


def generate(job: Job, directory: Path, jobs: int) -> tuple[int, float]:
    """Writes every rank's dump; returns (bytes written, seconds)."""
    t0 = time.perf_counter()
    chunk = max(1, min(64, job.ranks // (jobs * 8) or 1))
    work = [(str(directory), range(a, min(a + chunk, job.ranks)))
            for a in range(0, job.ranks, chunk)]
    total, done = 0, 0
    with multiprocessing.Pool(jobs, initializer=_init_worker, initargs=(job,)) as pool:
        for count, n in pool.imap_unordered(_write_ranks, work):
            total += n
            done += count
            if sys.stderr.isatty():
                print(f"\r  writing dumps {done}/{job.ranks} "
                      f"({time.perf_counter() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print("\r\x1b[K", end="", file=sys.stderr, flush=True)
    return total, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def _tree_rss_kib(pid: int) -> int:
    """Resident memory of a process and its descendants, from /proc (0 once gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
    return total


def run_timed(cmd: list[str], out_path: Path, timeout_s: float, mem_cap_kib: int) -> dict:
    """Runs cmd (stdout and stderr to out_path) until it exits, times out or passes mem_cap_kib.
    Returns wall and CPU seconds (user + system: the CPU figure holds when other work shares the
    cores), peak RSS (the child's ru_maxrss), exit code, and why it stopped, if it was stopped."""
    with open(out_path, "wb") as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        stopped, polled_peak = None, 0
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            wall = time.perf_counter() - t0
            rss = _tree_rss_kib(p.pid)
            polled_peak = max(polled_peak, rss)
            if stopped is None and wall > timeout_s:
                stopped = "timeout"
            elif stopped is None and rss > mem_cap_kib:
                stopped = "memory"
            if stopped:
                os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.05 if wall < 5 else 0.25)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    peak = max(ru.ru_maxrss, polled_peak)
    return {"wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "peak_rss_mib": round(peak / 1024, 1), "exit_code": p.returncode, "stopped": stopped}


def check_lossguard(report_path: Path, expected: dict) -> tuple[bool, str]:
    """Whether lossguard's --json divergences[0] is the planted divergence."""
    try:
        doc = json.loads(report_path.read_text())
        d = doc["divergences"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        return False, f"no divergences[0] in its --json ({e})"
    ok = (d.get("kind") == "missing_call" and d.get("group") == expected["group"]
          and d.get("seq") == expected["seq"] and d.get("not_issued") == expected["not_issued"]
          and d.get("call", {}).get("op") == expected["op"]
          and sorted(d.get("issued", [])) == expected["issued"]
          and len(doc["divergences"]) == 1)
    return ok, d.get("summary", "")


def check_fr_trace(log_path: Path, expected: dict) -> tuple[bool, str]:
    """Whether fr_trace logged the planted call as not joined by the culprit."""
    text = log_path.read_text(errors="replace")
    blocks = re.split(r"\n(?=Not all ranks joining collective|Collective sequence number)", text)
    for b in blocks:
        m = re.match(r"Not all ranks joining collective, sequence number: (\d+)", b)
        if not m:
            continue
        g = re.search(r"group info: (\S+)", b)
        miss = re.search(r"missing ranks: \{([\d, ]*)\}", b)
        got_missing = sorted(int(x) for x in miss.group(1).split(",")) if miss else None
        summary = (f"seq {m.group(1)} on {g.group(1) if g else '?'}: missing ranks "
                   f"{got_missing}")
        if (int(m.group(1)) == expected["seq"] and g
                and g.group(1) == f"{expected['group']}:{expected['group_desc']}"
                and got_missing == expected["not_issued"]):
            others = sum(x.startswith(("Not all ranks", "Collective sequence")) for x in blocks)
            return True, summary + (f" ({others} reports in all)" if others > 1 else "")
    tail = text.strip().splitlines()[-1:] or ["(no output)"]
    return False, f"not reported; last line: {tail[0][:200]}"


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def binary_info(path: Path) -> dict:
    """Which lossguard was timed: its path, build time and the checkout's commit."""
    info = {"path": str(path), "built": time.strftime("%Y-%m-%dT%H:%M:%S",
                                                       time.localtime(path.stat().st_mtime))}
    try:
        info["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 8 << 20


def prepare_dumps(args: argparse.Namespace, job: Job, directory: Path) -> dict:
    """Generates the dumps into `directory`, or reuses those a previous run left there."""
    params = {"ranks": job.ranks, "entries": job.entries, "tp": job.tp, "culprit": job.culprit,
              "grad_sync": job.grad_sync,
              "generator": 2}
    manifest = directory / MANIFEST
    if manifest.exists():
        old = json.loads(manifest.read_text())
        # A manifest written before --grad-sync existed holds the reduce-scatter job.
        old.setdefault("grad_sync", "reduce_scatter")
        if {k: old.get(k) for k in params} == params:
            size = sum(e.stat().st_size for e in os.scandir(directory) if e.name.startswith(PREFIX))
            print(f"reusing the dumps in {directory} ({size / GIB:.2f} GiB)")
            return {"bytes": size, "generate_s": None, "reused": True}
        sys.exit(f"{directory} holds dumps of another job ({old}): pick another --dir")
    if directory.exists() and any(directory.iterdir()):
        sys.exit(f"{directory} exists and is not empty, and not this script's: pick another --dir")
    # Disk: every rank's dump is about the size of rank 0's (the culprit's is one call shorter).
    sample = job.dump(0)
    data = C10Pickler().dumps(sample)
    if pickle.loads(data) != sample:  # the encoder's output must read back as what it encoded
        sys.exit("internal error: rank 0's dump does not unpickle to itself")
    estimate = len(data) * job.ranks
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    print(f"dumps: {job.ranks} ranks x {job.entries} calls, about {estimate / GIB:.2f} GiB; "
          f"{free / GIB:.1f} GiB free on {probe}")
    if estimate > free - 5 * GIB:
        sys.exit(f"not enough disk: the dumps need about {estimate / GIB:.1f} GiB and "
                 f"{free / GIB:.1f} GiB are free (5 GiB kept spare); nothing written")
    directory.mkdir(parents=True, exist_ok=True)
    size, secs = generate(job, directory, args.jobs)
    manifest.write_text(json.dumps(params))
    print(f"wrote {job.ranks} dumps, {size / GIB:.2f} GiB ({size / job.ranks / 1e6:.2f} MB per "
          f"rank), in {secs:.1f} s on {args.jobs} processes")
    return {"bytes": size, "generate_s": round(secs, 1), "reused": False}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=128, help="world size (a multiple of --tp)")
    ap.add_argument("--entries", type=int, default=2000, help="calls recorded per rank")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size")
    ap.add_argument("--culprit", type=int, default=None,
                    help="the rank missing its last DP call (default: ranks*5/8 + 3)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the dumps go (default /tmp/lossguard_pm_bench_<ranks>x<entries>)")
    ap.add_argument("--keep", action="store_true", help="keep the dumps afterwards")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="processes writing dumps")
    ap.add_argument("--lossguard", type=Path, default=DEFAULT_LOSSGUARD)
    ap.add_argument("--python", type=Path, default=DEFAULT_PYTHON,
                    help="a Python with torch, for fr_trace")
    ap.add_argument("--grad-sync", choices=("reduce_scatter", "all_reduce"),
                    default="reduce_scatter",
                    help="the DP gradient call the culprit skips: the distributed optimizer's "
                         "reduce-scatter (no skip-decision protocol issues one: naming stops at "
                         "once), or DDP's all-reduce (naming simulates the layouts)")
    ap.add_argument("--skip-fr-trace", action="store_true")
    ap.add_argument("--fr-trace-timeout", type=float, default=600.0, metavar="S")
    ap.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                    help="lossguard's time limit")
    ap.add_argument("--mem-cap-gib", type=float, default=None,
                    help="stop a tool whose resident memory passes this (default: 80%% of "
                         "MemAvailable at start)")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args()

    if args.ranks < args.tp or args.ranks % args.tp:
        ap.error(f"--ranks ({args.ranks}) must be a multiple of --tp ({args.tp})")
    if args.entries < 2:
        ap.error("--entries must be at least 2")
    culprit = args.culprit if args.culprit is not None else args.ranks * 5 // 8 + 3
    if not 0 <= culprit < args.ranks:
        ap.error(f"--culprit must be a rank in [0, {args.ranks})")
    if not args.lossguard.exists():
        ap.error(f"{args.lossguard} not found (build it, or pass --lossguard)")
    job = Job(args.ranks, args.entries, args.tp, culprit, args.grad_sync)
    expected = job.expected()
    directory = args.dir or (Path(tempfile.gettempdir())
                             / f"lossguard_pm_bench_{args.ranks}x{args.entries}")
    mem_cap_kib = int(args.mem_cap_gib * (1 << 20)) if args.mem_cap_gib else \
        int(mem_available_kib() * 0.8)

    print(f"job: TP{job.tp} x DP{job.dp} ({job.ranks} ranks), {job.entries} calls per rank; "
          f"planted: rank {culprit} never issued {job.grad_sync} #{expected['seq']} on its DP "
          f"group '{expected['group']}' ({len(expected['issued'])} peers wait in it)")
    dumps = prepare_dumps(args, job, directory)
    results: dict = {"ranks": job.ranks, "entries": job.entries, "tp": job.tp, "dp": job.dp,
                     "culprit": culprit, "expected": expected, "dir": str(directory),
                     "dump_bytes": dumps["bytes"], "generate_s": dumps["generate_s"],
                     "mem_available_gib": round(mem_available_kib() / (1 << 20), 1),
                     "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
                     "lossguard_binary": binary_info(args.lossguard)}
    work = Path(tempfile.mkdtemp(prefix="pm_bench_"))
    try:
        # lossguard, its report to a file (as --json /dev/null costs, but checkable).
        report = work / "lossguard.json"
        lg = run_timed([str(args.lossguard), "postmortem", str(directory), "--json", str(report)],
                       work / "lossguard.txt", args.timeout, mem_cap_kib)
        lg["found"], lg["summary"] = check_lossguard(report, expected)
        lg["ok"] = lg["exit_code"] == 3 and lg["found"]
        if not lg["ok"]:
            lg["output_tail"] = (work / "lossguard.txt").read_text(errors="replace")[-2000:]
        results["lossguard"] = lg

        if args.skip_fr_trace:
            results["fr_trace"] = None
        else:
            # What fr_trace spends before reading a dump: starting Python and importing torch.
            start = run_timed([str(args.python), "-c",
                               "import torch.distributed.flight_recorder.fr_trace"],
                              work / "import.txt", 300, mem_cap_kib)
            results["fr_trace_startup_s"] = start["wall_s"]
            fr = run_timed([str(args.python), "-m", "torch.distributed.flight_recorder.fr_trace",
                            str(directory), "-p", PREFIX], work / "fr_trace.txt",
                           args.fr_trace_timeout, mem_cap_kib)
            if fr["stopped"] is None:
                fr["found"], fr["summary"] = check_fr_trace(work / "fr_trace.txt", expected)
                fr["ok"] = fr["exit_code"] == 0 and fr["found"]
                if not fr["ok"]:
                    fr["output_tail"] = (work / "fr_trace.txt").read_text(errors="replace")[-2000:]
            else:
                fr["found"], fr["ok"] = None, None
                fr["summary"] = (f"did not finish in {args.fr_trace_timeout:.0f} s"
                                 if fr["stopped"] == "timeout" else
                                 f"stopped at {mem_cap_kib / (1 << 20):.1f} GiB resident "
                                 f"after {fr['wall_s']:.0f} s")
            results["fr_trace"] = fr
            if fr["stopped"] is None and lg["wall_s"] > 0:
                ratio = round(fr["wall_s"] / lg["wall_s"], 1)
                results["time_ratio_fr_trace_over_lossguard"] = ratio
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep and args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    ok = results["lossguard"]["ok"] and (results["fr_trace"] is None
                                         or results["fr_trace"]["ok"] is not False)
    return 0 if ok else 1


def print_table(r: dict) -> None:
    lg, fr = r["lossguard"], r["fr_trace"]
    print(f"\n{r['ranks']} ranks x {r['entries']} calls, {r['dump_bytes'] / GIB:.2f} GiB of dumps")
    print(f"{'tool':<20}{'wall s':>9}{'CPU s':>9}{'peak RSS MiB':>14}{'exit':>6}  "
          "planted divergence")
    rows = [("lossguard postmortem", lg)] + ([("fr_trace", fr)] if fr else [])
    for name, x in rows:
        found = {True: "found: ", False: "NOT FOUND: ", None: ""}[x["found"]]
        print(f"{name:<20}{x['wall_s']:>9.2f}{x['cpu_s']:>9.2f}{x['peak_rss_mib']:>14.0f}"
              f"{x['exit_code']:>6}  {found}{x['summary']}")
    if fr is None:
        print("fr_trace: skipped")
    elif fr["stopped"]:
        print(f"fr_trace {fr['summary']}: no ratio")
    else:
        print(f"fr_trace / lossguard: {r['time_ratio_fr_trace_over_lossguard']}x the time, "
              f"{fr['peak_rss_mib'] / max(lg['peak_rss_mib'], 1):.1f}x the memory "
              f"(fr_trace's wall time includes {r['fr_trace_startup_s']:.1f} s importing torch)")
    for name, x in rows:
        if x.get("output_tail"):
            print(f"--- {name} output (tail) ---\n{x['output_tail']}")


if __name__ == "__main__":
    sys.exit(main())
