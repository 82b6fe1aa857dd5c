"""Run ``lossguard audit`` from inside a training job, and agree on its verdict on every rank.

``run_audit(paths)`` runs the binary (``binary=`` / ``$LOSSGUARD_BIN`` / ``lossguard`` on ``PATH``) and
returns an :class:`AuditResult`; ``result.raise_for_verdict()`` raises :class:`AuditFailed` when the
verdict is FAIL (exit 1, or 3: a distributed fault) and :class:`AuditError` when audit gave no verdict
(bad or missing captures: exit 2; nothing verified: exit 4; a missing binary, a timeout).

``agree(key, compute, timeout=...)`` runs ``compute()`` on rank 0 once every rank has called it and
hands its (JSON) result to every rank through the process group's store, each wait bounded by a
timeout: no rank hangs, and a rank that cannot learn the result raises :class:`AuditError`.
"""

import json
import os
import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["AuditResult", "AuditFailed", "AuditError", "find_lossguard", "run_audit", "agree", "EXIT_MEANINGS"]

#: lossguard's exit codes (docs/exit-codes.md)
EXIT_MEANINGS = {0: "pass", 1: "fail", 2: "error (inputs or invocation)", 3: "fault (distributed)",
                 4: "unverified (nothing checked)"}


class AuditError(RuntimeError):
    """``lossguard audit`` gave no verdict: no binary, a timeout, captures it refused (exit 2), nothing
    verified (exit 4), or this rank could not learn the verdict from rank 0."""

    def __init__(self, message: str, result: "AuditResult | None" = None):
        super().__init__(message)
        self.result = result


class AuditFailed(RuntimeError):
    """``lossguard audit`` judged the captured step and it FAILED (exit 1; 3 for a distributed fault).
    ``text`` is audit's own report; ``exit_code``, ``step`` and ``paths`` say what was audited."""

    def __init__(self, result: "AuditResult"):
        self.result = result
        self.exit_code = result.exit_code
        self.text = result.text
        self.step = result.step
        self.paths = result.paths
        where = f"step {result.step}" if result.step is not None else "the captures"
        super().__init__(f"lossguard audit FAILED {where} (exit {result.exit_code}: "
                         f"{EXIT_MEANINGS.get(result.exit_code, '?')}):\n{result.text.rstrip()}\n"
                         f"(command: {' '.join(result.command)})")


class AuditResult:
    """What ``lossguard audit`` said: ``exit_code``, ``text`` (stdout then stderr), the ``command`` run,
    the audited ``paths``, and ``json_path`` when a JSON report was asked for."""

    def __init__(self, exit_code: int, text: str, command: Sequence[str], paths: Sequence[str],
                 step: int | None = None, json_path: str | None = None):
        self.exit_code = int(exit_code)
        self.text = text
        self.command = list(command)
        self.paths = list(paths)
        self.step = step
        self.json_path = json_path

    @property
    def verdict(self) -> str:
        return {0: "pass", 1: "fail", 2: "error", 3: "fault", 4: "unverified"}.get(self.exit_code, "error")

    @property
    def passed(self) -> bool:
        return self.exit_code == 0

    def raise_for_verdict(self) -> None:
        """AuditFailed on FAIL (1) or FAULT (3), AuditError on no verdict (2, 4, anything else)."""
        if self.exit_code == 0:
            return
        if self.exit_code in (1, 3):
            raise AuditFailed(self)
        raise AuditError(f"lossguard audit gave no verdict (exit {self.exit_code}: "
                         f"{EXIT_MEANINGS.get(self.exit_code, 'unexpected')}):\n{self.text.rstrip()}\n"
                         f"(command: {' '.join(self.command)})", self)

    def to_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "text": self.text, "command": self.command, "paths": self.paths,
                "step": self.step, "json_path": self.json_path}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "AuditResult":
        return cls(d["exit_code"], d["text"], d["command"], d["paths"], d.get("step"), d.get("json_path"))


def find_lossguard(binary: str | None = None) -> str:
    """The ``lossguard`` executable: ``binary``, else ``$LOSSGUARD_BIN``, else the one installed in this Python
    environment's scripts folder (where ``pip install`` of the lossguard wheel puts it: found even when the
    environment is not activated, e.g. ``/venv/bin/python train.py``), else ``lossguard`` on ``PATH``.
    AuditError naming them when none is an executable file."""
    for where, cand in (("binary=", binary), ("$LOSSGUARD_BIN", os.environ.get("LOSSGUARD_BIN"))):
        if cand:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return os.path.abspath(cand)
            raise AuditError(f"lossguard binary {cand!r} (from {where}) is not an executable file")
    scripts = sysconfig.get_path("scripts")
    found = shutil.which("lossguard", path=scripts) if scripts else None
    found = found or shutil.which("lossguard")
    if found:
        return found
    raise AuditError(f"no lossguard binary: pass binary=..., set LOSSGUARD_BIN, install it into this environment "
                     f"({scripts}) or put `lossguard` on PATH (build: cmake --build build; the binary is "
                     f"build/cli/lossguard)")


