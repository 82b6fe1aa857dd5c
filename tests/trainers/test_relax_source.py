"""Relax's REAL loss module (tests/trainers/relax_source_manifest.json, "tier": relax/backends/megatron/loss.py
@36882ca, cp_utils.py @55634da, the algorithm registry and policy losses, ppo_utils ...) and its real zero-token
skip (``_is_global_zero_token_step``, model.py @36882ca, transplanted into the shape's training step), run by
tests/trainers/slime_relax_driver.py --trainer relax --relax-src over megatron-core on CPU/Gloo with
lossguard_capture.relax switched on by Relax's own flags — the same checks as test_relax.py's shape tier:

(a) the audit changes nothing, bit for bit (reported metrics, gradient norms, main_grad, learning rate,
    parameters), and the real skip leaves the zero-token step alone (optimizer and scheduler);
(b) the applied gradient is sum over terms and tokens of w_t grad(l_t) with the measured weights — off-policy
    too, where l_t is the clipped surrogate at the rollout's old log-probs (x TIS, x OPSM), not the cross
    entropy (whose on-policy identity is shown rejected there);
(c) lossguard audit passes every step — policy_loss per token and per sample, Relax's ``sft`` (also chunked
    through ``lm_head_forward``: the logits never whole), the token-global estimator (reinforce_plus_plus: its
    mask-safe reducer; CP 1, as Relax allows), a CP size per micro-batch, an off-policy step whose clipping fires
    (``offp``), TIS with OPSM (``tis-opsm``), ``__loss_scale__`` as Relax's fully-async iterator sets it with a
    dummy micro-batch (``lscale``) — at CP 1 and CP 2 (PP 2 for the skip), and names the bugs planted around the
    real code (the CP=1 count of an empty response as 1 token; the skip decision broadcast from the pipeline's
    first rank; the iterator's scale from the real micro-batches alone);
(d) every loss type of the real ``loss_function``'s dispatch is measured here or refused at init.

No Relax code is in this repository: the files are read at run time from $LOSSGUARD_RELAX_SRC/<commit>/<path> —

    RELAX_GIT=/path/to/a/clone/of/Relax scripts/relax-src.sh /tmp/relax-src
    LOSSGUARD_RELAX_SRC=/tmp/relax-src ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q \\
        tests/trainers/test_relax_source.py

Without it every test skips, saying so.
"""
import ast
import hashlib
import json
import os
import sys
from types import SimpleNamespace

import pytest
from lossguard_capture.megatron_cpu import no_cuda_build

with no_cuda_build():                     # megatron-core 0.15.x builds a CUDA allocator at import (megatron_cpu)
    pytest.importorskip("megatron.core")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import slime_relax_driver as drv  # noqa: E402
from harness import needs_bin  # noqa: E402
from test_relax import (assert_audit_changes_nothing, assert_gradient_is_sum_of_measured_weights,  # noqa: E402
                        captures, run_layouts, step_checks)
from test_slime import world  # noqa: E402

with open(os.path.join(HERE, "relax_source_manifest.json")) as _f:
    MANIFEST = json.load(_f)
SRC = os.environ.get("LOSSGUARD_RELAX_SRC")
HOW = ("Relax's real source is read at run time from outside this repository: materialise it with "
       "`RELAX_GIT=/path/to/a/clone/of/Relax scripts/relax-src.sh DEST` (without RELAX_GIT it clones "
       f"{MANIFEST['upstream']}) and run with LOSSGUARD_RELAX_SRC=DEST")
#: (pp, cp, dp) -> scenarios (slime_relax_driver.RELAX_SCENARIOS). rpp (reinforce_plus_plus) at CP 1 only: Relax
#: declares the token-global estimators without CP (relax/algorithms/spec.py:267-297 @53a6045,
#: ``supports_context_parallel=False``, which "rejects both static CP sharding and dynamic CP at startup", L89-95)
LAYOUTS = {(1, 1, 2): ["pt", "sft", "sftc", "rpp", "offp", "tis-opsm", "lscale", "bug-clamp", "bug-lscale"],
           (1, 2, 1): ["pt", "sm", "sft", "sftc", "dyncp", "offp", "tis-opsm", "lscale"],
           (2, 1, 1): ["pt", "bug-src"]}
