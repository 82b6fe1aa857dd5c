"""lossguard_capture.relax, switched on by Relax's own plug-in flags (issue #39 item 2), driven exactly as Relax
drives it (tests/trainers/relax_shape: Relax's module paths, hook signatures, call order, batch keys, dynamic CP
per micro-batch, dummy micro-batches, ``__loss_scale__``, the zero-token skip of PR #285 and
normalize_reduced_loss_metrics, written from a reading of Relax's source) over the real megatron-core (0.15.3, 0.16.0 or
0.16.1) under torchrun on CPU (tests/trainers/slime_relax_driver.py --trainer relax), at CP 2 (THD) and PP 2 x DP 2.

(a) the audit changes nothing, bit for bit (reported metrics, gradient norms, main_grad, learning rate,
    parameters), and Relax skips the zero-token step on every stage (optimizer and scheduler);
(b) the applied gradient is sum over terms and tokens of w_t grad(l_t) with the measured weights, with a
    micro-batch at CP size 1 inside CP 2 and a dummy micro-batch;
(c) lossguard audit passes Relax's steps — the empty sample, the skipped zero-token step, the metrics — and
    names the seed's three bugs planted one at a time: the CP=1 count of an empty response as 1 token (counts,
    the relax-legacy preset), a zero-token step that steps, the decision broadcast from a group-local source
    (the pipeline's first stage: decision); fail fast stops the first before its update on every rank.

    ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q tests/trainers/test_relax.py
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from lossguard_capture.megatron_cpu import no_cuda_build

with no_cuda_build():                     # megatron-core 0.15.x builds a CUDA allocator at import (megatron_cpu)
    pytest.importorskip("megatron.core")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gallery  # noqa: E402
import slime_relax_driver as drv  # noqa: E402
from harness import HAVE_BIN, LOSSGUARD, assert_same_runs, child_env, needs_bin  # noqa: E402
from harness import audit_json as audit  # noqa: E402
from test_slime import N, world  # noqa: E402

#: sft: Relax's own loss type name (sftc: chunked through lm_head_forward); rpp: a token-global estimator (its
#: mask-safe reducers; CP 1 only); offp: an off-policy step (old log-probs of an older policy, clipping fires);
#: lscale: __loss_scale__ as Relax's fully-async iterator sets it (bug-lscale: from k_local)
LAYOUTS = {(1, 2, 1): ["pt", "sm", "dyncp", "dummy", "sft", "sftc", "offp", "lscale", "bug-lscale"],
           (2, 1, 2): ["pt", "sm", "rpp", "bug-clamp", "bug-noskip", "bug-src", "bug-clamp-ff"]}
RIGHT = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if s not in drv.PLANTED]
IDS = [f"pp{p}-cp{c}-dp{d}-{s}" for (p, c, d), s in RIGHT]


def lid(layout):
    return "pp{}-cp{}-dp{}".format(*layout)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return run_layouts(tmp_path_factory, LAYOUTS, "relax")


def run_layouts(tmp_path_factory, layouts, prefix, extra=()):
    """{(pp, cp, dp): folder}: the driver's run of each layout's scenarios under torchrun (``extra``: more
    driver arguments, e.g. --relax-src), then its float64 reference (also test_relax_source.py's)."""
    out = {}
    for (pp, cp, dp), scenarios in layouts.items():
        d = str(tmp_path_factory.mktemp(f"{prefix}-pp{pp}-cp{cp}-dp{dp}"))
        common = ["--trainer", "relax", "--pp", str(pp), "--cp", str(cp), "--scenarios", ",".join(scenarios)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp * cp * dp),
               drv.__file__, "--out", d, *common, *extra]
        gallery.remember_run(d, cmd)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        r = subprocess.run([sys.executable, drv.__file__, "--reference", d, *common], capture_output=True, text=True,
                           timeout=300, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        out[(pp, cp, dp)] = d
    return out


def captures(runs, layout, scenario, step):
    from safetensors import safe_open
    from safetensors.torch import load_file
    d = os.path.join(runs[layout], scenario, "adapter", "captures", f"step{step:06d}")
    out = []
    for r in range(world(layout)):
        f = os.path.join(d, f"step{step:06d}-rank{r:05d}.safetensors")
        with safe_open(f, framework="pt") as h:
            out.append((load_file(f), h.metadata()))
    return out


def step_checks(runs, layout, scenario, step):
    rc, doc, err = audit(os.path.join(runs[layout], scenario, "adapter", "captures", f"step{step:06d}"))
    assert doc is not None, err
    return rc, {c["name"]: c for c in doc["steps"][0]["checks"]}, doc["steps"][0]


# ---- (a) bit for bit, and Relax's skip ---------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_audit_changes_nothing(runs, layout, scenario):
    assert_audit_changes_nothing(runs, layout, scenario)


def assert_audit_changes_nothing(runs, layout, scenario):
    """The adapter's run and the plain one saved the same bits; the zero-token step skipped (also
    test_relax_source.py's, under Relax's real modules)."""
    a = os.path.join(runs[layout], scenario, "adapter")
    p = os.path.join(runs[layout], scenario, "plain")
    for ja in assert_same_runs(a, p, world(layout), drv.STEPS):
        assert ja["grad_norm"][2] == 0.0 and ja["grad_norm"][0] > 0      # the zero-token step skipped
    for t, meta in captures(runs, layout, scenario, 2):
        assert int(t["skipped"]) == 1 and int(t["scheduler_stepped"]) == 0, meta["rank"]
    for t, meta in captures(runs, layout, scenario, 0):
        assert int(t["skipped"]) == 0 and int(t["scheduler_stepped"]) == 1, meta["rank"]


# ---- (b) the applied gradient ------------------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, layout, scenario):
    assert_gradient_is_sum_of_measured_weights(runs, layout, scenario)


def assert_gradient_is_sum_of_measured_weights(runs, layout, scenario):
    """main_grad of every step against the float64 sum over terms and tokens of w_t grad(l_t) (the driver's
    --reference), every response token held once."""
    for n in range(drv.STEPS):
        ref = torch.load(os.path.join(runs[layout], scenario, "adapter", f"ref-step{n}.pt"))
        want, got = ref["want"], ref["got"]
        for i, ((T, R, _, _), seen) in enumerate(zip(drv.SAMPLES[n], ref["seen"])):
            assert seen.tolist() == [1 if T - R - 1 <= p < T - 1 else 0 for p in range(T)], (i, seen)
        scale = max(float(v.abs().max()) for v in want.values())
        assert (scale > 0) == (N[n] > 0)
        for name, w in want.items():
            torch.testing.assert_close(got[name].double(), w, rtol=1e-5, atol=1e-6 * max(scale, 1e-30),
                                       msg=lambda m: f"{layout} {scenario} step {n} {name}: {m}")


# ---- (c) what is recorded, the verdicts --------------------------------------------------------------
def test_dynamic_cp_and_dummy_micro_batches_are_recorded(runs):
    sizes = {int(t[f"mb.{k}.cp_size"]) for t, m in captures(runs, (1, 2, 1), "dyncp", 0)
             for k in range(int(m["num_microbatches"]))}
    assert sizes == {1, 2}                        # the short micro-batch at CP size 1, the long one at 2
    for t, m in captures(runs, (1, 2, 1), "dummy", 0):
        assert int(m["num_microbatches"]) == 3 and int(t["mb.2.dummy"]) == 1 and not int(t["mb.0.dummy"])
        assert int(t["mb.2.loss_masks"].sum()) == 0 and float(t["mb.2.token_weight"].abs().sum()) == 0.0
    for t, m in captures(runs, (2, 1, 2), "sm", 0):
        assert m["trainer"] == "relax"
        if m["pp_rank"] == "1":                   # Relax's sample_index_mask_sums, and its reduced metrics
            assert "mb.0.sample_denoms" in t and "metrics.values" in t
            assert m["metrics.keys"].split(",")[:2] == ["pg_loss", "entropy_loss"]
            assert float(t["metrics.values"][0]) == drv.GBS    # sample-mean: the step's global batch size
        else:
            assert "metrics.values" not in t and int(m["num_microbatches"]) == 0


@needs_bin
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_relax_passes(runs, layout, scenario):
    for n in range(drv.STEPS):
        rc, c, s = step_checks(runs, layout, scenario, n)
        assert rc == 0, (n, {k: v["detail"] for k, v in c.items() if v["ok"] is False})
        assert c["metrics"]["ok"] is True and c["decision"]["ok"] is True
        if layout[0] > 1:
            assert c["stages"]["ok"] is True


@needs_bin
def test_the_seeds_three_bugs_are_named(runs):
    lay = (2, 1, 2)
    rc, c, s = step_checks(runs, lay, "bug-clamp", 1)              # bug 1: an empty response counted at CP 1
    assert rc == 1 and c["counts"]["ok"] is False and s["matches"][:1] == ["relax-legacy"], (c, s["matches"])
    for scenario in ("bug-noskip", "bug-src"):                     # bug 2; bug 3: a group-local source
        for n in (0, 1):
            assert step_checks(runs, lay, scenario, n)[0] == 0
        rc, c, s = step_checks(runs, lay, scenario, 2)
        assert rc == 1 and c["decision"]["ok"] is False, c
        assert "pipeline stage 0 of 2) stepped (expected skip: N = 0)" in c["decision"]["detail"]
    for r in range(world(lay)):
        with open(os.path.join(runs[lay], "bug-clamp-ff", "adapter", f"result-rank{r}.json")) as f:
            res = json.load(f)
        assert res["audit_failed"] == {"step": 1, "exit_code": 1} and res["params_unchanged"] is True, (r, res)


GALLERY = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if not s.endswith("-ff")]


