"""lossguard_capture.slime, switched on by slime's own plug-in flags (issue #39), driven exactly as slime drives
it (tests/trainers/slime_shape: slime's module paths, hook signatures, call order, batch keys, THD/CP split and
return shapes, written from a reading of slime's source) over the real megatron-core (0.15.3, 0.16.0 or 0.16.1) under torchrun on
CPU (tests/trainers/slime_relax_driver.py), at CP 2 (THD, slime's per-sample zig-zag split) and PP 2 x DP 2.

(a) the audit changes nothing: slime's reported losses, gradient norms, main_grad after finalize, the learning
    rate and the parameters after every step are bit for bit those of the run without the flags — with
    rollouts of several samples (slime's per-rollout denominators) and with a user's pg reducer;
(b) the applied gradient is sum over terms and tokens of w_t grad(l_t) with the measured weights (policy,
    entropy bonus, k1 KL; l_t recomputed in float64 on the whole model);
(c) lossguard audit passes slime's right steps and names what slime's own code does wrong: its per-token count
    takes clamp_min(mask.sum(), 1) of a fully masked sample (the seed's bug 1: reproduced by the slime
    preset), it steps a step without an effective token (bug 2: the decision check), and a reducer installed
    by --custom-pg-loss-reducer-function-path receives no rollout_mask_sums (the policy term's weights);
(d) fail fast stops the job before the update on every rank; a slime without an attach point is refused.

    scripts/setup-trainers.sh megatron
    ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q tests/trainers/test_slime.py
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
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DRIVER = os.path.join(HERE, "slime_relax_driver.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import gallery  # noqa: E402
import slime_relax_driver as drv  # noqa: E402
from harness import HAVE_BIN, LOSSGUARD, assert_same_runs, child_env, needs_bin  # noqa: E402
from harness import audit_json as audit  # noqa: E402


#: (pp, cp, dp) -> scenarios
#: pt-sample-indices: the rollout names its samples by `sample_indices` alone, DP ranks holding a strided split
LAYOUTS = {(1, 2, 1): ["pt", "sm", "sm-reducer", "sft", "pt-ff"],
           (2, 1, 2): ["pt", "sm", "pt-ff", "pt-sample-indices"]}
RIGHT = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if s not in drv.PLANTED]
IDS = [f"pp{p}-cp{c}-dp{d}-{s}" for (p, c, d), s in RIGHT]
N = [sum(sum(m) for _, _, m, _ in step) for step in drv.SAMPLES]           # 15, 10, 0


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    out = {}
    for (pp, cp, dp), scenarios in LAYOUTS.items():
        d = str(tmp_path_factory.mktemp(f"slime-pp{pp}-cp{cp}-dp{dp}"))
        common = ["--pp", str(pp), "--cp", str(cp), "--scenarios", ",".join(scenarios)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp * cp * dp),
               DRIVER, "--out", d, *common]
        gallery.remember_run(d, cmd)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        r = subprocess.run([sys.executable, DRIVER, "--reference", d, *common], capture_output=True, text=True,
                           timeout=300, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        out[(pp, cp, dp)] = d
    return out


def world(layout):
    pp, cp, dp = layout
    return pp * cp * dp


def checks(runs, layout, scenario, step):
    rc, doc, err = audit(os.path.join(runs[layout], scenario, "adapter", "captures", f"step{step:06d}"))
    assert doc is not None, err
    s = dict(doc["steps"][0], verdict=doc["verdict"])
    return rc, {c["name"]: c for c in s["checks"]}, s


# ---- (a) bit for bit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_audit_changes_nothing(runs, layout, scenario):
    a = os.path.join(runs[layout], scenario, "adapter")
    p = os.path.join(runs[layout], scenario, "plain")
    for ja in assert_same_runs(a, p, world(layout), drv.STEPS):     # the user's own hooks ran after lossguard's
        assert len(ja["grad_norm"]) == drv.STEPS and ja["lr"] < 0.01          # slime stepped all three steps
        assert os.path.isdir(os.path.join(a, "captures")) and not os.path.exists(os.path.join(p, "captures"))


# ---- (b) the applied gradient ------------------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, layout, scenario):
    for n in range(drv.STEPS):
        ref = torch.load(os.path.join(runs[layout], scenario, "adapter", f"ref-step{n}.pt"))
        want, got = ref["want"], ref["got"]
        assert sorted(want) == sorted(got)
        for i, ((T, R, _, _), seen) in enumerate(zip(drv.SAMPLES[n], ref["seen"])):
            assert seen.tolist() == [1 if T - R - 1 <= p < T - 1 else 0 for p in range(T)], (i, seen)
        scale = max(float(v.abs().max()) for v in want.values())
        assert (scale > 0) == (N[n] > 0)
        for name, w in want.items():
            torch.testing.assert_close(got[name].double(), w, rtol=1e-5, atol=1e-6 * max(scale, 1e-30),
                                       msg=lambda m: f"{layout} {scenario} step {n} {name}: {m}")


def test_gradient_check_rejects_wrong_weights(runs):
    ref = torch.load(os.path.join(runs[(1, 2, 1)], "pt", "adapter", "ref-step0.pt"))
    with pytest.raises(AssertionError):
        for name, w in ref["want"].items():
            torch.testing.assert_close(ref["got"][name].double(), w * 1.01, rtol=1e-5, atol=1e-8)


# ---- (c) the records and the verdicts ----------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_records(runs, layout, scenario):
    from safetensors import safe_open
    from safetensors.torch import load_file
    pp = layout[0]
    for n in range(drv.STEPS):
        d = os.path.join(runs[layout], scenario, "adapter", "captures", f"step{n:06d}")
        held = []
        for r in range(world(layout)):
            f = os.path.join(d, f"step{n:06d}-rank{r:05d}.safetensors")
            with safe_open(f, framework="pt") as h:
                meta = h.metadata()
            t = load_file(f)
            assert meta["trainer"] == "slime"
            if int(meta["pp_rank"]) == pp - 1:      # what loss_function receives: slime's rollouts per step
                assert int(t["global_batch_size"]) == drv.GBS
            assert int(t["skipped"]) == 0 and int(t["scheduler_stepped"]) == 1               # slime steps all
            want_terms = {"pt": {"entropy", "kl"}, "pt-sample-indices": {"entropy", "kl"}, "sm": {"entropy"},
                          "sm-reducer": {"entropy"}}.get(scenario, set())
            assert set(filter(None, meta.get("terms", "").split(","))) == want_terms
            for term in want_terms:
                assert float(meta[f"term.{term}.coef"]) == {"entropy": -drv.ENTROPY, "kl": drv.KL}[term]
            if int(meta["pp_rank"]) < pp - 1:
                assert int(meta["num_microbatches"]) == 0
                continue
            for k in range(int(meta["num_microbatches"])):
                held += t[f"mb.{k}.sample_indices"].tolist()
                if scenario.startswith("sm"):       # slime's per-rollout mask totals, as the denominators
                    sums = {}
                    for T, R, m, ro in drv.SAMPLES[n]:
                        sums[ro] = sums.get(ro, 0) + sum(m)
                    assert t[f"mb.{k}.sample_denoms"].tolist() == [
                        float(sums[drv.SAMPLES[n][i - 6 * n][3]]) for i in t[f"mb.{k}.sample_indices"].tolist()]
        cps = layout[1]
        assert sorted(set(held)) == list(range(6 * n, 6 * n + 6)) and len(held) == 6 * cps      # partition


@needs_bin
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[f"pp{p}-cp{c}-dp{d}" for p, c, d in LAYOUTS])
def test_per_token_verdicts_name_slimes_own_bugs(runs, layout):
    rc, c, s = checks(runs, layout, "pt", 0)
    assert rc == 0 and s["verdict"] == "pass", c                            # every sample holds a token
    if layout[1] > 1:                                       # every CP rank counts whole samples, loss x cp
        assert "whole samples" in c["counts"]["detail"]
    assert c["entropy.weights"]["ok"] and c["kl.weights"]["ok"]
    rc, c, s = checks(runs, layout, "pt", 1)                # a fully masked sample: clamp_min(0, 1) = 1 counted
    assert rc == 1 and c["counts"]["ok"] is False and s["matches"][:1] == ["slime"], (c, s["matches"])
    rc, c, s = checks(runs, layout, "pt", 2)                # no effective token, and slime steps
    assert rc == 1 and c["decision"]["ok"] is False and "expected skip" in c["decision"]["detail"]


@needs_bin
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[f"pp{p}-cp{c}-dp{d}" for p, c, d in LAYOUTS])
def test_sample_mean_is_slimes_per_rollout_mean(runs, layout):
    for n in (0, 1):
        rc, c, s = checks(runs, layout, "sm", n)
        assert rc == 0 and s["verdict"] == "pass" and c["weights"]["ok"] and c["entropy.weights"]["ok"], (n, c)
    rc, c, s = checks(runs, layout, "sm", 2)
    assert rc == 1 and c["decision"]["ok"] is False


@needs_bin
def test_custom_reducer_without_rollout_mask_sums_is_named(runs):
    """slime hands --custom-pg-loss-reducer-function-path's factory four arguments: a reducer built from them
    divides a compact rollout's samples by their own counts — the policy term's weights fail, the entropy's
    (slime's own reducer) pass; the run itself is unchanged by the audit (test_audit_changes_nothing)."""
    rc, c, s = checks(runs, (1, 2, 1), "sm-reducer", 0)
    assert rc == 1 and c["weights"]["ok"] is False and c["entropy.weights"]["ok"], c
    assert "per-sample" in c["weights"]["detail"]


@needs_bin
def test_sft_loss(runs):
    rc, c, s = checks(runs, (1, 2, 1), "sft", 0)
    assert rc == 0 and s["verdict"] == "pass", c


def test_injected_count_is_rejected(runs, tmp_path):
    """The whole-sample count convention is accepted only when it holds: a capture whose reduced count is off
    by one (slime's clamp on a step without an empty sample, planted) fails counts."""
    if not HAVE_BIN:
        pytest.skip("the lossguard binary is not built")
    import shutil
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    src = os.path.join(runs[(1, 2, 1)], "pt", "adapter", "captures", "step000000")
    dst = tmp_path / "step000000"
    shutil.copytree(src, dst)
    for f in sorted(os.listdir(dst)):
        p = os.path.join(dst, f)
        with safe_open(p, framework="pt") as h:
            meta = h.metadata()
        t = load_file(p)
        t["num_tokens_reduced"] = t["num_tokens_reduced"] + 1
        save_file(t, p, metadata=meta)
    rc, doc, _ = audit(str(dst))
    c = {x["name"]: x for x in doc["steps"][0]["checks"]}
    assert rc == 1 and c["counts"]["ok"] is False


GALLERY = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if s not in drv.PLANTED]


