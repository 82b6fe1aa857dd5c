#!/usr/bin/env python3
"""Regenerates docs/gallery.md from the real trainers' tests (``make gallery``).

Runs each trainer's test file (tests/trainers/test_{hf_trainer,trl_trainer,megatron,megatron_shapes,slime,
slime_history,relax,verl}.py) in its venv
(scripts/setup-trainers.sh), one after the other, with LOSSGUARD_GALLERY_DIR set: every ``lossguard audit``
those tests run is recorded as a row (tests/trainers/gallery.py).  Then renders docs/gallery.template.md
with the rows into docs/gallery.md: every table, version, fail-fast output and command of the page comes
from them; the prose is the template's.

    make gallery                                              # build, venvs, then this script
    scripts/gallery.py [--binary build/cli/lossguard] [--rows DIR] [--only hf,trl,megatron,megatron_shapes,verl]
    scripts/gallery.py --render-only --rows DIR               # render the rows recorded before

--rows DIR keeps the rows (DIR/<trainer>.jsonl) and each test file's output (DIR/<trainer>.log); by
default a new temporary folder.  --only reruns those trainers' tests, replacing only their rows in DIR.
Exit status: 0; 1 when a test file failed (the page is still written from what audit said, and the
failing assertions are in DIR/<trainer>.log); 2 when a placeholder has no rows (nothing is written).
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from fractions import Fraction

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TEMPLATE = os.path.join(ROOT, "docs", "gallery.template.md")
PAGE = os.path.join(ROOT, "docs", "gallery.md")

#: trainer -> (its venv's name, as scripts/setup-trainers.sh makes it; the test file)
SUITES = {
    "hf": ("hf", "tests/trainers/test_hf_trainer.py"),
    "trl": ("hf", "tests/trainers/test_trl_trainer.py"),
    "megatron": ("megatron", "tests/trainers/test_megatron.py"),
    "megatron_shapes": ("megatron", "tests/trainers/test_megatron_shapes.py"),
    "slime": ("megatron", "tests/trainers/test_slime.py"),
    "slime_history": ("megatron", "tests/trainers/test_slime_history.py"),
    "relax": ("megatron", "tests/trainers/test_relax.py"),
    "verl": ("verl", "tests/trainers/test_verl.py"),
}


#: trainer -> the venvs of its supported releases, oldest first (scripts/setup-trainers.sh `all`); the pinned
#: venv of SUITES among them renders the page's main tables, every one a column of {{releases:T}}.
RELEASES = {
    "hf": ("hf-5.19.0", "hf-5.20.2", "hf-5.21.1", "hf-5.22.2", "hf-5.23.0", "hf", "hf-5.25.0"),
    "trl": ("trl-1.13.0", "trl-1.14.2", "hf"),
    "megatron": ("megatron-0.15.3", "megatron-0.16.0", "megatron"),
    "megatron_shapes": ("megatron-0.15.3", "megatron-0.16.0", "megatron"),
    "slime": ("megatron-0.15.3", "megatron-0.16.0", "megatron"),
    "slime_history": ("megatron",),
    "relax": ("megatron-0.15.3", "megatron-0.16.0", "megatron"),
    "verl": ("verl-0.8.0", "verl-0.9.0", "verl"),
}
#: the package whose release a trainer's release columns name
PACKAGE = {"hf": "transformers", "trl": "trl", "verl": "verl", "megatron": "megatron-core",
           "megatron_shapes": "megatron-core", "slime": "megatron-core", "slime_history": "megatron-core",
           "relax": "megatron-core"}
#: trainers whose rows need what a machine may lack (slime's own source, LOSSGUARD_SLIME_SRC): without rows their
#: placeholders say how to provide it instead of stopping the page
OPTIONAL = {"slime_history": "not run here: slime's source was not provided (SLIME_GIT=... scripts/slime-src.sh DEST, "
                             "then LOSSGUARD_SLIME_SRC=DEST make gallery)"}


def release_dir(rows_dir, venv):
    """Where the rows of a release venv other than the pinned one go: DIR/releases/<venv>/."""
    return os.path.join(rows_dir, "releases", venv)


def venv_dir(name):
    """As scripts/setup-trainers.sh: $LOSSGUARD_<NAME>_VENV, else ~/.cache/lossguard/venv-<name>."""
    return os.environ.get(f"LOSSGUARD_{name.upper()}_VENV") or os.path.expanduser(f"~/.cache/lossguard/venv-{name}")


def tilde(path):
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if path.startswith(home + os.sep) else path


def test_command(trainer, venv=None):
    pinned, test = SUITES[trainer]
    return f"{tilde(venv_dir(venv or pinned))}/bin/python -m pytest -q {test}"


# ---- running the tests ------------------------------------------------------------------------------
def run_tests(trainers, rows_dir, binary, all_releases=True, installed_only=False):
    """Each trainer's test file in each release venv (only the pinned one without ``all_releases``; with
    ``installed_only``, the release venvs this machine has), in order; returns the (trainer, venv) runs that
    failed."""
    failed = []
    for t in trainers:
        pinned = SUITES[t][0]
        venvs = RELEASES[t] if all_releases else (pinned,)
        if installed_only:
            skipped = [v for v in venvs if v != pinned and not os.access(os.path.join(venv_dir(v), "bin", "python"),
                                                                         os.X_OK)]
            if skipped:
                print(f"gallery: {t}: release venvs not installed here, not run: {', '.join(skipped)}", flush=True)
            venvs = tuple(v for v in venvs if v not in skipped)
        for venv in venvs:
            if not run_one(t, venv, rows_dir if venv == pinned else release_dir(rows_dir, venv), binary):
                failed.append(f"{t} on venv-{venv}")
    return failed


def run_one(t, venv, out_dir, binary):
    """The test file of trainer ``t`` in ``venv``, its rows and log in ``out_dir``; whether it passed."""
    test = SUITES[t][1]
    python = os.path.join(venv_dir(venv), "bin", "python")
    if not os.access(python, os.X_OK):
        sys.exit(f"gallery: {python} not found: run scripts/setup-trainers.sh all")
    os.makedirs(out_dir, exist_ok=True)
    for f in (f"{t}.jsonl", f"{t}.log"):
        if os.path.exists(os.path.join(out_dir, f)):
            os.remove(os.path.join(out_dir, f))
    env = dict(os.environ, LOSSGUARD_GALLERY_DIR=out_dir, LOSSGUARD_BIN=binary, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    log = os.path.join(out_dir, f"{t}.log")
    print(f"gallery: {t}: {test_command(t, venv)} (output: {log})", flush=True)
    start = time.time()
    with open(log, "w") as out:
        r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT, env=env,
                           stdout=out, stderr=subprocess.STDOUT)
    with open(log) as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    rows = os.path.join(out_dir, f"{t}.jsonl")
    n = sum(1 for _ in open(rows)) if os.path.exists(rows) else 0
    print(f"gallery: {t} on venv-{venv}: {lines[-1] if lines else '(no output)'}; {n} rows; "
          f"{time.time() - start:.0f} s", flush=True)
    if r.returncode != 0:
        print("\n".join(lines[-40:]), file=sys.stderr)
    return r.returncode == 0


def load_rows(rows_dir):
    """{trainer: {(kind, key): row}} (a key recorded twice: the last row)."""
    rows = {}
    for t in SUITES:
        path = os.path.join(rows_dir, f"{t}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    rows.setdefault(t, {})[(r["kind"], r["key"])] = r
    return rows


def load_release_rows(rows_dir):
    """{trainer: [(venv, {(kind, key): row}), ...]} in RELEASES order: the pinned venv's rows are the main
    rows (DIR/<trainer>.jsonl), the others' DIR/releases/<venv>/<trainer>.jsonl; a venv without rows is left
    out."""
    main = load_rows(rows_dir)
    out = {}
    for t in SUITES:
        for venv in RELEASES[t]:
            got = main.get(t) if venv == SUITES[t][0] else load_rows(release_dir(rows_dir, venv)).get(t)
            if got:
                out.setdefault(t, []).append((venv, got))
    return out


# ---- one cell from audit's answer --------------------------------------------------------------------
RANGE = re.compile(r"^(?P<label>[^:]+?): weights range (?P<lo>\S+) to (?P<hi>\S+) of the truth on (?P<a>\d+) of "
                   r"(?P<b>\d+) tokens")
UNIFORM = re.compile(r"^uniform scale (?P<x>×[^ :]+)(?: = (?P<named>[^:]+))?:")
RANK_PREFIX = re.compile(r"\brank (\d+) \([^()]*\)")


def check(step, name):
    return next((c for c in step["checks"] if c["name"] == name), None)


def no_paths(text):
    """audit's "rank 0 (DP 0 CP 0 TP 0 PP 0, FILE)" as "rank 0"."""
    return RANK_PREFIX.sub(r"rank \1", text)


