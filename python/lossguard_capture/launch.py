"""Settings of an adapter switched on by a trainer's own flags (slime, Relax), wherever the trainer runs.

slime launches its Megatron processes as Ray actors (``ray job submit``; slime/ray/actor_group.py builds each
actor's ``runtime_env`` from a few defaults and ``--train-env-vars``): a variable set where the job is submitted
never reaches them.  So each setting is read from this process's environment first, then from the trainer's own
``args.train_env_vars`` (slime's ``--train-env-vars '{"LOSSGUARD_OUT": ...}'``, a JSON dict), then its default —
and checked where it is used, at the init hook, before the first rollout: the capture folder writable on every
rank, the ``lossguard`` binary runnable on the auditing rank (with fail fast).  A failed check says the one line
that fixes it.

* ``LOSSGUARD_OUT``: the capture folder (default ``lossguard-captures``); it need not be shared between nodes
  (every rank's capture reaches rank 0 over the process group: :func:`lossguard_capture.audit.share_captures`);
* ``LOSSGUARD_STEPS``: the train steps captured (``0``; a comma list, or ``all``);
* ``LOSSGUARD_FAIL_FAST``: ``1`` (default) audits the first captured step and stops the run on FAIL; ``0`` records;
* ``LOSSGUARD_BIN``: the ``lossguard`` binary (default: ``PATH``)."""
from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .audit import AuditError, find_lossguard

NAMES = ("LOSSGUARD_OUT", "LOSSGUARD_STEPS", "LOSSGUARD_FAIL_FAST", "LOSSGUARD_BIN")


def steps_of(value: str) -> list[int] | None:
    """``LOSSGUARD_STEPS``: ``"0,3"`` -> [0, 3]; ``"all"`` -> None."""
    value = value.strip()
    if value == "all":
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"LOSSGUARD_STEPS={value!r}: a comma list of train steps (slime's train/step) or "
                         f"'all'") from None


def _trainer_env(args: Any) -> Mapping[str, Any]:
    env = getattr(args, "train_env_vars", None)
    return env if isinstance(env, Mapping) else {}


@dataclass
class Settings:
    out_dir: str
    steps: list[int] | None
    fail_fast: bool
    lossguard_bin: str | None
    source: dict[str, str]        # setting -> "environment", "--train-env-vars" or "default"


def settings(args: Any = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Each setting from ``environ`` (default ``os.environ``), else ``args.train_env_vars``, else its default."""
    environ = os.environ if environ is None else environ
    trainer_env = _trainer_env(args)
    source: dict[str, str] = {}

    def get(name: str, default: str | None) -> str | None:
        if environ.get(name):
            source[name] = "environment"
            return environ[name]
        if trainer_env.get(name) not in (None, ""):
            source[name] = "--train-env-vars"
            return str(trainer_env[name])
        source[name] = "default"
        return default

    out_dir = get("LOSSGUARD_OUT", "lossguard-captures")
    steps = get("LOSSGUARD_STEPS", "0")
    fail_fast = get("LOSSGUARD_FAIL_FAST", "1")
    binary = get("LOSSGUARD_BIN", None)
    assert out_dir is not None and steps is not None and fail_fast is not None
    return Settings(out_dir, steps_of(steps), fail_fast != "0", binary, source)


def _fix(name: str, value: str) -> str:
    return (f"set it for every trainer process: slime/Relax --train-env-vars '{{\"{name}\": \"{value}\"}}' "
            f"(a variable set where the job is submitted does not reach its Ray actors)")


def check(s: Settings, *, auditing_rank: bool, who: str) -> None:
    """The capture folder is writable here; on the auditing rank with fail fast, the binary runs. RuntimeError
    naming the setting, where it came from, and the one line that fixes it."""
    try:
        os.makedirs(s.out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=s.out_dir, prefix=".lossguard-write-check-"):
            pass
    except OSError as e:
        raise RuntimeError(f"{who}: the capture folder LOSSGUARD_OUT={s.out_dir!r} (from "
                           f"{s.source.get('LOSSGUARD_OUT', 'default')}) is not writable in this process ({e}); "
                           f"{_fix('LOSSGUARD_OUT', '/a/writable/folder')}") from None
    if not (auditing_rank and s.fail_fast):
        return
    try:
        exe = find_lossguard(s.lossguard_bin)
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise AuditError(f"`{exe} --version` exited {r.returncode}: {(r.stderr or r.stdout).strip()[:300]}")
    except (AuditError, OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{who}: fail fast needs a runnable lossguard binary on the auditing rank, and this "
                           f"process has none ({e}); {_fix('LOSSGUARD_BIN', '/path/to/lossguard')}, or "
                           f"LOSSGUARD_FAIL_FAST=0 to record without auditing") from None
