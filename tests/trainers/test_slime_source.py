"""slime's OWN training step at its default-branch head (tests/trainers/slime_source_manifest.json: 624b824), run
unedited through tests/trainers/slime_relax_driver.py --slime-source over megatron-core on CPU/Gloo under torchrun:
``initialize.init`` (which loads lossguard's init hook with slime's ``load_function``),
``model.setup_model_and_optimizer`` (the model by slime's --custom-model-provider-path, megatron-core's optimizer
and slime's LR schedule), ``data.get_data_iterator`` / ``DataIterator`` / ``get_batch`` (THD packing, zig-zag CP),
``model.forward_only`` (the old log-probs, as slime's actor computes them), ``model.train`` / ``train_one_step``
and ``loss.loss_function`` — at DP 2, CP 2 and PP 2, per-token (--calculate-per-token-loss, entropy bonus, k1 KL)
and slime's per-rollout sample mean, over one rollout of three steps (every sample with a token; a fully masked
sample; no effective token at all). Only what this machine cannot import is a stand-in
(tests/trainers/slime_head_stand_ins: Megatron-LM's training package, wandb/httpx/psutil users, tqdm), each
citing the real lines that use it.

(a) lossguard's two slime flags change nothing: losses (what ``train`` logs and ``train_one_step`` returns),
    grad norms, ``main_grad`` after finalize at every step, the learning rate and the final parameters are bit
    for bit those of the run without them;
(b) step 0's applied gradient is sum over terms and tokens of w_t grad(l_t) with the weights the adapter
    captured (l_t recomputed in float64 on the whole model), and step 2's (no effective token) is zero;
(c) lossguard audit: step 0 passes in both modes; per-token, step 1 FAILS counts (slime's count takes
    clamp_min(mask.sum(), 1) of the fully masked sample, loss.py:1317) and the slime preset reproduces it; the
    sample mean passes step 1; step 2 FAILS the decision in both (slime steps without an effective token: no skip
    in train_one_step, model.py:659-686);
(d) bugs planted AROUND the real code (its files untouched) are named: ``bug-cp`` (the per-token loss not
    multiplied by CP, as before slime's #990) — a uniform x1/2 at CP 2 named by cp; ``bug-denoms`` (the loss's
    reducer built without ``rollout_mask_sums``) — per-sample weights where slime's are per rollout.

No slime code is in this repository: the files are read at run time from $LOSSGUARD_SLIME_SRC/<commit>/ —

    SLIME_GIT=/path/to/a/clone/of/slime scripts/slime-src.sh /tmp/slime-src
    LOSSGUARD_SLIME_SRC=/tmp/slime-src ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q \\
        tests/trainers/test_slime_source.py

Without it every test skips, saying so.
"""
import hashlib
import json
import os
import subprocess
import sys
import time

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
from harness import assert_same_runs, child_env, needs_bin, step_checks  # noqa: E402

with open(os.path.join(HERE, "slime_source_manifest.json")) as _f:
    MANIFEST = json.load(_f)
COMMIT = MANIFEST["commit"]
#: (pp, cp, dp) -> scenarios: the right ones run with and without the flags, the planted ones with them only
LAYOUTS = {(1, 1, 2): ["pt", "sm", "bug-denoms"], (1, 2, 1): ["pt", "sm", "bug-cp"], (2, 1, 1): ["pt", "sm"]}
RIGHT = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if s not in drv.SOURCE_PLANTS]
LIDS = {lay: f"pp{lay[0]}-cp{lay[1]}-dp{lay[2]}" for lay in LAYOUTS}
IDS = [f"{LIDS[lay]}-{s}" for lay, s in RIGHT]
N = [sum(sum(m) for _, _, m, _ in step) for step in drv.SAMPLES]           # 15, 10, 0
SRC = os.environ.get("LOSSGUARD_SLIME_SRC")
HOW = ("slime's real source is read at run time from outside this repository: materialise it with "
       "`SLIME_GIT=/path/to/a/clone/of/slime scripts/slime-src.sh DEST` (without SLIME_GIT it clones "
       f"{MANIFEST['upstream']}) and run with LOSSGUARD_SLIME_SRC=DEST")


def _missing_src():
    """Why LOSSGUARD_SLIME_SRC cannot serve the manifest's commit (None when it can)."""
    if not SRC:
        return f"LOSSGUARD_SLIME_SRC is not set: {HOW}"
    gone = [f for f in MANIFEST["real"] if not os.path.isfile(os.path.join(SRC, COMMIT, f))]
    if gone:
        return f"LOSSGUARD_SLIME_SRC={SRC} lacks {COMMIT[:7]}:{', '.join(gone[:3])}{' ...' * (len(gone) > 3)}: {HOW}"
    return None