@needs_bin
@pytest.mark.parametrize("layout,scenario", GALLERY, ids=[f"pp{p}-cp{c}-dp{d}-{s}" for (p, c, d), s in GALLERY])
def test_audit_of_the_rollout(runs, layout, scenario):
    """The rollout's three steps in one audit (docs/gallery.md's rows): step 0 passes, step 1 fails per-token
    (the clamp), step 2 fails (a zero-token step that steps); with a user's pg reducer every step fails."""
    pp, cp, dp = layout
    caps = os.path.join(runs[layout], scenario, "adapter", "captures")
    steps = [os.path.join(caps, f"step{n:06d}") for n in range(drv.STEPS)]
    r = subprocess.run([LOSSGUARD, "audit", *steps, "--json", "-"], capture_output=True, text=True, timeout=120)
    text = subprocess.run([LOSSGUARD, "audit", *steps], capture_output=True, text=True, timeout=120).stdout
    doc = json.loads(r.stdout)
    gallery.record("slime", f"pp{pp}-cp{cp}-dp{dp}-{scenario}", dict(pp=pp, cp=cp, dp=dp, scenario=scenario,
                   **{k: v for k, v in drv.SCENARIOS[scenario].items()}), [LOSSGUARD, "audit", *steps],
                   r.returncode, doc, text, r.stderr)
    verdicts = [checks(runs, layout, scenario, n)[2]["verdict"] for n in range(drv.STEPS)]
    per_token = drv.SCENARIOS[scenario]["calculate_per_token_loss"]
    want = (["fail"] * 3 if scenario == "sm-reducer"              # both steps hold compact rollouts
            else ["pass", "fail" if per_token else "pass", "fail"])
    assert r.returncode == 1 and verdicts == want, text