CP12 = [(1, 1, 2), (1, 2, 1)]
RIGHT = [(lay, s) for lay, ss in LAYOUTS.items() for s in ss if s not in drv.PLANTED]
IDS = [f"pp{p}-cp{c}-dp{d}-{s}" for (p, c, d), s in RIGHT]


def _missing_src():
    """Why LOSSGUARD_RELAX_SRC cannot serve the tier (None when it can)."""
    if not SRC:
        return f"LOSSGUARD_RELAX_SRC is not set: {HOW}"
    gone = [f"{e['commit'][:7]}:{e['path']}" for e in MANIFEST["tier"] + MANIFEST["transplants"]
            if not os.path.isfile(os.path.join(SRC, e["commit"], e["path"]))]
    if gone:
        return f"LOSSGUARD_RELAX_SRC={SRC} lacks {', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''}: {HOW}"
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    why = _missing_src()
    if why:
        pytest.skip(why)
    return run_layouts(tmp_path_factory, LAYOUTS, "relax-source", ["--relax-src", SRC])


def test_manifest_pins_every_file_by_commit_and_hash():
    for e in MANIFEST["tier"] + MANIFEST["transplants"]:
        assert len(e["commit"]) == 40 and len(e["sha256"]) == 64, e
    with open(os.path.join(HERE, "..", "..", "scripts", "relax-src.sh")) as f:
        assert "relax_source_manifest.json" in f.read()


# ---- the modules that ran are Relax's, as read ------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=[f"pp{p}-cp{c}-dp{d}" for p, c, d in LAYOUTS])
def test_the_real_modules_ran(runs, layout):
    for scenario in LAYOUTS[layout]:
        for adapter in ("adapter",) if scenario in drv.PLANTED else ("adapter", "plain"):
            for r in range(world(layout)):
                with open(os.path.join(runs[layout], scenario, adapter, f"result-rank{r}.json")) as f:
                    info = json.load(f)["real_src"]
                assert info["dir"] == os.path.abspath(SRC)
                for e in MANIFEST["tier"]:
                    assert info["real"][e["path"]] == e["sha256"], e["path"]
                    with open(os.path.join(SRC, e["commit"], e["path"]), "rb") as f:
                        assert hashlib.sha256(f.read()).hexdigest() == e["sha256"], e
                for mod in ("loss", "cp_utils"):    # loaded from the overlay, not the shape's package
                    assert not info["loaded"][mod].startswith(os.path.join(HERE, "relax_shape")), mod
                for t in MANIFEST["transplants"]:
                    real = os.path.join(os.path.abspath(SRC), t["commit"], t["path"])
                    assert info["transplanted"][f"{t['module']}.{t['function']}"] == real, t["function"]
                    if t["function"] == "_is_global_zero_token_step" and scenario not in ("bug-noskip", "bug-src"):
                        assert info["zero_token_skip"] == real         # those two replace or wrap it


# ---- (a) bit for bit, and Relax's skip ---------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_audit_changes_nothing(runs, layout, scenario):
    assert_audit_changes_nothing(runs, layout, scenario)


# ---- (b) the applied gradient ------------------------------------------------------------------------
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, layout, scenario):
    assert_gradient_is_sum_of_measured_weights(runs, layout, scenario)


# ---- (c) the verdicts ----------------------------------------------------------------------------------
@needs_bin
@pytest.mark.parametrize("layout,scenario", RIGHT, ids=IDS)
def test_relax_passes(runs, layout, scenario):
    for n in range(drv.STEPS):
        rc, c, s = step_checks(runs, layout, scenario, n)
        assert rc == 0, (n, {k: v["detail"] for k, v in c.items() if v["ok"] is False})
        assert c["metrics"]["ok"] is True and c["decision"]["ok"] is True


@needs_bin
def test_the_seeds_count_bug_planted_in_the_real_module_is_named(runs):
    lay = (1, 1, 2)
    assert step_checks(runs, lay, "bug-clamp", 0)[0] == 0      # no empty response: the clamp changes nothing
    rc, c, s = step_checks(runs, lay, "bug-clamp", 1)
    assert rc == 1 and c["counts"]["ok"] is False and s["matches"][:1] == ["relax-legacy"], (c, s["matches"])