@needs_bin
@pytest.mark.parametrize("layout,scenario", GALLERY, ids=[f"{lid(lay)}-{s}" for lay, s in GALLERY])
def test_audit_of_the_rollout(runs, layout, scenario):
    """The rollout's three steps in one audit (docs/gallery.md's rows)."""
    pp, cp, dp = layout
    caps = os.path.join(runs[layout], scenario, "adapter", "captures")
    steps = [os.path.join(caps, f"step{n:06d}") for n in range(drv.STEPS)]
    r = subprocess.run([LOSSGUARD, "audit", *steps, "--json", "-"], capture_output=True, text=True, timeout=120)
    text = subprocess.run([LOSSGUARD, "audit", *steps], capture_output=True, text=True, timeout=120).stdout
    gallery.record("relax", f"{lid(layout)}-{scenario}", dict(pp=pp, cp=cp, dp=dp, scenario=scenario,
                   **drv.RELAX_SCENARIOS[scenario]), [LOSSGUARD, "audit", *steps], r.returncode, json.loads(r.stdout),
                   text, r.stderr)
    assert r.returncode == (1 if scenario.startswith("bug-") else 0), text


def test_refuses_a_relax_without_its_attach_points(monkeypatch):
    sys.path.insert(0, os.path.join(HERE, "relax_shape"))
    import lossguard_capture.relax as lcr
    import relax.backends.megatron.loss as L
    monkeypatch.delattr(L, "get_log_probs_and_entropy")
    with pytest.raises(RuntimeError, match=r"lossguard_capture\.relax: this relax lacks .*get_log_probs_and_entropy "
                                           r"is missing"):
        lcr.RelaxAudit(lcr.RELAX, SimpleNamespace(loss_type="policy_loss"), "unused")