def fraction(x):
    """" = p/q" when x is a small fraction (within float32 rounding), else ""."""
    if x is None or not math.isfinite(x) or x <= 0:
        return ""
    f = Fraction(x).limit_denominator(256)
    if f.denominator == 1 or abs(float(f) - x) > 1e-6 * x:
        return ""
    return f" = {f.numerator}/{f.denominator}"


def weights_summary(step):
    w = check(step, "weights") or {}
    d = step.get("diagnosis") or {}
    detail = w.get("detail") or ""
    if d.get("kind") == "exact":
        return "exact"
    m = RANGE.match(detail)
    if m:
        on = f" on {m['a']} of {m['b']} tokens" if m["a"] != m["b"] else ""
        return f"{m['label']}, {m['lo']}–{m['hi']}{on}"
    m = UNIFORM.match(detail)
    if m:
        return f"uniform scale {m['x']}" + (f" = {m['named']}" if m["named"] else fraction(d.get("scale")))
    if detail.startswith("not finite"):
        return "NaN weights" if "nan" in detail.lower() else "non-finite weights"
    return no_paths(detail.split("; ")[0]) if detail else (d.get("kind") or "no diagnosis")


def counts_summary(detail):
    """counts FAIL's detail, short: "`num_tokens_reduced` 11 and 21, N = 32"."""
    parts = [no_paths(p) for p in detail.split("; ")]
    got = [re.search(r"num_tokens_reduced (\S+) but the step has N = (\d+)", p) for p in parts]
    if got and all(got):
        vals = list(dict.fromkeys(g[1] for g in got))
        ns = list(dict.fromkeys(g[2] for g in got))
        v = " and ".join(vals) if len(vals) <= 2 else ", ".join(vals)
        return f"`num_tokens_reduced` {v}, N = {' / '.join(ns)}"
    return short(detail)