@needs_bin
def test_the_real_skip_broadcast_from_a_group_local_source_is_named(runs):
    """The seed's bug 3 planted around the REAL _is_global_zero_token_step (its broadcast's ``src`` made the
    pipeline's first rank): stage 0 keeps its own decision and steps on the zero-token step."""
    lay = (2, 1, 1)
    for n in (0, 1):
        assert step_checks(runs, lay, "bug-src", n)[0] == 0
    rc, c, s = step_checks(runs, lay, "bug-src", 2)
    assert rc == 1 and c["decision"]["ok"] is False, c
    assert "pipeline stage 0 of 2) stepped (expected skip: N = 0)" in c["decision"]["detail"]


@needs_bin
def test_a_loss_scale_from_the_real_micro_batches_alone_is_named(runs):
    """Relax's iterator scales by k_global (the dummies counted, as Megatron divides by them): planted with
    k_local the update is 2/3 of the truth, which audit's weights check names; the zero-token step is unaffected."""
    lay = (1, 1, 2)
    for n in (0, 1):
        rc, c, s = step_checks(runs, lay, "bug-lscale", n)
        assert rc == 1 and c["weights"]["ok"] is False and "\u00d70.666667" in c["weights"]["detail"], c["weights"]
    assert step_checks(runs, lay, "bug-lscale", 2)[0] == 0


