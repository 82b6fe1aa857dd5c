"""The rows of docs/gallery.md: what ``lossguard audit`` said about each configuration a real-trainer test
audits.  When ``LOSSGUARD_GALLERY_DIR`` is set, :func:`record` appends one JSON line per audited
configuration to ``$LOSSGUARD_GALLERY_DIR/<trainer>.jsonl``; otherwise it does nothing (a plain test run
writes nothing).  ``scripts/gallery.py`` (``make gallery``) runs the test files with it set and renders
docs/gallery.md from docs/gallery.template.md and the rows.

A row (one JSON object):

* ``trainer`` (hf, trl, megatron, verl), ``kind`` (``audit``, or ``failfast``: a run the adapter stopped),
  ``key`` (the test's parameter id, unique per trainer and kind), ``test`` (the pytest node that recorded it);
* ``versions``: the trainer's packages as installed in the venv that ran the test, and ``lossguard``;
* ``config``: the configuration's fields (what the test parametrises, and what the driver resolved);
* ``exit_code``, ``verdict``; ``steps``: per audited step its ``verdict``, ``reduce``, ``global_tokens``,
  ``checks`` (name, ok, detail), ``diagnosis``, ``matches`` (the presets and single changes that reproduce
  the weights: audit's "reproduced by") and ``lines`` (audit's text block of that step); ``findings``;
  ``text``/``stderr``: audit's whole output;
* ``audit_command`` (the exact argv), ``run_command`` (the exact argv of the driver run that wrote the
  captures, when the test's fixture named it with :func:`remember_run`); ``audit_line``, ``run_line``: the
  same as shell lines to paste at the repository root, the run's output folder as ``$OUT`` (as it is in
  the texts too), and ``reproduce``: both in one line.
"""
import json
import os
import re
import shlex
import sys

ENV = "LOSSGUARD_GALLERY_DIR"
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

#: the packages whose versions a trainer's rows carry (the venv's, read when the row is recorded)
PACKAGES = {
    "hf": ("transformers", "accelerate", "torch"),
    "trl": ("trl", "transformers", "accelerate", "torch"),
    "megatron": ("megatron-core", "torch"),
    "megatron_shapes": ("megatron-core", "torch"),
    "slime": ("megatron-core", "torch"),
    "slime_history": ("megatron-core", "torch"),        # slime's own files: the commit is in the row's config
    "relax": ("megatron-core", "torch"),
    "verl": ("verl", "transformers", "tensordict", "torch"),
}

_RUNS = {}          # the output folder of a driver run -> its argv


def enabled():
    return bool(os.environ.get(ENV))


def remember_run(out_dir, argv):
    """The driver command that wrote ``out_dir`` (a test's ``runs`` fixture): the rows audited from captures
    under it name it as their ``run_command``."""
    if enabled():
        _RUNS[os.path.abspath(str(out_dir))] = [str(a) for a in argv]


def _versions(trainer, doc):
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for p in PACKAGES.get(trainer, ()):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    out["lossguard"] = (doc or {}).get("tool_version")
    return out


def _run_of(paths):
    """(out dir, argv) of the remembered run holding every path, the innermost one; (None, None) if none."""
    best = (None, None)
    for d, argv in _RUNS.items():
        if all(os.path.abspath(str(p)).startswith(d + os.sep) for p in paths) and len(d) > len(best[0] or ""):
            best = (d, argv)
    return best


def _portable(argv, out_dir):
    """A shell line of argv to run at the repository root: the run folder as $OUT, the repository's files
    relative, the home folder as ~."""
    home = os.path.expanduser("~")
    words = []
    for a in argv:
        a = str(a)
        if out_dir and (a == out_dir or a.startswith(out_dir + os.sep)):
            words.append('"$OUT"' + shlex.quote(a[len(out_dir):]) if a != out_dir else '"$OUT"')
            continue
        if a.startswith(ROOT + os.sep):
            a = os.path.relpath(a, ROOT)
        elif a.startswith(home + os.sep):
            words.append("~/" + shlex.quote(a[len(home) + 1:]))
            continue
        words.append(shlex.quote(a))
    return " ".join(words)