def world(layout):
    pp, cp, dp = layout
    return pp * cp * dp


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """layout -> {dir, seconds}: the driver's jobs of the layout through slime's real modules, then the float64
    reference of its right scenarios."""
    why = _missing_src()
    if why:
        pytest.skip(why)
    out = {}
    for (pp, cp, dp), scenarios in LAYOUTS.items():
        d = str(tmp_path_factory.mktemp(f"slime-source-pp{pp}-cp{cp}-dp{dp}"))
        common = ["--pp", str(pp), "--cp", str(cp), "--scenarios", ",".join(scenarios)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp * cp * dp),
               DRIVER, "--out", d, *common, "--slime-source", SRC]
        gallery.remember_run(d, cmd)
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        seconds = time.monotonic() - t0
        r = subprocess.run([sys.executable, DRIVER, "--reference", d, *common], capture_output=True, text=True,
                           timeout=300, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        out[(pp, cp, dp)] = dict(dir=d, seconds=round(seconds, 1))
    return out


def test_manifest_names_the_scripts_files_and_no_stand_in_is_real():
    """The manifest's real files are what scripts/slime-src.sh materialises at its commit, and none of them is
    also a stand-in (the driver would refuse it too); every stand-in the manifest names exists."""
    assert len(COMMIT) == 40
    with open(os.path.join(ROOT, "scripts", "slime-src.sh")) as f:
        script = f.read()
    assert f"HEAD_COMMIT={COMMIT}\n" in script
    head = script[script.index("HEAD_FILES=("):]
    head = head[:head.index("\n)\n")]
    assert head.split()[1:] == MANIFEST["real"]
    stand = os.path.join(HERE, "slime_head_stand_ins")
    for rel in MANIFEST["stand_ins"]:
        where = os.path.join(stand, rel) if rel.startswith("slime/") else os.path.join(stand, "site", rel)
        assert os.path.isfile(where), rel
        assert rel not in MANIFEST["real"], rel
    for folder, _, names in os.walk(os.path.join(stand, "slime")):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), stand)
            assert rel in MANIFEST["stand_ins"] and rel not in MANIFEST["real"], rel


# ---- the modules that ran are slime's, as read --------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[LIDS[lay] for lay in LAYOUTS])
def test_the_real_modules_ran(runs, layout):
    src = os.path.join(SRC, COMMIT)
    for scenario in LAYOUTS[layout]:
        for adapter in ("adapter",) if scenario in drv.SOURCE_PLANTS else ("adapter", "plain"):
            for r in range(world(layout)):
                with open(os.path.join(runs[layout]["dir"], scenario, adapter, f"result-rank{r}.json")) as f:
                    info = json.load(f)["real_src"]
                assert info["dir"] == os.path.abspath(src)
                assert sorted(info["real"]) == sorted(MANIFEST["real"])
                for rel in MANIFEST["real"]:
                    with open(os.path.join(src, rel), "rb") as f:
                        assert info["real"][rel] == hashlib.sha256(f.read()).hexdigest(), rel
                base = os.path.dirname(os.path.dirname(os.path.dirname(info["loaded"]["loss"])))   # <tmp>/slime
                for mod in ("initialize", "model", "data", "loss", "cp_utils"):
                    assert info["loaded"][mod] == os.path.join(base, "backends", "megatron_utils", f"{mod}.py")
                    assert not info["loaded"][mod].startswith(HERE)


# ---- (a) the audit changes nothing --------------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_audit_changes_nothing(runs, layout, scenario):
    a = os.path.join(runs[layout]["dir"], scenario, "adapter")
    p = os.path.join(runs[layout]["dir"], scenario, "plain")
    # the user's own init and step hooks ran after lossguard's (slime has one flag each: initialize.py:100-104,
    # model.py:557-561)
    for r, ja in enumerate(assert_same_runs(a, p, world(layout), drv.STEPS)):
        assert len(ja["grad_norm"]) == drv.STEPS and ja["lr"] < 0.01              # slime stepped all three steps
        with open(os.path.join(a, f"logged-rank{r}.json")) as f, open(os.path.join(p, f"logged-rank{r}.json")) as g:
            la, lp = json.load(f), json.load(g)
        assert la == lp, r                                             # what train logs (model.py:874-898)
        if ja["reported"][0]:                                          # the last stage's reduced losses
            assert ja["reported"][0]["ppo_kl"] == 0.0                  # step 0 on-policy: forward_only's log-probs
            assert ja["reported"][2]["loss"] == 0.0                    # step 2: no effective token
    logged = [json.load(open(os.path.join(a, f"logged-rank{r}.json"))) for r in range(world(layout))]
    assert sum(len(x) for x in logged) == drv.STEPS                # one rank logs, once a step (model.py:874-878)
    assert os.path.isdir(os.path.join(a, "captures")) and not os.path.exists(os.path.join(p, "captures"))