def _result(runs, layout, scenario, rank=0):
    with open(os.path.join(runs[layout], scenario, "adapter", f"result-rank{rank}.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("layout", CP12, ids=["cp1", "cp2"])
def test_sft_ran_chunked_through_lm_head_forward(runs, layout):
    """--sft-chunked-logits: Relax's sft_loss_function_chunked received the hidden states (width 16, the
    model's hidden size; the vocabulary is 32) and ran the output layer on each sample's owned response tokens
    in sub-chunks of at most 2 (sft_logits_chunk_size): ceil(n / 2) calls for a sample of n tokens on the rank."""
    import lossguard_capture as lc
    pp, cp, dp = layout
    widest = 0
    for r in range(world(layout)):
        seen = _result(runs, layout, "sftc", r)["sft_chunked"]
        assert seen["widths"] == [16] and seen["calls"] == drv.STEPS * drv.M, seen
        d, c = r // cp, r % cp                                    # ranks: CP fastest, then DP (PP 1)
        owned = [len(lc.zigzag_owned(T, R, cp, c)) for step in drv.SAMPLES
                 for i, (T, R, _, _) in enumerate(step) if i % dp == d]
        rows = seen["lm_head_rows"]
        assert max(rows) <= 2 and sum(rows) == sum(owned), (seen, owned)
        assert len(rows) == sum((n + 1) // 2 for n in owned), (seen, owned)
        widest = max(widest, max(rows))
    assert widest == 2          # some sample was longer than a sub-chunk on some rank: it was cut


@pytest.mark.parametrize("layout", CP12, ids=["cp1", "cp2"])
def test_the_off_policy_ratio_is_not_1_and_clipping_fires(runs, layout):
    """offp / tis-opsm: the ratio is the old policy's (clipping fires: pg_clipfrac > 0 on steps 0 and 1); TIS
    truncates some weights and OPSM masks some samples."""
    for scenario in ("offp", "tis-opsm"):
        rep = _result(runs, layout, scenario)["reported"]
        for n in (0, 1):
            assert rep[n]["pg_clipfrac"] > 0 and rep[n]["ppo_kl"] != 0, (scenario, n, rep[n])
            if scenario == "tis-opsm":
                assert rep[n]["tis_clipfrac"] > 0 and rep[n]["opsm_clipfrac"] > 0, (n, rep[n])


@pytest.mark.parametrize("layout", CP12, ids=["cp1", "cp2"])
def test_off_policy_gradient_is_not_the_cross_entropys(runs, layout):
    """The identity's reference must be the policy loss's own gradient off-policy: the on-policy one (every
    policy token's loss its cross entropy) is rejected on the off-policy steps, by far more than the tolerance."""
    for scenario in ("offp", "tis-opsm"):
        for n in (0, 1):
            ref = torch.load(os.path.join(runs[layout], scenario, "adapter", f"ref-step{n}.pt"))
            scale = max(float(v.abs().max()) for v in ref["want"].values())
            off = max(float((ref["got"][k].double() - w).abs().max()) for k, w in ref["want_cross_entropy"].items())
            assert off > 1e-2 * scale, (scenario, n, off, scale)


def test_reinforce_plus_plus_declares_no_context_parallel():
    """Why rpp runs at CP 1 only: Relax's registry (the real spec.py of the tier) says so."""
    why = _missing_src()
    if why:
        pytest.skip(why)
    spec = next(e for e in MANIFEST["tier"] if e["path"].endswith("algorithms/spec.py"))
    with open(os.path.join(SRC, spec["commit"], spec["path"])) as f:
        tree = ast.parse(f.read())
    found = {}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "AlgorithmSpec":
            kw = {k.arg: k.value for k in call.keywords}
            if "name" in kw and isinstance(kw["name"], ast.Constant):
                cp = kw.get("supports_context_parallel")
                found[kw["name"].value] = True if cp is None else cp.value
    assert found["reinforce_plus_plus"] is False and found["reinforce_plus_plus_baseline"] is False, found


def test_dynamic_cp_is_recorded(runs):
    sizes = {int(t[f"mb.{k}.cp_size"]) for t, m in captures(runs, (1, 2, 1), "dyncp", 0)
             for k in range(int(m["num_microbatches"]))}
    assert sizes == {1, 2}


# ---- (d) every loss type of the real dispatch: measured or refused --------------------------------------
def _dispatch(path):
    """The ``case`` strings of ``match args.loss_type`` in the real loss_function, and whether it branches on
    ``mtp_only_training`` before it."""
    with open(path) as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "loss_function")
    cases = [c.pattern.value.value for m in ast.walk(fn) if isinstance(m, ast.Match) for c in m.cases
             if isinstance(c.pattern, ast.MatchValue)]
    src = ast.unparse(fn)
    return cases, "mtp_only_training" in src, "task_type" in src, "recompute_loss_function" in src


def test_every_loss_type_of_the_real_dispatch_is_measured_or_refused():
    why = _missing_src()
    if why:
        pytest.skip(why)
    loss = next(e for e in MANIFEST["tier"] if e["path"].endswith("megatron/loss.py"))
    cases, mtp, task_type, recompute = _dispatch(os.path.join(SRC, loss["commit"], loss["path"]))
    assert set(cases) >= {"policy_loss", "value_loss", "sft", "custom_loss"}, cases
    sys.path.insert(0, os.path.join(HERE, "relax_shape"))
    import lossguard_capture.relax as lcr
    measured = {"policy_loss": [s for s in drv.RELAX_SCENARIOS if drv.RELAX_SCENARIOS[s].get("loss_type",
                                                                                            "policy_loss") == "policy_loss"],
                "sft": [s for s in drv.RELAX_SCENARIOS if drv.RELAX_SCENARIOS[s].get("loss_type") == "sft"],
                "custom_loss": ["per_token (docs/adapters/slime.md: a custom loss hands lossguard its per-token losses)"],
                "value_loss": ["the critic's loss: not a token-weighted policy objective (adapter skips the critic)"]}
    for case in cases:
        args = SimpleNamespace(loss_type=case, calculate_per_token_loss=True)
        refused = lcr.refusals(args)
        assert bool(refused) != bool(measured.get(case)), (case, refused, measured.get(case))
        if refused:
            with pytest.raises(RuntimeError, match=f"does not measure: --loss-type {case}"):
                lcr.RelaxAudit(lcr.RELAX, args, "unused")
    flags = [(mtp, dict(mtp_only_training=True)), (task_type, dict(loss_type="sft", task_type="seq_cls")),
             (recompute, dict(recompute_loss_function=True))]
    for present, extra in flags:
        assert present, extra                 # the real dispatch still reads the flag the adapter refuses
        assert lcr.refusals(SimpleNamespace(**{"loss_type": "policy_loss", **extra})), extra