# ---- (d) fail fast and refusals ------------------------------------------------------------------------
@needs_bin
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[f"pp{p}-cp{c}-dp{d}" for p, c, d in LAYOUTS])
def test_fail_fast_stops_before_the_update(runs, layout):
    for r in range(world(layout)):
        with open(os.path.join(runs[layout], "pt-ff", "adapter", f"result-rank{r}.json")) as f:
            res = json.load(f)
        assert res["audit_failed"] == {"step": 1, "exit_code": 1} and res["params_unchanged"] is True, (r, res)


def test_refuses_a_slime_without_its_attach_points(monkeypatch):
    sys.path.insert(0, os.path.join(HERE, "slime_shape"))
    import lossguard_capture.slime as lcs
    import slime.backends.megatron_utils.loss as L
    monkeypatch.delattr(L, "compute_approx_kl")
    args = SimpleNamespace(loss_type="policy_loss", calculate_per_token_loss=True)
    with pytest.raises(RuntimeError, match=r"loss\.compute_approx_kl is missing"):
        lcs.SlimeAudit(lcs.SLIME, args, "unused")
    monkeypatch.undo()

    def loss_function(args, batch, logits):            # an older / other signature
        return None
    import slime.backends.megatron_utils.model as Mo
    monkeypatch.setattr(Mo, "loss_function", loss_function)
    with pytest.raises(RuntimeError, match=r"does not start with \('args', 'batch', 'num_microbatches'\)"):
        lcs.SlimeAudit(lcs.SLIME, args, "unused")


def test_refuses_what_it_does_not_measure():
    sys.path.insert(0, os.path.join(HERE, "slime_shape"))
    import lossguard_capture.slime as lcs
    # --qkv-format: slime v0.2.2 .. v0.3.0 and Relax; gone from slime main since 7703751 (#2100), still refused
    for flag, value, needle in (("qkv_format", "bshd", "--qkv-format bshd"), ("allgather_cp", True, "--allgather-cp"),
                                ("enable_mtp_training", True, "--enable-mtp-training")):
        args = SimpleNamespace(loss_type="policy_loss", calculate_per_token_loss=True, context_parallel_size=2)
        setattr(args, flag, value)
        with pytest.raises(RuntimeError, match=f"lossguard_capture.slime does not measure: {needle}"):
            lcs.SlimeAudit(lcs.SLIME, args, "unused")