# ---- (b) the applied gradient -------------------------------------------------------------------------
def _close(ref, factor=1.0):
    want, got = ref["want"], ref["got"]
    assert sorted(want) == sorted(got)
    scale = max(float(v.abs().max()) for v in want.values())
    for name, w in want.items():
        torch.testing.assert_close(got[name].double(), w * factor, rtol=1e-5, atol=1e-6 * max(scale, 1e-30),
                                   msg=lambda m, name=name: f"{name}: {m}")
    return scale


@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, layout, scenario):
    """Step 0 (on-policy: the reference takes the policy term's gradient as the cross entropy's, ratio 1) to
    float32 precision — slime's head computes its log-probs in plain float32 (ppo_utils.py:718-770 @624b824), no
    bf16-rounded fused backward as at the history tier's commits — and step 2's zero gradient exactly; every
    effective token held by exactly one rank. Weights 1 % off fail the same comparison."""
    d = os.path.join(runs[layout]["dir"], scenario, "adapter")
    for n in (0, 2):
        ref = torch.load(os.path.join(d, f"ref-step{n}.pt"))
        for i, ((T, R, _, _), seen) in enumerate(zip(drv.SAMPLES[n], ref["seen"], strict=True)):
            assert seen.tolist() == [1 if T - R - 1 <= p < T - 1 else 0 for p in range(T)], (n, i, seen)
        scale = _close(ref)
        assert (scale > 0) == (N[n] > 0), (n, scale)
    ref = torch.load(os.path.join(d, "ref-step0.pt"))
    with pytest.raises(AssertionError):
        _close(ref, factor=1.01)


# ---- (c) the verdicts ---------------------------------------------------------------------------------
def _caps(runs, layout, scenario, step):
    return os.path.join(runs[layout]["dir"], scenario, "adapter", "captures", f"step{step:06d}")


@needs_bin
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[LIDS[lay] for lay in LAYOUTS])
def test_per_token_verdicts_name_slimes_own_bugs(runs, layout):
    rc, c, s = step_checks(_caps(runs, layout, "pt", 0))
    assert rc == 0 and c["weights"]["ok"] and c["entropy.weights"]["ok"] and c["kl.weights"]["ok"], c
    assert "slime" in s["matches"], s["matches"]
    rc, c, s = step_checks(_caps(runs, layout, "pt", 1))      # a fully masked sample: clamp_min(0, 1) = 1 counted
    assert rc == 1 and c["counts"]["ok"] is False and s["matches"][:1] == ["slime"], (c, s["matches"])
    rc, c, s = step_checks(_caps(runs, layout, "pt", 2))      # no effective token, and slime steps
    assert rc == 1 and c["decision"]["ok"] is False and "expected skip" in c["decision"]["detail"], c


@needs_bin
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[LIDS[lay] for lay in LAYOUTS])
def test_sample_mean_is_slimes_per_rollout_mean(runs, layout):
    for n in (0, 1):
        rc, c, s = step_checks(_caps(runs, layout, "sm", n))
        assert rc == 0 and c["weights"]["ok"] and c["entropy.weights"]["ok"], (n, c)
    rc, c, s = step_checks(_caps(runs, layout, "sm", 2))
    assert rc == 1 and c["decision"]["ok"] is False and "expected skip" in c["decision"]["detail"], c


# ---- (d) bugs planted around the real code ------------------------------------------------------------
@needs_bin
def test_planted_missing_cp_factor_is_named(runs):
    """``bug-cp``: slime's real loss_function with its loss divided by CP (slime before #990): at CP 2 every
    token weighs x1/2 — audit names a uniform, layout-dependent scale of 1/cp."""
    rc, c, s = step_checks(_caps(runs, (1, 2, 1), "bug-cp", 0))
    dg = s.get("diagnosis") or {}
    assert rc == 1 and c["weights"]["ok"] is False, c
    assert dg.get("kind") == "uniform-scale" and dg.get("layout_dependent") is True, dg
    assert dg["scale"] == pytest.approx(0.5, rel=1e-6), dg
    assert "cp" in dg["named"].replace("(", " ").replace("/", " ").split(), dg["named"]


@needs_bin
def test_planted_per_sample_denominators_are_named(runs):
    """``bug-denoms``: slime's real get_sum_of_sample_mean called without the rollout's mask totals (each sample
    over its own count): the step's two-sample rollouts weigh per sample — the weights check fails, naming it."""
    rc, c, s = step_checks(_caps(runs, (1, 1, 2), "bug-denoms", 0))
    assert rc == 1 and c["weights"]["ok"] is False and "per-sample" in c["weights"]["detail"], c
    rc, c, s = step_checks(_caps(runs, (1, 1, 2), "sm", 0))          # the same step, unplanted, passes
    assert rc == 0 and c["weights"]["ok"] is True, c