def short(detail, n=110):
    text = no_paths(detail.split("; ")[0])
    return text if len(text) <= n else text[:n - 1].rstrip() + "…"


def step_summary(row, step):
    """The weights' diagnosis; the counts check's failure, short; the other failed checks by name; findings."""
    parts = [weights_summary(step)]
    failed = [c for c in step["checks"] if c["ok"] is False and c["name"] != "weights"]
    for c in failed:
        if c["name"] == "counts":
            parts.append(f"counts FAIL: {counts_summary(c['detail'] or '')}")
    others = [c["name"] for c in failed if c["name"] != "counts"]
    if others:
        parts.append(f"{', '.join(others)} FAIL")
    for f in row.get("findings", []):
        if f.get("step") == step["step"]:
            parts.append(f"finding `{f['kind']}`")
    return "; ".join(parts)


def diagnosis(row, note=""):
    """Step 0's summary, or every step's, one per line, where they differ; the note after the first."""
    sums = [step_summary(row, s) for s in row["steps"]]
    if not sums:
        lines = ["no step audited" + (f": {short(row.get('stderr') or '')}" if row.get("stderr") else "")]
    elif len(set(sums)) == 1:
        lines = sums[:1]
    else:
        lines = [f"step {s['step']}: {x}" for s, x in zip(row["steps"], sums)]
    if note:
        lines[0] += f" {note}"
    return "<br>".join(lines)


def audit_cell(row, strict=None):
    code, verdict, steps = row["exit_code"], row["verdict"], row["steps"]
    if code == 0:
        return "pass (0)"
    cell = f"**{'FAIL' if verdict == 'fail' else verdict} ({code})**"
    failing = [s for s in steps if s["verdict"] == "fail"]
    if verdict == "fail" and failing and len(failing) < len(steps):
        cell += " on step " + ", ".join(str(s["step"]) for s in failing)
    if verdict == "fail" and failing and all((check(s, "weights") or {}).get("ok") is not False for s in steps):
        names = [c["name"] for s in failing for c in s["checks"] if c["ok"] is False]
        cell += ": " + ", ".join(dict.fromkeys(names))
    for s in steps:
        if s["verdict"] == "pass" and (s.get("diagnosis") or {}).get("kind") == "uniform-scale" and strict:
            st = next((x for x in strict["steps"] if x["step"] == s["step"]), None)
            if st is not None and st["verdict"] == "fail":
                cell += f"; step {s['step']} passes without `--strict-scale`"
    return cell


def matches(step):
    return ", ".join(step["matches"]) if step and step["matches"] else "no preset"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def ordered(rows, order):
    """rows in the order of their keys in ``order``; any other after them, as recorded."""
    pos = {k: i for i, k in enumerate(order)}
    return sorted(rows, key=lambda r: pos.get(r["key"], len(pos)))


def note(notes, row, name):
    return notes.get(row["key"]) or notes.get(name) or ""


# ---- the tables -------------------------------------------------------------------------------------
HF_ORDER = ["dp1-ga1-kw", "dp1-ga2-kw", "dp1-ga4-kw", "dp1-ga2-kw-noavg", "dp2-ga1-kw", "dp2-ga2-kw", "dp2-ga4-kw",
            "dp2-ga1-kw-noavg", "dp2-ga2-kw-noavg", "dp1-ga1-nokw", "dp1-ga2-nokw", "dp1-ga4-nokw", "dp2-ga1-nokw",
            "dp2-ga2-nokw", "dp2-ga4-nokw", "dp1-ga2-nokw-empty", "dp1-ga2-kw-empty", "dp1-ga2-kw-dropnum"]
HF_NOTES = {
    "dp1-ga2-kw-noavg": "(at DP 1 the rank's count is N)",
    "dp1-ga1-nokw": "(one micro-batch's mean is the per-token mean)",
    "dp1-ga2-nokw-empty": "(the empty micro-batch's loss is NaN, its gradient 0)",
    "dp1-ga2-kw-empty": "(loss 0, no NaN)",
}


def hf_table(rows, used):
    audit = {r["key"]: r for (kind, _), r in rows.items() if kind == "audit"}
    body = []
    for r in ordered([r for k, r in audit.items() if not k.endswith("-strict-scale")], HF_ORDER):
        c = r["config"]
        strict = audit.get(r["key"] + "-strict-scale")
        used.update({("audit", r["key"]), ("audit", r["key"] + "-strict-scale")})
        kw = c["model_accepts_loss_kwargs"]
        model = "kwargs" if kw else "no kwargs"
        if c["first_microbatch_empty"]:
            model += ", step 0's first micro-batch fully masked"
        if c["compute_loss_drops_num_items"]:
            model += ", a `compute_loss` override that drops `num_items_in_batch`"
        avg = "–" if (not kw and c["dp"] == 1) else ("on" if c["average_tokens_across_devices"] else "off")
        body.append([c["dp"], c["ga"], model, avg, audit_cell(r, strict), diagnosis(r, note(HF_NOTES, r, c["config"])),
                     matches(r["steps"][0] if r["steps"] else None)])
    return table(["DP", "GA", "model", "avg", "audit (exit)", "diagnosis (steps 0, 1)", "reproduced by"], body)