def run_audit(paths: Sequence[str], *, binary: str | None = None, args: Sequence[str] = (),
              timeout: float = 300.0, json_path: str | None = None, step: int | None = None) -> AuditResult:
    """``lossguard audit PATHS... ARGS... [--json JSON_PATH]``; AuditError if it cannot run or times out."""
    exe = find_lossguard(binary)
    cmd: list[str] = [exe, "audit", *[str(p) for p in paths], *[str(a) for a in args]]
    if json_path is not None:
        cmd += ["--json", json_path]
        if os.path.lexists(json_path):          # an earlier run's report must not stand for this one
            os.remove(json_path)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AuditError(f"lossguard audit did not finish within {timeout:g} s: {' '.join(cmd)}") from e
    except OSError as e:
        raise AuditError(f"lossguard audit could not run: {e}: {' '.join(cmd)}") from e
    text = r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr if r.stderr else "")
    if json_path is not None and r.returncode in (0, 1, 3):
        _check_report(json_path, r.returncode, cmd)
    return AuditResult(r.returncode, text, cmd, [str(p) for p in paths], step, json_path)


def _check_report(json_path: str, exit_code: int, cmd: Sequence[str]) -> None:
    """A verdict (exit 0, 1 or 3) stands only with the JSON report lossguard writes for it: a binary that exits 0
    without one (a wrapper script, ``true``, another program called lossguard) gave no verdict."""
    why = None
    try:
        with open(json_path) as f:
            report = json.load(f)
        if not isinstance(report, dict) or report.get("schema") != "lossguard/1":
            why = f"{json_path} is not a lossguard report (no schema lossguard/1)"
        elif report.get("exit_code") != exit_code:
            why = f"the report {json_path} says exit {report.get('exit_code')}, the process exited {exit_code}"
    except FileNotFoundError:
        why = f"it wrote no report at {json_path}"
    except (OSError, ValueError) as e:
        why = f"its report {json_path} cannot be read: {e}"
    if why is not None:
        raise AuditError(f"{cmd[0]} exited {exit_code} but {why}: is it lossguard? (command: {' '.join(cmd)})")