def _step_lines(text):
    """{step: [the lines of audit's text block of that step]}."""
    out, cur = {}, None
    for line in (text or "").splitlines():
        m = re.match(r"^step (\d+):", line)
        if m:
            cur = int(m.group(1))
            out[cur] = [line]
        elif cur is not None and line.startswith("  "):
            out[cur].append(line)
        else:
            cur = None
    return out


def _steps(doc, text):
    lines = _step_lines(text)
    steps = []
    for s in (doc or {}).get("steps", []):
        checks = [{"name": c.get("name"), "ok": c.get("ok"), "detail": c.get("detail")} for c in s.get("checks", [])]
        steps.append({"step": s.get("step"), "verdict": "fail" if any(c["ok"] is False for c in checks) else "pass",
                      "reduce": s.get("reduce"), "global_tokens": s.get("global_tokens"), "dtype": s.get("dtype"),
                      "checks": checks, "diagnosis": s.get("diagnosis"), "matches": s.get("matches", []),
                      "terms": [{k: t.get(k) for k in ("name", "declared", "coef", "relative_to_main", "diagnosis",
                                                        "matches")} for t in s.get("terms", [])],
                      "lines": lines.get(s.get("step"), [])})
    return steps


def _out_as_var(obj, out_dir):
    """obj (texts, checks, findings) with the run folder written as $OUT."""
    if not out_dir:
        return obj
    return json.loads(json.dumps(obj).replace(json.dumps(out_dir)[1:-1], "$OUT"))


def _append(trainer, row):
    d = os.environ[ENV]
    os.makedirs(d, exist_ok=True)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    row = {"trainer": trainer, "test": test, **row}
    with open(os.path.join(d, f"{trainer}.jsonl"), "a") as f:
        f.write(json.dumps(row, default=str, sort_keys=False) + "\n")


def record(trainer, key, config, audit_argv, code, doc, text, stderr=""):
    """One audited configuration: ``audit_argv`` the command the test ran (``lossguard audit PATH...``
    and options), ``code`` its exit status, ``doc`` its ``--json`` report (None when it wrote none),
    ``text`` its text report.  Does nothing unless LOSSGUARD_GALLERY_DIR is set."""
    if not enabled():
        return
    argv = [str(a) for a in audit_argv]
    paths = [a for a in argv[2:] if os.path.exists(a)]
    out_dir, run = _run_of(paths) if paths else (None, None)
    audit_line = _portable(argv, out_dir)
    run_line = _portable(run, out_dir) if run else None
    verdict = (doc or {}).get("verdict") or {0: "pass", 1: "fail", 2: "error", 3: "fault", 4: "unverified"}.get(
        code, "error")
    _append(trainer, {
        "kind": "audit", "key": key, "versions": _versions(trainer, doc), "config": config,
        "exit_code": code, "verdict": verdict, **_out_as_var({
            "steps": _steps(doc, text), "findings": (doc or {}).get("findings", []), "text": text,
            "stderr": stderr}, out_dir),
        "audit_command": argv, "run_command": run, "audit_line": audit_line, "run_line": run_line,
        "reproduce": f"OUT=$(mktemp -d) && {run_line} && {audit_line}" if run else audit_line,
    })


def record_failfast(trainer, key, config, run_argv, out_dir, result):
    """A run the adapter's fail-fast audit stopped: ``result`` the ``failfast-rank0.json`` the driver wrote
    (``exit_code``, ``text``, ``message`` of ``lossguard_capture.AuditFailed``, ``global_step``)."""
    if not enabled():
        return
    run = [str(a) for a in run_argv]
    out_dir = os.path.abspath(str(out_dir))
    run_line = _portable(run, out_dir)
    _append(trainer, {
        "kind": "failfast", "key": key, "versions": _versions(trainer, None), "config": config,
        "exit_code": result.get("exit_code"), "verdict": {0: "pass", 1: "fail"}.get(result.get("exit_code"), "error"),
        "global_step": result.get("global_step"),
        **_out_as_var({"text": result.get("text"), "message": result.get("message")}, out_dir),
        "run_command": run, "run_line": run_line, "reproduce": f"OUT=$(mktemp -d) && {run_line}",
    })


if __name__ == "__main__":
    sys.exit("tests/trainers/gallery.py is imported by the trainer tests; scripts/gallery.py runs them")