TRL_ORDER = [f"dp{w}-{c}" for c in ("grpo", "grpo-trunc", "gspo", "sapo", "bnpo", "dr_grpo", "dapo", "dapo-beta",
                                    "dapo-bf16", "dapo-spg4", "dapo-spg1", "cispo", "vespo", "luspo", "luspo-token",
                                    "dapo-entropy", "bnpo-entropy", "sft") for w in (1, 2)]
TRL_LABEL_NOTES = {
    "grpo-trunc": "(completions with `m_i = 0`, still counted in `B`)",
    "gspo": "(GSPO: `per_token_loss` [B, 1])",
    "dr_grpo": "(so that `B ≠ M²`)",
    "dapo": "(TRL's default `loss_type`)",
    "dapo-beta": "(KL inside `per_token_loss`)",
    "dapo-entropy": "(the entropy bonus: term `entropy`)",
    "bnpo-entropy": "(the entropy bonus: term `entropy`)",
    "dapo-bf16": "(TRL's default mixed precision)",
    "dapo-spg4": "(`S = {steps_per_generation}`: one generation batch = {spg_over_ga} optimizer steps)",
    "dapo-spg1": "(`S = {steps_per_generation}`: one generation batch per micro-batch)",
    "luspo-token": "(token level)",
    "sft": "(prompt/completion, completion-only loss)",
}
TRL_NOTES = {
    "dr_grpo": "(`m_t/(B·L_norm)`, L_norm = `max_completion_length` = {max_completion_length})",
    "dapo-spg4": "(each step's share `2·N_n/(N_0+N_1)` of the generation batch's count)",
    "dp2-dapo-spg1": "(the micro-batch's count all-reduced over DP)",
}


def _value(v):
    return json.dumps(v) if isinstance(v, str) else repr(v)