def _default_store() -> Any:
    """The default process group's store (torch.distributed.distributed_c10d._get_default_store: a
    private function, present since torch 1.x); None where it is not available."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:
        return None


def agree(key: str, compute: Callable[[], dict[str, Any]], *, timeout: float = 300.0,
          wait_timeout: float | None = None) -> dict[str, Any]:
    """Every rank calls this with the same ``key``; rank 0 runs ``compute()`` once all ranks have arrived
    (or reports the missing ones after ``timeout``) and every rank returns its JSON-able result.

    No collective is issued: the ranks meet on the default process group's store (``add`` to count
    arrivals, the last arrival ``set``s a key rank 0 blocks on, ``set``/``wait``/``get`` for the result), every
    wait bounded — rank 0 waits ``timeout`` for
    the others, the others wait ``wait_timeout`` (default ``2*timeout + 30`` s) for rank 0 — so a crashed
    or stuck rank makes the others raise :class:`AuditError` instead of hanging.  Without an initialised
    process group (or with one rank) ``compute()`` runs here.  An exception in ``compute()`` on rank 0 becomes
    ``{"error": message}`` on every rank."""
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:                 # pragma: no cover
        distributed = False

    def safe() -> dict[str, Any]:
        try:
            return compute()
        except Exception as e:                          # noqa: BLE001 - handed to every rank
            return {"error": f"{type(e).__name__}: {e}"}

    if not distributed:
        return safe()
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _default_store()
    if store is None:       # fall back on a collective (bounded by the process group's own timeout)
        box: list[Any] = [safe() if rank == 0 else None]
        dist.barrier()
        dist.broadcast_object_list(box, src=0)
        return box[0]
    arrived, all_key = f"lossguard_capture/{key}/arrived", f"lossguard_capture/{key}/all"
    result_key = f"lossguard_capture/{key}/result"
    # The last rank to arrive (the one whose add returns the world size) says so; rank 0 blocks on that
    # key — no polling, no sleep: it runs the audit the moment the last rank arrives.
    if store.add(arrived, 1) == world:
        store.set(all_key, "1")
    if rank == 0:
        try:
            store.wait([all_key], timedelta(seconds=timeout))
            result = safe()
        except Exception:                               # noqa: BLE001 - a timeout: who is missing is said
            n = store.add(arrived, 0)
            result = {"error": f"only {n} of {world} ranks reached the audit of {key} within {timeout:g} s"}
        store.set(result_key, json.dumps(result))
        return result
    wait_s = 2 * timeout + 30 if wait_timeout is None else wait_timeout
    try:
        store.wait([result_key], timedelta(seconds=wait_s))
        return json.loads(store.get(result_key))
    except Exception as e:                              # noqa: BLE001 - a timeout or a lost store
        raise AuditError(f"rank {rank}: no audit verdict from rank 0 for {key} within {wait_s:g} s "
                         f"({type(e).__name__}: {e})") from e


def share_captures(key: str, path: str | None, folder: str, *, timeout: float = 300.0) -> list[str]:
    """Bring every rank's capture of one step into rank 0's ``folder`` over the job's own process group, so
    that ``lossguard audit`` on rank 0 sees them all without a shared file system (a node-local output folder,
    a private one per rank).  Every rank calls it with the same ``key`` and its own capture ``path`` (None: it
    wrote none).  Rank 0 asks only for the files its folder lacks, so on a shared folder nothing is sent but
    the names.  Returns, on rank 0, the files it received (written into ``folder`` atomically); ``[]``
    elsewhere.

    Over the default store, as :func:`agree`: each rank publishes its file's name; rank 0 (once every rank has
    arrived, or after ``timeout``) says which it lacks; those ranks put their file's bytes in the store and rank
    0 writes them.  Rank 0 waits ``timeout`` for the ranks and for each file, the others ``2*timeout + 30`` s for
    its question (it comes after rank 0's own wait): a rank that never answers leaves its file missing, and audit
    reports the missing rank.  Without a process group (or one rank, or no store) it does nothing."""
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:                 # pragma: no cover
        distributed = False
    store = _default_store() if distributed else None
    if store is None:
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    base = f"lossguard_capture/{key}/share"
    name = "" if path is None else os.path.basename(path)
    store.set(f"{base}/name/{rank}", name)
    if store.add(f"{base}/arrived", 1) == world:
        store.set(f"{base}/all", "1")
    wait = timedelta(seconds=timeout)
    if rank != 0:
        try:            # rank 0 itself may wait `timeout` for the last rank before it asks: wait longer (as agree)
            store.wait([f"{base}/need/{rank}"], timedelta(seconds=2 * timeout + 30))
            if store.get(f"{base}/need/{rank}") == b"1" and path is not None:
                with open(path, "rb") as f:
                    store.set(f"{base}/data/{rank}", f.read())
        except Exception:                               # noqa: BLE001 - rank 0 gone: audit says what is missing
            pass
        return []
    try:
        store.wait([f"{base}/all"], wait)
    except Exception:                                   # noqa: BLE001 - those who arrived are asked
        pass
    needed: list[tuple[int, str]] = []
    for r in range(1, world):
        # Every rank gets an answer, even one that has not arrived (it will find "0" and go on): a rank
        # never waits out the timeout for a question rank 0 did not ask. Its name is read with a
        # non-blocking check — a wait with a tiny timeout can expire under load although the key is there,
        # which kept such a rank here for the whole timeout and rank 0's agree() waiting for it.
        try:
            theirs = store.get(f"{base}/name/{r}").decode() if store.check([f"{base}/name/{r}"]) else ""
        except Exception:                               # noqa: BLE001 - a lost store: nothing is asked
            theirs = ""
        need = bool(theirs) and os.path.sep not in theirs and not os.path.exists(os.path.join(folder, theirs))
        store.set(f"{base}/need/{r}", "1" if need else "0")
        if need:
            needed.append((r, theirs))
    received = []
    for r, theirs in needed:
        try:
            store.wait([f"{base}/data/{r}"], wait)
            data = store.get(f"{base}/data/{r}")
        except Exception:                               # noqa: BLE001 - bounded: audit names the missing rank
            continue
        os.makedirs(folder, exist_ok=True)
        dest = os.path.join(folder, theirs)
        tmp = f"{dest}.part{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
        store.delete_key(f"{base}/data/{r}")
        received.append(dest)
    return received
