"""lossguard_capture.megatron at the shapes Megatron-based RL trainers run (issue #38): pipeline stages (the
1F1B schedule), tensor parallelism with a vocabulary-parallel cross entropy, context parallelism, a loss
function over logits that hands its per-token losses to ``audit.per_token``, the LR scheduler, and the
loop's own skip decision (tests/trainers/megatron_shapes_driver.py runs them under torchrun, CPU, Gloo, on
the real megatron-core).

The tests prove, at PP 2 x DP 2, PP 2 x CP 2 and TP 2 x DP 2, each with an empty sample, a fully masked
micro-batch (DP 2) and a zero-token step:

(a) the adapter changes nothing: backpropagated losses, ``main_grad`` after finalize_model_grads, the
    optimizer's results, the learning rate and the parameters after the step are bit for bit those of the
    run without it;
(b) the applied gradient is ``sum_t w_t grad(l_t)`` with the measured weights ``w_t = token_weight_t x
    grad_scale`` (``l_t`` the float64 cross entropy of the whole model, its stages and TP shards assembled);
(c) every stage records its step records (the earlier stages no samples, the count finalize_model_grads
    broadcast to them, the scaling they applied, whether the optimizer and the LR scheduler stepped), and
    ``lossguard audit`` passes the right runs and names the planted bugs: a decision broadcast from the
    pipeline's first stage (every stage skips a non-empty step), a decision read from the 3-tuple's count
    without per-token loss (a fully masked step steps), TP replicas counted as DP ranks (a uniform 1/tp);
(d) the verifier rejects wrong numbers planted in real captures: a stage that scaled its gradients
    differently, a stage the count did not reach, a scheduler that advanced on a skipped step, a TP rank
    whose weights differ from its TP rank 0.

    scripts/setup-trainers.sh megatron
    ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q tests/trainers/test_megatron_shapes.py
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DRIVER = os.path.join(HERE, "megatron_shapes_driver.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import megatron_shapes_driver as drv  # noqa: E402

LOSSGUARD = os.environ.get("LOSSGUARD_BIN", os.path.join(ROOT, "build", "cli", "lossguard"))
HAVE_BIN = os.path.isfile(LOSSGUARD) and os.access(LOSSGUARD, os.X_OK)
needs_bin = pytest.mark.skipif(not HAVE_BIN, reason="the lossguard binary is not built")

#: (pp, tp, cp, dp) -> the scenarios run there
LAYOUTS = {
    (2, 1, 1, 2): ["pt", "global", "first-stage-src", "sample-count"],
    (2, 1, 2, 1): ["pt", "global"],
    (1, 2, 1, 2): ["pt", "global", "tp-as-dp"],
}
RIGHT = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if s not in drv.PLANTED]
IDS = [f"pp{p}-tp{t}-cp{c}-dp{d}-{s}" for (p, t, c, d), s in RIGHT]
N = [sum(sum(row[:-1]) for row in m) for m in drv.MASKS]          # each step's effective tokens: 12, 0


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    out = {}
    for (pp, tp, cp, dp), scenarios in LAYOUTS.items():
        d = str(tmp_path_factory.mktemp(f"shapes-pp{pp}-tp{tp}-cp{cp}-dp{dp}"))
        common = ["--pp", str(pp), "--tp", str(tp), "--cp", str(cp), "--scenarios", ",".join(scenarios)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(pp * tp * cp * dp), DRIVER, "--out", d, *common]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        r = subprocess.run([sys.executable, DRIVER, "--reference", d, *common], capture_output=True, text=True,
                           timeout=300, env=_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        out[(pp, tp, cp, dp)] = d
    return out


def world(layout):
    pp, tp, cp, dp = layout
    return pp * tp * cp * dp


def captures(runs, layout, scenario, step):
    d = os.path.join(runs[layout], scenario, "adapter", "captures", f"step{step:06d}")
    out = []
    for r in range(world(layout)):
        f = os.path.join(d, f"step{step:06d}-rank{r:05d}.safetensors")
        with safe_open(f, framework="pt") as h:
            out.append((load_file(f), h.metadata()))
    return out


def same(x, y):
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and bool(torch.equal(x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    return x == y


def audit(path, *args):
    r = subprocess.run([LOSSGUARD, "audit", path, "--json", "-", *args], capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else None
    return r.returncode, doc, r.stderr


def checks_of(doc):
    return [{c["name"]: c for c in s["checks"]} for s in doc["steps"]]


# ---- (a) bit for bit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_adapter_changes_nothing(runs, layout, scenario):
    a = os.path.join(runs[layout], scenario, "adapter")
    p = os.path.join(runs[layout], scenario, "plain")
    for r in range(world(layout)):
        for name in (f"losses-rank{r}.pt", f"final-rank{r}.pt",
                     *[f"grads-step{n}-rank{r}.pt" for n in range(drv.STEPS)]):
            x, y = torch.load(os.path.join(a, name)), torch.load(os.path.join(p, name))
            assert same(x, y), (name, r)
        with open(os.path.join(a, f"opt-rank{r}.json")) as f, open(os.path.join(p, f"opt-rank{r}.json")) as g:
            ja, jp = json.load(f), json.load(g)
        assert ja == jp, r
        # the loop's own decision: step 0 steps (optimizer and scheduler), the zero-token step 1 skips both
        assert [s["skipped"] for s in ja] == [False, True] and ja[0]["update_successful"] is True
        assert ja[0]["lr"] < 0.5 and ja[1]["lr"] == ja[0]["lr"]
    pp = layout[0]
    last = [r for r in range(world(layout)) if r >= world(layout) // pp * (pp - 1)]
    for r in range(world(layout)):
        losses = torch.load(os.path.join(a, f"losses-rank{r}.pt"))
        assert [len(x) for x in losses] == ([drv.M] * drv.STEPS if r in last else [0] * drv.STEPS), r


# ---- (b) the applied gradient ------------------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, layout, scenario):
    for n in range(drv.STEPS):
        ref = torch.load(os.path.join(runs[layout], scenario, "adapter", f"ref-step{n}.pt"))
        want, got = ref["want"], ref["got"]
        assert sorted(want) == sorted(got)
        # every effective or masked response position held by exactly one loss rank; the last position never
        assert (ref["seen"][:, : drv.S - 1] == 1).all() and (ref["seen"][:, -1] == 0).all()
        assert float(ref["weights"].sum()) == pytest.approx(1.0 if N[n] else 0.0, rel=1e-6)
        scale = max(float(v.abs().max()) for v in want.values())
        assert (scale > 0) == (N[n] > 0)
        for name, w in want.items():
            torch.testing.assert_close(got[name].double(), w, rtol=1e-5, atol=1e-6 * max(scale, 1e-30),
                                       msg=lambda m: f"{layout} {scenario} step {n} {name}: {m}")


def test_gradient_check_rejects_wrong_weights(runs):
    """The identity of (b) fails when the weights are wrong: the applied gradient against weights x 1.01."""
    ref = torch.load(os.path.join(runs[(2, 1, 1, 2)], "pt", "adapter", "ref-step0.pt"))
    wrong = {k: v * 1.01 for k, v in ref["want"].items()}
    with pytest.raises(AssertionError):
        for name, w in wrong.items():
            torch.testing.assert_close(ref["got"][name].double(), w, rtol=1e-5, atol=1e-8)


# ---- (c) what each stage records, and the verdicts ---------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_stage_records(runs, layout, scenario):
    pp, tp, cp, dp = layout
    for n in range(drv.STEPS):
        caps = captures(runs, layout, scenario, n)
        scales = {float(t["grad_scale"]) for t, _ in caps}
        assert len(scales) == 1, scales                      # every stage and rank applied one scaling
        for t, meta in caps:
            assert (int(meta["pp"]), int(meta["tp"]), int(meta["cp"]), int(meta["dp"])) == layout
            last = int(meta["pp_rank"]) == pp - 1
            assert int(meta["num_microbatches"]) == (drv.M if last else 0), meta
            assert not any(k.startswith("mb.") for k in t) or last
            assert t["skipped"].item() == (N[n] == 0) and t["scheduler_stepped"].item() == (N[n] > 0)
            if scenario == "pt":         # the count every stage received through finalize_model_grads
                assert t["num_tokens_reduced"].item() == N[n]
                assert float(t["grad_scale"]) == (float(1.0 / torch.tensor(N[n], dtype=torch.int32)) if N[n]
                                                  else 1.0)
            else:
                assert "num_tokens_reduced" not in t and float(t["grad_scale"]) == 1.0 / (dp * cp)
            if N[n] > 0:
                assert t["grad_norm"].item() > 0
            else:
                assert "grad_norm" not in t


@needs_bin
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_audit_passes(runs, layout, scenario):
    d = os.path.join(runs[layout], scenario, "adapter", "captures")
    for n in range(drv.STEPS):
        code, doc, err = audit(os.path.join(d, f"step{n:06d}"))
        assert code == 0, (n, err, doc)
        checks = checks_of(doc)[0]
        assert checks["weights"]["ok"] is True and checks["coverage"]["ok"] is True
        assert checks["decision"]["ok"] is True
        assert ("stages" in checks) == (layout[0] > 1)
        if layout[0] > 1:
            assert checks["stages"]["ok"] is True
        assert (checks["counts"]["ok"] is True) == (scenario == "pt")


@needs_bin
def test_audit_names_a_decision_from_the_first_stage(runs):
    """The decision broadcast over the pipeline group from its first stage, which computes no loss: every
    stage skips the non-empty step 0."""
    d = os.path.join(runs[(2, 1, 1, 2)], "first-stage-src", "adapter", "captures")
    code, doc, err = audit(os.path.join(d, "step000000"))
    assert code == 1, err
    c = checks_of(doc)[0]
    assert c["decision"]["ok"] is False and c["weights"]["ok"] is True
    assert "rank 0 (pipeline stage 0 of 2) skipped (expected step: N = 12)" in c["decision"]["detail"]
    assert audit(os.path.join(d, "step000001"))[0] == 0      # the zero-token step: skipped, as it should


@needs_bin
def test_audit_names_a_decision_from_the_sample_count(runs):
    """The seed's review finding: without per-token loss the 3-tuple carries a constant 1 per micro-batch;
    a decision read from it steps a fully masked step."""
    d = os.path.join(runs[(2, 1, 1, 2)], "sample-count", "adapter", "captures")
    assert audit(os.path.join(d, "step000000"))[0] == 0
    code, doc, err = audit(os.path.join(d, "step000001"))
    assert code == 1, err
    c = checks_of(doc)[0]
    assert c["decision"]["ok"] is False
    assert "(pipeline stage 0 of 2) stepped (expected skip: N = 0)" in c["decision"]["detail"]


@needs_bin
def test_audit_names_tp_replicas_counted_as_dp(runs):
    """N all-reduced over the whole world: every TP replica adds its rows again, w_t = m_t / (tp N)."""
    d = os.path.join(runs[(1, 2, 1, 2)], "tp-as-dp", "adapter", "captures", "step000000")
    code, doc, err = audit(d)
    s = doc["steps"][0]
    assert s["diagnosis"]["kind"] == "uniform-scale" and s["diagnosis"]["scale"] == pytest.approx(0.5)
    assert "1/tp" in s["diagnosis"]["named"].split(" or ")
    assert "tensor-parallel replicas counted as data-parallel ranks" in checks_of(doc)[0]["weights"]["detail"]
    assert code == 0                                  # a uniform scale an optimizer hides passes ...
    assert audit(d, "--strict-scale")[0] == 1         # ... and fails when the scale is part of the contract
    # the right run has no such finding
    _, good, _ = audit(os.path.join(runs[(1, 2, 1, 2)], "global", "adapter", "captures", "step000000"))
    assert good["steps"][0]["diagnosis"]["kind"] == "exact"


# ---- (d) the verifier rejects wrong numbers planted in real captures ----------------------------------------
def _planted(runs, tmp_path, layout, scenario, step, rank, change):
    src = os.path.join(runs[layout], scenario, "adapter", "captures", f"step{step:06d}")
    dst = tmp_path / f"step{step:06d}"
    shutil.copytree(src, dst)
    f = str(dst / f"step{step:06d}-rank{rank:05d}.safetensors")
    with safe_open(f, framework="pt") as h:
        meta = h.metadata()
    t = load_file(f)
    change(t)
    save_file(t, f, metadata=meta)
    return str(dst)


def _double_scale(t):
    t["grad_scale"] = t["grad_scale"] * 2


def _zero_count(t):
    t["num_tokens_reduced"] = torch.zeros_like(t["num_tokens_reduced"])


def _advance_scheduler(t):
    t["scheduler_stepped"] = torch.ones_like(t["scheduler_stepped"])


def _nudge_weights(t):
    t["mb.1.token_weight"] = t["mb.1.token_weight"] * 1.5


#: what is planted (layout, scenario, step, rank, change) and what audit must say (check, text)
PLANTS = {
    # rank 0: pipeline stage 0 of DP 0 (Megatron's order: PP outermost)
    "stage-scaled-differently": ((2, 1, 1, 2), "pt", 0, 0, _double_scale, "stages",
                                 ["rank 0 (DP 0 CP 0 TP 0 PP 0", "scaled its gradients"]),
    # rank 1: stage 0, CP rank 1
    "count-did-not-arrive": ((2, 1, 2, 1), "pt", 0, 1, _zero_count, "stages",
                             ["num_tokens_reduced 0", "did not reach it"]),
    "scheduler-on-a-skipped-step": ((2, 1, 1, 2), "pt", 1, 0, _advance_scheduler, "decision",
                                    ["rank 0 advanced the LR scheduler while its optimizer skipped"]),
    # rank 1: TP rank 1 of DP 0 (TP fastest)
    "tp-rank-disagrees": ((1, 2, 1, 2), "pt", 0, 1, _nudge_weights, "coverage", ["disagrees with its TP rank 0"]),
}


@needs_bin
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_verifier_rejects_planted_numbers(runs, tmp_path, plant):
    layout, scenario, step, rank, change, check, texts = PLANTS[plant]
    d = _planted(runs, tmp_path, layout, scenario, step, rank, change)
    assert audit(os.path.join(runs[layout], scenario, "adapter", "captures", f"step{step:06d}"))[0] == 0
    code, doc, err = audit(d)
    assert code == 1, err
    c = checks_of(doc)[0][check]
    assert c["ok"] is False and all(x in c["detail"] for x in texts), c