def trl_table(rows, used):
    body = []
    for r in ordered([r for (kind, _), r in rows.items() if kind == "audit"], TRL_ORDER):
        used.add(("audit", r["key"]))
        c = r["config"]
        spg, ga = c.get("steps_per_generation") or 0, c.get("gradient_accumulation_steps") or 1
        fields = dict(c, spg_over_ga=spg // ga)
        if c["trainer"] == "SFTTrainer":
            label = "`SFTTrainer`"
        else:
            ov = dict(c["overrides"])
            label = f"`{ov.pop('loss_type', c.get('loss_type'))}`" + "".join(f", `{k}={_value(v)}`"
                                                                           for k, v in ov.items())
        extra = TRL_LABEL_NOTES.get(c["config"], "").format(**fields)
        s0 = r["steps"][0] if r["steps"] else {}
        diag, match = with_terms(s0, diagnosis(r, note(TRL_NOTES, r, c["config"]).format(**fields)), matches(s0))
        body.append([c["dp"], label + (f" {extra}" if extra else ""), s0.get("reduce", "?"), audit_cell(r), diag,
                     match])
    return table(["DP", "config", "`reduce`", "audit (exit)", "diagnosis (steps 0, 1)", "matches / reproduced by"],
                 body)


VERL_ORDER = [f"{c}-pg" for c in (
    "token-mean", "token-mean-dense", "token-mean-dynbsz", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
    "seq-mean-token-sum-norm", "seq-mean-token-sum-norm-dynbsz", "seq-mean-token-sum-norm-lsf",
    "seq-mean-token-sum-norm-dense", "sapo-token-mean", "sapo-seq-mean-token-mean", "geo_mean", "geo_mean-m3",
    "geo_mean-dynbsz", "token-mean-kl", "seq-mean-token-mean-kl", "token-mean-kl-entropy",
    "seq-mean-token-mean-kl-entropy", "token-mean-kl-bug")]
VERL_LABEL_NOTES = {
    "geo_mean": "(`{mode}` configured, unused)",
    "seq-mean-token-sum-norm-lsf": "(the longest response)",
    "geo_mean-dynbsz": "(micro-batches of unequal sizes)",
}
VERL_NOTES = {
    "token-sum": "(= N)",
    "seq-mean-token-mean": "(= B'/B: all B samples divide, the fully masked ones too)",
    "sapo-seq-mean-token-mean": "(= B'/B)",
    "seq-mean-token-mean-kl": "(= B'/B)",
    "seq-mean-token-mean-kl-entropy": "(= B'/B)",
    "seq-mean-token-sum-norm": "(= L_norm/L_k, `L_k` each micro-batch's longest response)",
    "seq-mean-token-sum-norm-dynbsz": "(= L_norm/L_k)",
    "seq-mean-token-sum-norm-dense": "(= L_norm/width)",
    "sapo-token-mean": "(sapo forces seq-mean-token-mean)",
}
VERL_SAMPLE_MEAN_NOTES = {"geo_mean": "(no `/M`)", "geo_mean-m3": "(no `/M`)", "geo_mean-dynbsz": "(`1/n_k`)"}


def verl_label(c, default_micro):
    s = f"`{c['mode']}`" if c["loss"] == "vanilla" else f"`{c['loss']}`, `loss_agg_mode={c['mode']}`"
    if c["layout"] == "dense":
        s += f", v0 (responses padded to {c['response_pad']})"
    if c["dynbsz"]:
        s += ", `use_dynamic_bsz`"
    if c["lsf"]:
        s += f", `loss_scale_factor = {c['lsf']}`"
    if c["micro"] != default_micro and not c["dynbsz"]:
        s += f", {c['microbatches_per_rank']} micro-batches of {c['micro']} per rank"
    extra = VERL_LABEL_NOTES.get(c["config"], "").format(**c)
    s += f" {extra}" if extra else ""
    if c["kl"]:
        s += f", `use_kl_loss` (`{c.get('kl_loss_type')}`, coef {c['kl_loss_coef']})"
    if c.get("entropy"):
        s += f", `entropy_coeff = {c['entropy_coeff']}`"
    if c.get("bug"):
        s += f", planted bug `{c['bug']}`"
    return s


def with_terms(step, diag, match):
    """The diagnosis and matches cells with a line per declared term (relative to the main term)."""
    for t in step.get("terms") or []:
        diag += f"<br>term `{t['name']}` (coef {t['coef']}): {term_summary(step, t)}"
        if t.get("matches") and (t.get("diagnosis") or {}).get("kind") != "exact":
            match += f"<br>term `{t['name']}`: {', '.join(t['matches'])}"
    return diag, match


def term_summary(step, term):
    """A declared term's weights, relative to the main term, as weights_summary says the main term's."""
    w = check(step, f"{term['name']}.weights") or {}
    return weights_summary({"checks": [{"name": "weights", "detail": w.get("detail")}],
                            "diagnosis": term.get("diagnosis")})


def verl_table(rows, used):
    audit = {r["key"]: r for (kind, _), r in rows.items() if kind == "audit"}
    main = [r for k, r in audit.items() if k.endswith("-pg")]
    micros = [r["config"]["micro"] for r in main]
    default_micro = max(set(micros), key=micros.count) if micros else None
    body = []
    for r in ordered(main, VERL_ORDER):
        c = r["config"]
        name = c["config"]
        kl = audit.get(f"{name}-kl")
        sm = audit.get(f"{name}-pg-as-sample-mean")
        used.update({("audit", r["key"]), ("audit", f"{name}-kl"), ("audit", f"{name}-pg-as-sample-mean")})
        s0 = r["steps"][0] if r["steps"] else {}
        cells = [audit_cell(r), diagnosis(r), matches(s0)]
        if kl:                 # rows of captures written before the terms were one capture
            k0 = kl["steps"][0] if kl["steps"] else {}
            cells = [f"{cells[0]} / {audit_cell(kl)}", f"{cells[1]} / {diagnosis(kl)}",
                     cells[2] if matches(k0) == cells[2] else f"{cells[2]} / {matches(k0)}"]
        extra = VERL_NOTES.get(name, "")
        cells[1] += f" {extra}" if extra else ""
        cells[1], cells[2] = with_terms(s0, cells[1], cells[2])     # the declared terms (kl, entropy)
        as_sm = ""
        if sm:
            m0 = sm["steps"][0] if sm["steps"] else {}
            as_sm = diagnosis(sm, VERL_SAMPLE_MEAN_NOTES.get(name, ""))
            if sm["exit_code"] != 0:
                as_sm = f"**FAIL**: {as_sm}"
            elif m0 and (m0.get("diagnosis") or {}).get("kind") == "exact":
                as_sm += f": {matches(m0)}"
        body.append([verl_label(c, default_micro), s0.get("reduce", "?"), *cells, as_sm])
    return table(["config", "`reduce`", "audit (exit)", "diagnosis", "matches / reproduced by",
                  "as `--reduce sample-mean`"], body)


MEGATRON_PATHS = {"a": "(a) per-token, 3-tuple", "b": "(b) no per-token, 3-tuple",
                  "c": "(c) no per-token, 2-tuple ÷max(n,1)", "cnan": "(c') no per-token, 2-tuple ÷n",
                  "d": "(d) per-token, 2-tuple ÷max(n,1)"}
MEGATRON_TOPOS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)]


def megatron_table(rows, used):
    main = [r for (kind, _), r in rows.items() if kind == "audit"]
    paths = list(MEGATRON_PATHS)

    def key(r):
        c = r["config"]
        t = (c["dp"], c["cp"], c["tp"])
        return (paths.index(c["path"]) if c["path"] in paths else len(paths),
                MEGATRON_TOPOS.index(t) if t in MEGATRON_TOPOS else len(MEGATRON_TOPOS))
    body = []
    for r in sorted(main, key=key):
        used.add(("audit", r["key"]))
        c = r["config"]
        steps = {s["step"]: s for s in r["steps"]}
        cp = f"{c['cp']}" + (f" (TP {c['tp']})" if c["tp"] > 1 else "")
        weights = [step_summary(r, steps[n]) if n in steps else "not audited" for n in (0, 1)]
        body.append([MEGATRON_PATHS.get(c["path"], f"({c['path']})"), c["dp"], cp, audit_cell(r), *weights,
                     matches(steps.get(0))])
    return table(["path", "DP", "CP", "audit (exit)", "step 0 weights", "step 1 weights", "step 0 reproduced by"],
                 body)