def test_refuses_the_loss_paths_it_does_not_measure():
    """Every Relax loss type is measured or refused at init with its reason (lossguard_capture.relax.refusals)."""
    sys.path.insert(0, os.path.join(HERE, "relax_shape"))
    import lossguard_capture.relax as lcr
    for extra, needle in ((dict(loss_type="dpo"), "--loss-type dpo"), (dict(loss_type="rm"), "--loss-type rm"),
                          (dict(loss_type="sft", task_type="seq_cls"), "--task-type seq_cls"),
                          (dict(mtp_only_training=True), "--mtp-only-training"),
                          (dict(recompute_loss_function=True), "--recompute-loss-function"),
                          (dict(opd_loss_coef=0.5), "--opd-loss-coef"),
                          (dict(use_tis=True, custom_tis_function_path="my.tis"), "--custom-tis-function-path")):
        args = SimpleNamespace(**{"loss_type": "policy_loss", "calculate_per_token_loss": True, **extra})
        with pytest.raises(RuntimeError, match=f"lossguard_capture.relax does not measure: {needle}"):
            lcr.RelaxAudit(lcr.RELAX, args, "unused")
    for ok in (dict(loss_type="sft"), dict(loss_type="policy_loss", advantage_estimator="reinforce_plus_plus"),
               dict(loss_type="sft", sft_chunked_logits=True),
               dict(loss_type="policy_loss", true_on_policy_mode=False, use_tis=True, use_opsm=True),
               dict(loss_type="policy_loss", custom_tis_function_path="my.tis")):       # no TIS: never loaded
        lcr.RelaxAudit(lcr.RELAX, SimpleNamespace(calculate_per_token_loss=True, **ok), "unused")   # measured


def test_a_planted_bug_is_not_silently_passed(runs):
    """The verifier's side: each planted run's captures exist and differ from the right run's where the bug
    acts (the count of step 1; the skip of step 2), so the failures above come from the bugs."""
    if not HAVE_BIN:
        pytest.skip("the lossguard binary is not built")
    lay = (2, 1, 2)
    right = {m["rank"]: t for t, m in captures(runs, lay, "pt", 1)}
    clamp = {m["rank"]: t for t, m in captures(runs, lay, "bug-clamp", 1)}
    assert any(int(clamp[r]["num_tokens_reduced"]) != int(right[r]["num_tokens_reduced"]) for r in right
               if "num_tokens_reduced" in right[r])
    assert all(int(t["skipped"]) == 0 for t, _ in captures(runs, lay, "bug-noskip", 2))
