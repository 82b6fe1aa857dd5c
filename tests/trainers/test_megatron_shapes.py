"""lossguard_capture.megatron at the shapes Megatron-based RL trainers run (issue #38): pipeline stages (the
1F1B schedule), tensor parallelism with a vocabulary-parallel cross entropy, context parallelism, a loss
function over logits that hands its per-token losses to ``audit.per_token``, the LR scheduler, and the
loop's own skip decision (tests/trainers/megatron_shapes_driver.py runs them under torchrun, CPU, Gloo, on
the real megatron-core: 0.15.3, 0.16.0 or 0.16.1, whichever is installed).

The tests prove, at PP 2 x DP 2, PP 2 x CP 2, TP 2 x DP 2 and THD at CP 2 (slime's per-sample split, as a
packed stream and as owned tokens, and Relax's per-micro-batch CP size), each with an empty sample, a fully
masked micro-batch (DP 2) or samples shorter than 2 x CP and a CP rank that owns no token of a sample, and a
zero-token step:

(a) the adapter changes nothing: backpropagated losses, ``main_grad`` after finalize_model_grads, the
    optimizer's results, the learning rate and the parameters after the step are bit for bit those of the
    run without it;
(b) the applied gradient is ``sum_t w_t grad(l_t)`` with the measured weights ``w_t = token_weight_t x
    grad_scale`` (``l_t`` the float64 cross entropy of the whole model, its stages and TP shards assembled);
(c) every stage records its step records (the earlier stages no samples, the count finalize_model_grads
    broadcast to them, the scaling they applied, whether the optimizer and the LR scheduler stepped), and
    ``lossguard audit`` passes the right runs and names the planted bugs: a decision broadcast from the
    pipeline's first stage (every stage skips a non-empty step), a decision read from the 3-tuple's count
    without per-token loss (a fully masked step steps), TP replicas counted as DP ranks (a uniform 1/tp), a
    THD split off by one; a packed micro-batch handed over as rows is refused;
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
from importlib.metadata import version

import pytest
from lossguard_capture.megatron_cpu import no_cuda_build

with no_cuda_build():                     # megatron-core 0.15.x builds a CUDA allocator at import (megatron_cpu)
    pytest.importorskip("megatron.core")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DRIVER = os.path.join(HERE, "megatron_shapes_driver.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import gallery  # noqa: E402  (docs/gallery.md's rows, when LOSSGUARD_GALLERY_DIR is set)
import megatron_shapes_driver as drv  # noqa: E402
from harness import LOSSGUARD, child_env, needs_bin, same  # noqa: E402
from harness import audit_json as audit  # noqa: E402


#: (pp, tp, cp, dp) -> the scenarios run there
LAYOUTS = {
    (2, 1, 1, 2): ["pt", "pt-entropy", "global", "first-stage-src", "sample-count", "sample-count-ff"],
    (2, 1, 2, 1): ["pt", "global"],
    (1, 2, 1, 2): ["pt", "global", "tp-as-dp"],
    (1, 1, 2, 1): ["thd", "thd-owned", "thd-dyncp", "thd-dummy", "thd-off-by-one", "thd-unannounced",
                   "thd-split-off"],
    (2, 1, 1, 1): ["pt", "global"],             # with VPP: the interleaved schedule
}
#: layouts run with model chunks (virtual pipeline stages): the interleaved 1F1B schedule
VPP = {(2, 1, 1, 1): 2}


def lid(layout):
    p, t, c, d = layout
    return f"pp{p}-tp{t}-cp{c}-dp{d}" + (f"-vpp{VPP[layout]}" if layout in VPP else "")
RIGHT = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if s not in drv.PLANTED]
IDS = [f"{lid(lay)}-{s}" for lay, s in RIGHT]
N = [sum(sum(row[:-1]) for row in m) for m in drv.MASKS]          # each step's effective tokens: 9, 0
N_THD = [sum(sum(m) for _, _, m in samples) for samples in drv.THD_SAMPLES]      # 4, 0


def n_of(scenario, step):
    return (N_THD if scenario in drv.THD else N)[step]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    out = {}
    for (pp, tp, cp, dp), scenarios in LAYOUTS.items():
        d = str(tmp_path_factory.mktemp(f"shapes-pp{pp}-tp{tp}-cp{cp}-dp{dp}"))
        common = ["--pp", str(pp), "--tp", str(tp), "--cp", str(cp), "--vpp", str(VPP.get((pp, tp, cp, dp), 1)),
                  "--scenarios", ",".join(scenarios)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(pp * tp * cp * dp), DRIVER, "--out", d, *common]
        gallery.remember_run(d, cmd)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        r = subprocess.run([sys.executable, DRIVER, "--reference", d, *common], capture_output=True, text=True,
                           timeout=300, env=child_env())
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
        if scenario in drv.THD:
            # every response logit position (P-1 <= p < T-1) of every sample held by exactly one rank
            in_step = range(2) if scenario == "thd-dummy" else range(4)    # the dummy repeats samples 0-1
            for i, ((T, R, _), seen) in enumerate(zip(drv.THD_SAMPLES[n], ref["thd_seen"])):
                want_seen = [1 if T - R - 1 <= p < T - 1 and i in in_step else 0 for p in range(T)]
                assert seen.tolist() == want_seen, (i, T, R, seen)
            total = sum(float(w.sum()) for w in ref["thd_weights"])
        else:
            # every effective or masked response position held by exactly one loss rank; the last never
            assert (ref["seen"][:, : drv.S - 1] == 1).all() and (ref["seen"][:, -1] == 0).all()
            total = float(ref["weights"].sum())
        assert total == pytest.approx(1.0 if n_of(scenario, n) else 0.0, rel=1e-6)
        scale = max(float(v.abs().max()) for v in want.values())
        assert (scale > 0) == (n_of(scenario, n) > 0)
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
        N_n = n_of(scenario, n)
        scales = {float(t["grad_scale"]) for t, _ in caps}
        assert len(scales) == 1, scales                      # every stage and rank applied one scaling
        for t, meta in caps:
            assert (int(meta["pp"]), int(meta["tp"]), int(meta["cp"]), int(meta["dp"])) == layout
            last = int(meta["pp_rank"]) == pp - 1
            assert int(meta["num_microbatches"]) == (drv.M if last else 0), meta
            assert not any(k.startswith("mb.") for k in t) or last
            assert t["skipped"].item() == (N_n == 0) and t["scheduler_stepped"].item() == (N_n > 0)
            if drv.SCENARIOS[scenario][0]:      # per-token: the count every stage received through finalize
                assert t["num_tokens_reduced"].item() == N_n
                assert float(t["grad_scale"]) == (float(1.0 / torch.tensor(N_n, dtype=torch.int32)) if N_n
                                                  else 1.0)
            else:
                assert "num_tokens_reduced" not in t and float(t["grad_scale"]) == 1.0 / (dp * cp)
            if scenario in drv.THD and last:    # the packed samples, whole, and each micro-batch's CP size
                for k in range(drv.M):
                    cpk = 1 if scenario == "thd-dyncp" and k == 1 else cp
                    assert t[f"mb.{k}.cp_size"].item() == cpk
                    assert t[f"mb.{k}.dummy"].item() == (scenario == "thd-dummy" and k == 1)
                    ids = t[f"mb.{k}.sample_indices"].tolist()
                    assert t[f"mb.{k}.total_lengths"].tolist() == [drv.THD_SAMPLES[n][i][0] for i in ids]
                    dummy = scenario == "thd-dummy" and k == 1              # its samples' masks zeroed
                    assert t[f"mb.{k}.loss_masks"].tolist() == [0 if dummy else x for i in ids
                                                                for x in drv.THD_SAMPLES[n][i][2]]
            if N_n > 0:
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
        assert (checks["counts"]["ok"] is True) == drv.SCENARIOS[scenario][0]


GALLERY = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss
           if s not in ("thd-unannounced", "thd-split-off", "sample-count-ff")]


@needs_bin
@pytest.mark.parametrize("layout,scenario", GALLERY,
                         ids=[f"{lid(lay)}-{s}" for lay, s in GALLERY])
def test_audit_of_both_steps(runs, layout, scenario):
    """Both steps in one audit (docs/gallery.md's rows): the right scenarios pass, each planted one fails."""
    pp, tp, cp, dp = layout
    caps = os.path.join(runs[layout], scenario, "adapter", "captures")
    steps = [os.path.join(caps, f"step{n:06d}") for n in range(drv.STEPS)]
    r = subprocess.run([LOSSGUARD, "audit", *steps, "--json", "-"], capture_output=True, text=True, timeout=120)
    text = subprocess.run([LOSSGUARD, "audit", *steps], capture_output=True, text=True, timeout=120).stdout
    doc = json.loads(r.stdout)
    per_token, kind, decision = drv.SCENARIOS[scenario]
    gallery.record("megatron_shapes", f"{lid(layout)}-{scenario}",
                   dict(pp=pp, tp=tp, cp=cp, dp=dp, vpp=VPP.get(layout, 1), scenario=scenario,
                        calculate_per_token_loss=per_token,
                        loss=kind, decision=decision, microbatches=drv.M), [LOSSGUARD, "audit", *steps],
                   r.returncode, doc, text, r.stderr)
    # tp-as-dp: x1/tp, a scale the layout sets, fails (SPEC §9)
    failing = ("first-stage-src", "sample-count", "thd-off-by-one", "tp-as-dp")
    assert r.returncode == (1 if scenario in failing else 0), text


@needs_bin
def test_a_passing_step_reads_in_ten_seconds(runs):
    """An exact step prints its checks and its verdict, not the list of every preset it also matches
    (--explain adds it; the JSON always has it)."""
    d = os.path.join(runs[(2, 1, 1, 2)], "pt", "adapter", "captures", "step000000")
    plain = subprocess.run([LOSSGUARD, "audit", d], capture_output=True, text=True, timeout=120).stdout
    explained = subprocess.run([LOSSGUARD, "audit", d, "--explain"], capture_output=True, text=True,
                               timeout=120).stdout
    assert "matches:" not in plain and "verdict: pass" in plain
    assert "  matches: truth, megatron-per-token" in explained
    assert explained.replace(explained[explained.index("  matches:"):].split("\n", 1)[0] + "\n", "") == plain
    assert "megatron-per-token" in audit(d)[1]["steps"][0]["matches"]


@needs_bin
def test_a_second_term_handed_over_with_per_token(runs, tmp_path):
    """pt-entropy: the loss function hands its per-token entropy over as the declared term ``entropy`` (coef
    -0.05, an entropy bonus); audit weighs it exactly — and fails it when the declared coefficient has the
    other sign (the captures' metadata changed, the measured weights not)."""
    d = os.path.join(runs[(2, 1, 1, 2)], "pt-entropy", "adapter", "captures", "step000000")
    code, doc, err = audit(d)
    c = checks_of(doc)[0]
    assert code == 0 and c["entropy.weights"]["ok"] is True and c["entropy.coverage"]["ok"] is True, err
    with safe_open(os.path.join(d, "step000000-rank00002.safetensors"), framework="pt") as h:
        meta = h.metadata()
    assert (meta["terms"], float(meta["term.entropy.coef"]), meta["term.entropy.reduce"]) == ("entropy", -0.05,
                                                                                               "per-token")
    flipped = tmp_path / "flipped"
    shutil.copytree(d, flipped)
    for f in os.listdir(flipped):
        path = str(flipped / f)
        with safe_open(path, framework="pt") as h:
            m = h.metadata()
        if "term.entropy.coef" in m:
            save_file(load_file(path), path, metadata=dict(m, **{"term.entropy.coef": "0.05"}))
    code, doc, err = audit(str(flipped))
    assert code == 1 and checks_of(doc)[0]["entropy.weights"]["ok"] is False, err


@needs_bin
def test_audit_names_a_decision_from_the_first_stage(runs):
    """The decision broadcast over the pipeline group from its first stage, which computes no loss: every
    stage skips the non-empty step 0 (9 tokens)."""
    d = os.path.join(runs[(2, 1, 1, 2)], "first-stage-src", "adapter", "captures")
    code, doc, err = audit(os.path.join(d, "step000000"))
    assert code == 1, err
    c = checks_of(doc)[0]
    assert c["decision"]["ok"] is False and c["weights"]["ok"] is True
    assert "rank 0 (pipeline stage 0 of 2) skipped (expected step: N = 9)" in c["decision"]["detail"]
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


def test_schedules(runs):
    """Each layout ran the schedule it names: 1F1B at PP 2, the interleaved one with model chunks, no
    pipelining at PP 1 (the driver records get_forward_backward_func()'s choice)."""
    for layout, d in runs.items():
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
        want = ("forward_backward_pipelining_with_interleaving" if layout in VPP else
                "forward_backward_pipelining_without_interleaving" if layout[0] > 1 else
                "forward_backward_no_pipelining")
        assert meta["schedule"] == want, (layout, meta)
        assert meta["megatron_core"] == version("megatron-core")


@needs_bin
def test_fail_fast_stops_every_stage_before_the_update(runs):
    """sample-count with fail fast on step 1 (the fully masked step the loop steps): on every rank of both
    stages optimizer.step() raises AuditFailed (exit 1) before the update — the parameters are those of the
    step's start — after each rank wrote its capture."""
    out = os.path.join(runs[(2, 1, 1, 2)], "sample-count-ff", "adapter")
    for r in range(4):
        with open(os.path.join(out, f"opt-rank{r}.json")) as f:
            steps = json.load(f)
        assert steps[0]["skipped"] is False and steps[0]["update_successful"] is True, r
        assert steps[1]["audit_failed"] == {"step": 1, "exit_code": 1} and steps[1]["params_unchanged"] is True, r
        assert steps[1]["lr"] == steps[0]["lr"], r                  # nor did the scheduler advance
    assert sorted(os.listdir(os.path.join(out, "captures"))) == ["audit-step000001.json", "step000001"]
    assert len(os.listdir(os.path.join(out, "captures", "step000001"))) == 4


@needs_bin
def test_audit_names_tp_replicas_counted_as_dp(runs):
    """N all-reduced over the whole world: every TP replica adds its rows again, w_t = m_t / (tp N)."""
    d = os.path.join(runs[(1, 2, 1, 2)], "tp-as-dp", "adapter", "captures", "step000000")
    code, doc, err = audit(d)
    s = doc["steps"][0]
    assert s["diagnosis"]["kind"] == "uniform-scale" and s["diagnosis"]["scale"] == pytest.approx(0.5)
    assert "1/tp" in s["diagnosis"]["named"].split(" or ")
    assert "tensor-parallel replicas counted as data-parallel ranks" in checks_of(doc)[0]["weights"]["detail"]
    assert code == 1                                  # x1/tp is set by the layout: it fails (SPEC §9)
    assert s["diagnosis"]["layout_dependent"] is True
    # the right run has no such finding
    _, good, _ = audit(os.path.join(runs[(1, 2, 1, 2)], "global", "adapter", "captures", "step000000"))
    assert good["steps"][0]["diagnosis"]["kind"] == "exact"


@needs_bin
def test_audit_names_a_thd_split_off_by_one(runs):
    """The trainer reads each packed token's mask one stream position late: weights land beside the tokens."""
    d = os.path.join(runs[(1, 1, 2, 1)], "thd-off-by-one", "adapter", "captures")
    code, doc, err = audit(os.path.join(d, "step000000"))
    assert code == 1, err
    assert checks_of(doc)[0]["weights"]["ok"] is False


def test_packed_micro_batch_given_as_rows_is_refused(runs):
    """A model called with THD packed_seq_params whose micro-batch reached the row-wise audit.loss_func:
    refused on every rank, nothing recorded."""
    d = os.path.join(runs[(1, 1, 2, 1)], "thd-unannounced", "adapter")
    for r in range(2):
        with open(os.path.join(d, f"guard-rank{r}.json")) as f:
            g = json.load(f)
        assert g["captures"] is False
        assert "the model was called with THD packed_seq_params but the micro-batch was given as [b, s] rows" \
            in g["error"] and "audit.packed_loss_func" in g["error"], g


def test_a_thd_split_off_by_one_is_refused(runs):
    """Each piece of each sample one position late in the packed stream the model was fed: packed_loss_func,
    given that stream, names the first sample and position that do not hold the sample's token; nothing is
    recorded."""
    d = os.path.join(runs[(1, 1, 2, 1)], "thd-split-off", "adapter")
    for r in range(2):
        with open(os.path.join(d, f"guard-rank{r}.json")) as f:
            g = json.load(f)
        assert g["captures"] is False
        assert "sample 0 (micro-batch position 0): the packed stream holds token" in g["error"], g
        assert f"CP rank {r} of 2 holds chunks {r} and {3 - r} of every sample" in g["error"], g


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


# ---- the runnable example (examples/megatron_audit.py) ------------------------------------------------------
@needs_bin
@pytest.mark.parametrize("bug", [False, True], ids=["per-token", "bug"])
def test_the_example_runs_and_says_its_verdict(tmp_path, bug):
    """examples/megatron_audit.py under torchrun (PP 2): PASS and the step applied; with --bug (a mean per
    micro-batch) audit FAILs and both stages raise AuditFailed before the update."""
    out = str(tmp_path / "captures")
    example = os.path.join(ROOT, "examples", "megatron_audit.py")
    env = child_env()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        example, "--out", out, "--lossguard-bin", LOSSGUARD, *(["--bug"] if bug else [])],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    with open(os.path.join(out, "audit-step000000.json")) as f:
        doc = json.load(f)
    c = checks_of(doc)[0]
    if bug:
        assert doc["verdict"] == "fail" and c["weights"]["ok"] is False and "megatron-mean" in doc["steps"][0]["matches"]
        # the presets that reproduce it: a Megatron run's own family only (metadata trainer = megatron) ...
        matches = doc["steps"][0]["matches"]
        assert all(m.startswith(("megatron-", "slime", "relax", "truth")) for m in matches), matches
        # ... every trainer's with --explain, the writing trainer's first ...
        _, explained, _ = audit(os.path.join(out, "step000000"), "--explain")
        every = explained["steps"][0]["matches"]
        assert set(matches) < set(every) and any(m.startswith("hf-") for m in every), every
        first_other = next(i for i, m in enumerate(every) if not m.startswith(("megatron-", "slime", "relax")))
        assert all(not m.startswith(("megatron-", "slime", "relax")) for m in every[first_other:]), every
        matches = every
        # ... and the same captures said to come from the HF Trainer name its bug with HF's presets first
        step = os.path.join(out, "step000000")
        for f in os.listdir(step):
            path = os.path.join(step, f)
            with safe_open(path, framework="pt") as h:
                meta = h.metadata()
            assert meta["trainer"] == "megatron"
            save_file(load_file(path), path, metadata=dict(meta, trainer="hf"))
        _, as_hf, _ = audit(step)
        assert sorted(as_hf["steps"][0]["matches"]) == sorted(matches)
        assert as_hf["steps"][0]["matches"][0].startswith("hf-"), as_hf["steps"][0]["matches"]
        assert sorted(x for x in r.stdout.splitlines() if x.startswith("rank")) == [
            f"rank {k}: AuditFailed before the update: lossguard audit FAILED step 0 (exit 1: fail):" for k in (0, 1)]
    else:
        assert doc["verdict"] == "pass" and c["weights"]["ok"] is True and c["stages"]["ok"] is True
        assert sorted(x for x in r.stdout.splitlines() if x.startswith("rank")) == [
            f"rank {k}: step 0 applied; audit {{0: 'pass'}}" for k in (0, 1)]