#: the shapes test's scenarios, in the page's order, with what each one is
MEGATRON_SHAPES = {
    "pt": "per-token, loss over logits",
    "pt-entropy": "per-token, minus 0.05 x entropy (a second term)",
    "global": "no per-token loss, a global token mean (N over DP)",
    "thd": "THD, per-token, the packed stream hooked",
    "thd-owned": "THD, the owned tokens hooked (slime's `pg_loss`)",
    "thd-dyncp": "THD, micro-batch 1 at CP size 1 (Relax's dynamic CP)",
    "thd-dummy": "THD, micro-batch 1 a dummy (Relax's `__is_dummy__`)",
    "first-stage-src": "planted: decision broadcast from the first stage",
    "sample-count": "planted: decision from the 3-tuple's count",
    "tp-as-dp": "planted: N over the whole world (TP counted as DP)",
    "thd-off-by-one": "planted: THD mask one position late",
}


def megatron_shapes_table(rows, used):
    main = [r for (kind, _), r in rows.items() if kind == "audit"]
    names = list(MEGATRON_SHAPES)

    def key(r):
        c = r["config"]
        return (names.index(c["scenario"]) if c["scenario"] in names else len(names), c["pp"], c.get("vpp", 1),
                c["tp"], c["cp"])
    body = []
    for r in sorted(main, key=key):
        used.add(("audit", r["key"]))
        c = r["config"]
        steps = {s["step"]: s for s in r["steps"]}
        layout = " × ".join(f"{n} {c[n.lower()]}" for n in ("PP", "TP", "CP", "DP") if c[n.lower()] > 1)
        if c.get("vpp", 1) > 1:
            layout += f" (VPP {c['vpp']}: interleaved)"
        cells = [step_summary(r, steps[n]) if n in steps else "not audited" for n in (0, 1)]
        body.append([f"`{c['scenario']}`: {MEGATRON_SHAPES.get(c['scenario'], '')}", layout, audit_cell(r), *cells])
    return table(["scenario", "layout", "audit (exit)", "step 0 (N > 0)", "step 1 (N = 0)"], body)


SLIME = {
    "pt": "--calculate-per-token-loss, entropy bonus 0.05, k1 KL 0.1",
    "sm": "per-rollout sample mean (rollout_mask_sums), entropy bonus",
    "sm-reducer": "as sm, with --custom-pg-loss-reducer-function-path (no rollout_mask_sums)",
    "sft": "sft_loss, per-token",
    "pt-sample-indices": "as pt, the samples named by the rollout's sample_indices alone (no partition; DP ranks "
                         "hold a strided split)",
}


RELAX = {
    "pt": "--calculate-per-token-loss, entropy bonus 0.05, k1 KL 0.1",
    "sm": "sample mean (sample_index_mask_sums), `__loss_scale__`",
    "dyncp": "a CP size per micro-batch (max_tokens_per_gpu 8: 1 or 2)",
    "dummy": "a dummy micro-batch per step (`__is_dummy__`)",
    "sft": "`--loss-type sft` (Relax's name; slime's is sft_loss), per-token",
    "rpp": "as pt under `reinforce_plus_plus` (its mask-safe reducers: torch.where(mask, x, 0) then reduce)",
    "bug-clamp": "planted bug 1: at CP 1 an empty response counted as 1",
    "bug-noskip": "planted bug 2: the zero-token step steps",
    "bug-src": "planted bug 3: the decision broadcast from the pipeline's first stage",
}


def rollout_table(scenarios):
    def render(rows, used):
        main = [r for (kind, _), r in rows.items() if kind == "audit"]
        names = list(scenarios)
        body = []
        for r in sorted(main, key=lambda r: (names.index(r["config"]["scenario"]), r["config"]["pp"])):
            used.add(("audit", r["key"]))
            c = r["config"]
            steps = {s["step"]: s for s in r["steps"]}
            layout = " × ".join(f"{n} {c[n.lower()]}" for n in ("PP", "CP", "DP") if c[n.lower()] > 1)
            cells = [step_summary(r, steps[n]) if n in steps else "not audited" for n in (0, 1, 2)]
            body.append([f"`{c['scenario']}`: {scenarios[c['scenario']]}", layout, audit_cell(r), *cells])
        return table(["scenario", "layout", "audit (exit)", "step 0", "step 1 (a fully masked sample)",
                      "step 2 (N = 0)"], body)
    return render


def history_table(rows, used):
    """slime's own fixes: per pair, the parent's and the fix's step-0 audit."""
    body = []
    for r in sorted((r for (kind, _), r in rows.items() if kind == "audit"),
                    key=lambda r: (r["config"]["pair"], r["config"]["role"] != "parent")):
        used.add(("audit", r["key"]))
        c = r["config"]
        step = {s["step"]: s for s in r["steps"]}.get(c["step"])
        layout = " × ".join(f"{n} {c[n.lower()]}" for n in ("PP", "CP", "DP") if c.get(n.lower(), 1) > 1) or "1 rank"
        body.append([f"{c['pair']}: {c['shows'].split(':')[0]}" if c["role"] == "parent" else "",
                     f"{c['role']} `{c['commit'][:7]}`", layout, audit_cell(r),
                     step_summary(r, step) if step else "not audited"])
    return table(["fix", "slime at", "layout", "audit (exit)", "step 0"], body)


TABLES = {"hf": hf_table, "trl": trl_table, "verl": verl_table, "megatron": megatron_table,
          "megatron_shapes": megatron_shapes_table, "slime": rollout_table(SLIME), "relax": rollout_table(RELAX),
          "slime_history": history_table}


def failfast(rows, used):
    ff = [r for (kind, _), r in rows.items() if kind == "failfast"]
    if len(ff) != 1:
        raise KeyError(f"{len(ff)} fail-fast rows")
    used.add(("failfast", ff[0]["key"]))
    msg = re.sub(r"\n\(command: [^\n]*\)\s*$", "", ff[0]["message"].rstrip())
    return f"```\nlossguard_capture.AuditFailed: {msg}\n```"


def commands(trainer, rows, used):
    """A folded block: the test file, then per driver run the run and each row's audit."""
    runs = {}
    for (kind, key), r in rows.items():
        runs.setdefault(r.get("run_line") or "", []).append(r)
    lines = [f"{test_command(trainer)}    # the test file: every run, check and audit below", "",
             "export OMP_NUM_THREADS=1    # as the tests run the drivers"]
    for run, rs in runs.items():
        if not run:                     # rows whose run the test did not name: their audit only
            lines += [""] + [f"{r['audit_line']}    # {r['key']}" for r in rs if r.get("audit_line")]
            continue
        lines += ["", "OUT=$(mktemp -d)"]
        for r in rs:
            if r["kind"] == "failfast":
                lines.append(f"{run}    # {r['key']}: fail-fast, AuditFailed at step {r.get('global_step')}")
        if any(r["kind"] == "audit" for r in rs):
            lines.append(run)
        lines += [f"{r['audit_line']}    # {r['key']}" for r in rs if r["kind"] == "audit" and r.get("audit_line")]
    return ("<details><summary>Commands (at the repository root)</summary>\n\n```sh\n" + "\n".join(lines) +
            "\n```\n\n</details>")


def version(rows, trainer, package):
    vs = [r["versions"].get(package) for r in rows.values() if r.get("versions")]
    vs = list(dict.fromkeys(v.split("+")[0] for v in vs if v))
    if not vs:
        raise KeyError(f"no {package} version")
    return " / ".join(vs)


def release_cell(row):
    """What a configuration does on one release, short: the verdict, step 0's weights (and the later steps'
    where they differ) and the presets that reproduce them."""
    if row is None:
        return "–"
    verdict = "pass" if row["exit_code"] == 0 else f"**{'FAIL' if row['verdict'] == 'fail' else row['verdict']}**"
    sums = list(dict.fromkeys(weights_summary(s) for s in row["steps"])) or ["no step audited"]
    presets = (row["steps"][0]["matches"] if row["steps"] else None) or []
    named = f"{presets[0]}" + (f" +{len(presets) - 1}" if len(presets) > 1 else "") if presets else "no preset"
    return f"{verdict}: {'; '.join(sums)} ({named})"


def releases_table(trainer, per_release):
    """Configurations (audit rows) x releases: each cell what audit said on that release (the verdict, the
    weights, the first reproducing preset and how many more; "same" where it equals the release on its left);
    under the table a line per configuration whose cells differ between releases, and a line per release that
    ran fewer of them."""
    names = [release_name(trainer, got) for _, got in per_release]
    keys = list(dict.fromkeys(k for _, got in per_release for (kind, k) in got if kind == "audit"))
    body, changed = [], []
    for k in keys:
        cells = [release_cell(got.get(("audit", k))) for _, got in per_release]
        # a cell equal to the one on its left is "same": a change between releases stands out
        shown = [c if i == 0 or c != cells[i - 1] or c == "–" else "same" for i, c in enumerate(cells)]
        body.append([f"`{k}`"] + shown)
        ran = [(n, c) for n, c in zip(names, cells) if c != "–"]
        if len({c for _, c in ran}) > 1:
            changed.append(f"- `{k}`: " + "; ".join(f"{n}: {c}" for n, c in ran))
    text = table(["configuration"] + names, body)
    missing = []
    for i, n in enumerate(names):
        absent = sum(1 for r in body if r[i + 1] == "–")
        if absent:
            missing.append(f"- {n} does not run {absent} of them")
    ran = {venv for venv, _ in per_release}
    not_run = [v.split("-", 1)[-1] if "-" in v else v for v in RELEASES[trainer] if v not in ran]
    notes = (["", "Where a release changes what a configuration does:", ""] + changed) if changed else \
        ["", f"No release changes what a configuration does: each of these {len(keys)} configurations gets the same "
             f"verdict, weights and presets on every release of {', '.join(n.split(' ')[-1] for n in names)} "
             "that runs it."]
    if missing:
        notes += ["", "Configurations a release does not have (–):", ""] + missing
    if not_run:
        notes += ["", f"Not run for this page: {SUITES[trainer][1]} on {PACKAGE[trainer]} {', '.join(not_run)} (no "
                      "venv where the page was made; `make gallery` after `scripts/setup-trainers.sh all` runs "
                      "every supported release)."]
    return text + "\n" + "\n".join(notes)


def release_name(trainer, got):
    """The release a venv's rows ran on: PACKAGE's version as they recorded it."""
    return f"{PACKAGE[trainer]} {version(got, trainer, PACKAGE[trainer])}"


def render(rows, template, release_rows=None):
    used, missing = {t: set() for t in SUITES}, []
    release_rows = release_rows or {}

    def sub(m):
        what, trainer, arg = m["what"], m["trainer"], m["arg"]
        if trainer in OPTIONAL and trainer in SUITES and not rows.get(trainer):
            return f"*({OPTIONAL[trainer]})*" if what == "table" else ""
        if trainer not in SUITES or not rows.get(trainer):
            missing.append(f"{m[0]}: no rows of {trainer}")
            return m[0]
        try:
            if what == "table":
                return TABLES[trainer](rows[trainer], used[trainer])
            if what == "failfast":
                return failfast(rows[trainer], used[trainer])
            if what == "commands":
                return commands(trainer, rows[trainer], used[trainer])
            if what == "version" and arg:
                return version(rows[trainer], trainer, arg)
            if what == "releases":
                return releases_table(trainer, release_rows.get(trainer) or [(SUITES[trainer][0], rows[trainer])])
        except KeyError as e:
            missing.append(f"{m[0]}: {e}")
            return m[0]
        missing.append(f"{m[0]}: unknown placeholder")
        return m[0]

    text = re.sub(r"\A<!--.*?-->\n", "", template, flags=re.S)
    text = re.sub(r"\{\{(?P<what>\w+):(?P<trainer>\w+)(?::(?P<arg>[\w.-]+))?\}\}", sub, text)
    unused = [f"{t}: {kind} {key}" for t in rows for (kind, key) in rows[t] if (kind, key) not in used[t]]
    head = ("<!-- Generated by `make gallery` (scripts/gallery.py) from docs/gallery.template.md and the rows the "
            "tests in tests/trainers recorded (tests/trainers/gallery.py): edit the template, not this file. -->\n")
    return head + text, missing, unused


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary",
                    default=os.environ.get("LOSSGUARD_BIN", os.path.join(ROOT, "build", "cli", "lossguard")))
    ap.add_argument("--rows", default=None, help="the rows' folder (default: a new temporary one)")
    ap.add_argument("--only", default=",".join(SUITES), help="the trainers whose tests run (comma-separated)")
    ap.add_argument("--render-only", action="store_true", help="render the rows in --rows; run nothing")
    ap.add_argument("--pinned-only", action="store_true",
                    help="run each trainer's pinned venv only, not every supported release (faster)")
    ap.add_argument("--installed-releases", action="store_true",
                    help="run the release venvs this machine has, saying which supported ones it lacks")
    ap.add_argument("--template", default=TEMPLATE)
    ap.add_argument("--out", default=PAGE)
    a = ap.parse_args(argv)
    trainers = [t for t in a.only.split(",") if t]
    if any(t not in SUITES for t in trainers):
        ap.error(f"--only: trainers are {', '.join(SUITES)}")
    if a.render_only and not a.rows:
        ap.error("--render-only needs --rows")
    rows_dir = os.path.abspath(a.rows or tempfile.mkdtemp(prefix="lossguard-gallery-"))
    os.makedirs(rows_dir, exist_ok=True)
    failed = []
    start = time.time()
    if not a.render_only:
        binary = os.path.abspath(a.binary)
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            sys.exit(f"gallery: {a.binary} is not an executable lossguard binary (make build-tool)")
        print(f"gallery: rows in {rows_dir}; lossguard {binary}", flush=True)
        failed = run_tests(trainers, rows_dir, binary, all_releases=not a.pinned_only,
                           installed_only=a.installed_releases)
    with open(a.template) as f:
        template = f.read()
    page, missing, unused = render(load_rows(rows_dir), template, load_release_rows(rows_dir))
    for u in unused:
        print(f"gallery: warning: a row no table shows: {u}", file=sys.stderr)
    if missing:
        for m in missing:
            print(f"gallery: {m}", file=sys.stderr)
        print(f"gallery: {a.out} not written (rows in {rows_dir})", file=sys.stderr)
        return 2
    with open(a.out, "w") as f:
        f.write(page)
    print(f"gallery: wrote {os.path.relpath(a.out, ROOT)} from {rows_dir} in {time.time() - start:.0f} s", flush=True)
    if failed:
        print(f"gallery: the tests of {', '.join(failed)} FAILED (see the logs in {rows_dir}): the page shows "
              "what audit said, but the prose may no longer hold", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
