"""audit as a CI gate that never lies (issue: no false green, no false red, no crash).

Each case starts from correct captures written by the recorder itself (a DP 2 x CP 2 step, or a dynamic-CP
step, computed in one process exactly as each rank's trainer would: the per-token loss hooked, the loss
(l * m).sum() / N backpropagated) and then edits one file, as a user did when trying the gate adversarially.
Every edit that makes the step wrong must give a non-zero exit naming the place; the correct captures, in
float32 and in bfloat16, must pass.

    LOSSGUARD_BIN=build/cli/lossguard ~/.cache/lossguard/venv/bin/python -m pytest -q tests/audit/test_audit_gate.py
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
import lossguard_capture as lc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lossguard_cli import LOSSGUARD, audit  # noqa: E402,F401

# Five samples: lengths (T, R) and masks; sample 3 fully masked.
SAMPLES = [(9, 5, [1, 1, 0, 1, 1]), (7, 3, [1, 1, 1]), (12, 6, [0, 1, 1, 1, 1, 0]), (6, 2, [0, 0]),
           (10, 4, [1, 0, 1, 1])]
N = sum(sum(m) for _, _, m in SAMPLES)


def tokens_of(i):
    T = SAMPLES[i][0]
    return [(7 * i + k) % 50 + 1 for k in range(T)]


def write_step(out, dp, cp, layout, dtype=torch.float32, global_batch_size=None, l_norm=None,
               record_l_norm=True):
    """Records one step as every rank (d, c) would. layout[d] = list of micro-batches (cp_size, groups),
    groups[g] = the global sample indices CP sub-group g trains (cp / cp_size sub-groups). With ``l_norm``
    the trainer's objective is Dr.GRPO's seq-mean-token-sum-norm, (l * m).sum() / (B * l_norm)."""
    reduce = "per-token" if l_norm is None else "seq-mean-token-sum-norm"
    denominator = N if l_norm is None else len(SAMPLES) * l_norm
    gen = torch.Generator().manual_seed(0)
    for d in range(dp):
        for c in range(cp):
            # rank d * cp + c: Megatron's order gives it cp_rank c, dp_rank d
            cap = lc.Capture(out, reduce=reduce, cp=cp, dp=dp, rank=d * cp + c, world_size=dp * cp)
            with cap.step(0) as s:
                for cp_size, groups in layout[d]:
                    idx = groups[c // cp_size]
                    owned = [lc.zigzag_owned(SAMPLES[i][0], SAMPLES[i][1], cp_size, c % cp_size) for i in idx]
                    mask = torch.tensor([SAMPLES[i][2][j] for i, js in zip(idx, owned) for j in js], dtype=dtype)
                    h = s.microbatch(sample_indices=idx, tokens=[tokens_of(i) for i in idx],
                                     total_lengths=[SAMPLES[i][0] for i in idx],
                                     response_lengths=[SAMPLES[i][1] for i in idx],
                                     loss_masks=[SAMPLES[i][2] for i in idx], cp_size=cp_size)
                    per_token = (torch.rand(mask.numel(), generator=gen) * 3).to(dtype).requires_grad_()
                    h.hook(per_token)
                    loss = (per_token * mask).sum() / denominator
                    h.loss(loss)
                    loss.backward()
                s.finish(grad_scale=1.0, num_tokens_reduced=N, skipped=False, grad_norm=1.0,
                         global_batch_size=global_batch_size, l_norm=l_norm if record_l_norm else None)


STATIC = [[(2, [[0, 1]]), (2, [[2]])], [(2, [[3, 4]])]]                # DP 2 x CP 2, M = 2 / 1


def failed_checks(doc):
    return {c["name"]: c["detail"] for s in doc["steps"] for c in s["checks"] if c["ok"] is False}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate-good")
    write_step(str(out), 2, 2, STATIC)
    return out


def rewrite(d, rank, change, meta_change=None):
    """Edits rank's capture file in directory d in place: its tensors, then its metadata."""
    path = d / f"step000000-rank{rank:05d}.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    t = load_file(str(path))
    change(t)
    if meta_change:
        meta_change(meta)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path), metadata=meta)


def edited(good, tmp_path, rank, change, meta_change=None):
    d = tmp_path / "edited"
    shutil.copytree(good, d)
    rewrite(d, rank, change, meta_change)
    return d


def test_correct_captures_pass(good):
    code, doc, err = audit(good, "--strict-scale")
    assert code == 0, (doc, err)
    assert doc["steps"][0]["diagnosis"]["kind"] == "exact"


def test_correct_bf16_trainer_passes(tmp_path):
    """bf16 per-token losses and gradients: the recorder writes them as float32 and records dtype=bfloat16;
    audit's loss and weight tolerances follow it (a float32 1e-5 made this correct run fail)."""
    write_step(str(tmp_path), 2, 2, STATIC, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "step000000-rank00000.safetensors"), "pt") as f:
        assert f.metadata().get("dtype") == "bfloat16"
    code, doc, err = audit(tmp_path)
    assert code == 0, (failed_checks(doc) if doc else None, err)
    assert all(c["ok"] is not False for c in doc["steps"][0]["checks"])


def test_bf16_tolerance_still_sees_a_wrong_weight(tmp_path):
    """The wider bf16 tolerance (4 bf16 roundings) must not hide a 5% weight error on one token."""
    write_step(str(tmp_path), 2, 2, STATIC, dtype=torch.bfloat16)

    def bump(t):
        w = t["mb.0.token_weight"].clone()
        w[int(torch.nonzero(w)[0])] *= 1.05
        t["mb.0.token_weight"] = w
    rewrite(tmp_path, 1, bump)
    code, doc, _ = audit(tmp_path)
    assert code == 1 and "weights" in failed_checks(doc)


def first_nonzero(t, name):
    return int(torch.nonzero(t[name])[0])


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_token_weight_fails(good, tmp_path, value):
    def change(t):
        w = t["mb.0.token_weight"].clone()
        w[first_nonzero(t, "mb.0.token_weight")] = value
        t["mb.0.token_weight"] = w
    code, doc, err = audit(edited(good, tmp_path, 1, change))
    assert code == 1, err
    detail = failed_checks(doc)
    assert "weights" in detail or "coverage" in detail, detail
    assert "rank 1" in json.dumps(detail) and ("token_weight" in json.dumps(detail) or "non-finite" in json.dumps(detail))


@pytest.mark.parametrize("record", ["grad_scale", "mb.0.loss", "mb.0.token_loss"])
def test_non_finite_scale_and_losses_fail_naming_the_record(good, tmp_path, record):
    def change(t):
        v = t[record].clone()
        v.view(-1)[0] = float("inf")
        t[record] = v
    code, doc, err = audit(edited(good, tmp_path, 1, change))
    assert code == 1, err
    assert record.split(".")[-1] in json.dumps(failed_checks(doc)), failed_checks(doc)


def sparse_indices(d, world=4):
    """Renames every global sample index i to 10**12 + 7919 * i in every rank's captures (a sampler
    over a huge dataset): audit reads the indices as names, so nothing else may change."""
    for rank in range(world):
        def change(t):
            for k in [k for k in t if k.endswith(".sample_indices")]:
                t[k] = t[k] * 7919 + 10**12
        rewrite(d, rank, change)


def test_sparse_global_sample_indices_pass_like_dense_ones(good, tmp_path):
    d = tmp_path / "sparse"
    shutil.copytree(good, d)
    sparse_indices(d)
    code, doc, err = audit(d, "--strict-scale")
    assert code == 0, (doc, err)
    assert doc["steps"][0]["diagnosis"]["kind"] == "exact"


def test_a_sample_that_differs_between_ranks_is_named_by_its_sparse_index(good, tmp_path):
    d = tmp_path / "sparse-differs"
    shutil.copytree(good, d)
    sparse_indices(d)

    def change(t):  # rank 1 (DP 0, CP 1) sees another token in its first sample
        first = int(t["mb.0.sample_indices"][0])
        t["mb.0.tokens"][0] += 1
        change.first = first
    rewrite(d, 1, change)
    code, doc, err = audit(d)
    assert code == 2, (doc, err)
    assert f"sample {change.first} differs between" in err, err


def test_a_dropped_sample_fails_coverage(tmp_path):
    """global_batch_size says 6 samples; the captures hold 5."""
    write_step(str(tmp_path), 2, 2, STATIC, global_batch_size=len(SAMPLES) + 1)
    code, doc, err = audit(tmp_path)
    assert code == 1, err
    assert "dropped" in failed_checks(doc)["coverage"]


def test_captures_without_samples_verify_nothing(tmp_path):
    for r in range(2):
        with lc.Capture(str(tmp_path), rank=r, world_size=2).step(0) as s:      # DP 2: dp_rank r
            s.finish(grad_scale=0.5)
    code, doc, err = audit(tmp_path)
    assert code == 4, (code, err)
    assert "no sample" in err


def test_ranks_that_disagree_on_the_objective_are_an_input_error(good, tmp_path):
    d = edited(good, tmp_path, 3, lambda t: None, lambda m: m.update(reduce="sample-mean"))
    code, _, err = audit(d)
    assert code == 2 and "reduce" in err and "rank00000" in err and "rank00003" in err, err


def test_a_rank_outside_the_world_is_an_input_error(good, tmp_path):
    d = edited(good, tmp_path, 3, lambda t: None, lambda m: m.update(rank="77"))
    code, _, err = audit(d)
    assert code == 2 and "rank 77" in err and "world of 4" in err, err


def test_a_real_microbatch_marked_dummy_is_a_coverage_failure(good, tmp_path):
    def change(t):
        t["mb.0.dummy"] = torch.tensor(1, dtype=torch.int64)
    d = edited(good, tmp_path, 0, change)
    rewrite(d, 1, change)  # the CP peer says the same, so the layout itself is consistent
    code, doc, err = audit(d)
    assert code == 1, err
    assert "map::at" not in err
    assert "dummy" in failed_checks(doc)["coverage"]


def test_stray_microbatch_records_are_an_input_error(good, tmp_path):
    d = edited(good, tmp_path, 2, lambda t: None, lambda m: m.update(num_microbatches="0"))
    code, _, err = audit(d)
    assert code == 2 and "num_microbatches = 0" in err and "mb.0." in err, err


@pytest.mark.parametrize("groups", [
    [[0, 1], [1, 2]],           # one sample shared by the two sub-groups
    [[0, 1, 2], [1, 2]],        # one sub-group holds a subset of the other's samples
    [[0, 1, 2], [0, 1, 2]],     # both hold all
], ids=["share-one", "subset", "both-all"])
def test_dynamic_cp_sub_groups_sharing_a_sample_fail_coverage(tmp_path, groups):
    """CP 2, micro-batches at cp_size 1: the two CP ranks are two sub-groups that must train distinct samples.
    Sharing one is the bug the coverage check exists for; it used to crash audit (SIGSEGV / SIGABRT)."""
    layout = [[(1, groups)], [(2, [[3, 4]])]]
    write_step(str(tmp_path), 2, 2, layout)
    report = tmp_path / "report.json"
    r = subprocess.run([LOSSGUARD, "audit", str(tmp_path), "--json", str(report)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    doc = json.load(open(report))
    cov = failed_checks(doc)["coverage"]
    assert "placed twice" in cov and "sub-groups 0 and 1" in cov, cov


def test_dynamic_cp_with_distinct_sub_groups_passes(tmp_path):
    layout = [[(1, [[0, 1], [2]])], [(2, [[3, 4]])]]
    write_step(str(tmp_path), 2, 2, layout)
    code, doc, err = audit(tmp_path, "--strict-scale")
    assert code == 0, (failed_checks(doc) if doc else None, err)


def test_loss_not_recorded_names_what_is_missing(good, tmp_path):
    def change(t):
        for k in [k for k in t if k.endswith(".loss")]:
            del t[k]
    d = tmp_path / "noloss"
    shutil.copytree(good, d)
    for r in range(4):
        rewrite(d, r, change)
    code, doc, _ = audit(d)
    loss = next(c for c in doc["steps"][0]["checks"] if c["name"] == "loss")
    assert loss["ok"] is None and loss["detail"] == "not recorded (loss)", loss


def test_a_recorded_l_norm_is_the_objectives(tmp_path):
    """Dr.GRPO divides by B · L_norm with L_norm the trainer's constant (TRL's max_completion_length, here 10,
    longer than any response): recorded as l_norm, audit judges by it; not recorded, audit can only take the
    longest response (6) and sees a uniform scale 6/10."""
    write_step(str(tmp_path / "rec"), 2, 2, STATIC, l_norm=10)
    code, doc, err = audit(tmp_path / "rec", "--strict-scale")
    assert code == 0, (failed_checks(doc) if doc else None, err)
    write_step(str(tmp_path / "norec"), 2, 2, STATIC, l_norm=10, record_l_norm=False)
    code, doc, err = audit(tmp_path / "norec", "--strict-scale")
    assert code == 1 and doc["steps"][0]["diagnosis"]["kind"] == "uniform-scale", err
    assert abs(doc["steps"][0]["diagnosis"]["scale"] - 6 / 10) < 1e-6  # float32 weights


def test_ranks_that_disagree_on_l_norm_are_an_input_error(tmp_path):
    write_step(str(tmp_path), 2, 2, STATIC, l_norm=10)
    rewrite(tmp_path, 2, lambda t: t.__setitem__("l_norm", torch.tensor(12.0, dtype=torch.float64)))
    code, _, err = audit(tmp_path)
    assert code == 2 and "l_norm" in err and "rank00002" in err, err


# Loss terms (docs/semantics.md §11): a KL term hooked besides the main one, then edited as above.
KL_COEF = 0.1


def write_terms_step(out):
    gen = torch.Generator().manual_seed(1)
    terms = {"kl": dict(reduce="per-token", coef=KL_COEF, mask="loss")}
    for d in range(2):
        for c in range(2):
            cap = lc.Capture(out, cp=2, dp=2, rank=d * 2 + c, world_size=4, terms=terms)   # cp_rank c, dp_rank d
            with cap.step(0) as s:
                for cp_size, groups in STATIC[d]:
                    idx = groups[c // cp_size]
                    owned = [lc.zigzag_owned(SAMPLES[i][0], SAMPLES[i][1], cp_size, c % cp_size) for i in idx]
                    mask = torch.tensor([SAMPLES[i][2][j] for i, js in zip(idx, owned) for j in js],
                                        dtype=torch.float32)
                    h = s.microbatch(sample_indices=idx, tokens=[tokens_of(i) for i in idx],
                                     total_lengths=[SAMPLES[i][0] for i in idx],
                                     response_lengths=[SAMPLES[i][1] for i in idx],
                                     loss_masks=[SAMPLES[i][2] for i in idx], cp_size=cp_size)
                    main = (torch.rand(mask.numel(), generator=gen) * 3).requires_grad_()
                    kl = torch.rand(mask.numel(), generator=gen).requires_grad_()
                    h.hook(main)
                    h.hook(kl, term="kl")
                    loss = (main * mask).sum() / N + KL_COEF * (kl * mask).sum() / N
                    h.loss(loss)
                    loss.backward()
                s.finish(grad_scale=1.0, num_tokens_reduced=N, skipped=False, grad_norm=1.0)


@pytest.fixture(scope="module")
def good_terms(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate-terms")
    write_terms_step(str(out))
    return out


def test_terms_correct_captures_pass(good_terms):
    code, doc, err = audit(good_terms, "--strict-scale")
    assert code == 0, (failed_checks(doc) if doc else None, err)
    term = doc["steps"][0]["terms"][0]
    assert (term["name"], term["coef"], term["mask"], term["tokens"]) == ("kl", KL_COEF, "loss", N)
    assert term["diagnosis"]["kind"] == "exact"
    names = {c["name"]: c["ok"] for c in doc["steps"][0]["checks"]}
    assert names["kl.weights"] is True and names["kl.coverage"] is True and names["loss"] is True


@pytest.mark.parametrize("key,value,needle", [
    ("term.kl.coef", "nan", "term.kl.coef: coefficient 'nan' is not a finite number"),
    ("term.kl.coef", "1e999", "coefficient '1e999'"),
    ("term.kl.mask", "rolled", "unknown mask 'rolled'"),
    ("term.kl.reduce", "mean", "term.kl.reduce = 'mean'"),
    ("term.ent.reduce", "per-token", "names term 'ent', which metadata terms does not declare"),
    ("terms", "kl,Main", "term 'Main'"),
])
def test_terms_bad_declarations_exit_2_naming_term_file_and_field(good_terms, tmp_path, key, value, needle):
    d = edited(good_terms, tmp_path, 2, lambda t: None, lambda m: m.__setitem__(key, value))
    code, _, err = audit(d)
    assert code == 2, err
    assert needle in err and "rank00002" in err, err


def test_terms_record_of_the_wrong_length_exits_2(good_terms, tmp_path):
    def drop(t):
        t["mb.0.term.kl.token_weight"] = t["mb.0.term.kl.token_weight"][:-1].clone()
    d = edited(good_terms, tmp_path, 1, drop)
    code, _, err = audit(d)
    assert code == 2 and "term kl" in err and "token_weight" in err and "rank00001" in err, err


def test_terms_nonfinite_term_weight_fails(good_terms, tmp_path):
    def inf(t):
        w = t["mb.0.term.kl.token_weight"].clone()
        w[first_nonzero(t, "mb.0.term.kl.token_weight")] = float("inf")
        t["mb.0.term.kl.token_weight"] = w
    code, doc, _ = audit(edited(good_terms, tmp_path, 1, inf))  # rank 1 owns weighted KL tokens
    assert code == 1 and "not finite" in failed_checks(doc)["kl.weights"]


def test_terms_kl_off_by_a_factor_fails_relative_to_main(good_terms, tmp_path):
    d = tmp_path / "scaled"
    shutil.copytree(good_terms, d)
    for rank in range(4):
        def double(t):
            for k in [k for k in t if k.endswith("term.kl.token_weight")]:
                t[k] = t[k] * 2
        rewrite(d, rank, double)
    code, doc, _ = audit(d)  # a uniform scale of a term fails even without --strict-scale
    assert code == 1 and "kl.weights" in failed_checks(doc)
    diag = doc["steps"][0]["terms"][0]["diagnosis"]
    assert diag["kind"] == "uniform-scale" and abs(diag["scale"] - 2.0) < 1e-6


def test_terms_undeclared_weighted_term_fails_and_a_declared_unhooked_term_is_not_run(good_terms, tmp_path):
    d = tmp_path / "undeclared"
    shutil.copytree(good_terms, d)
    for rank in range(4):
        rewrite(d, rank, lambda t: None,
                lambda m: [m.pop(k) for k in [k for k in m if k == "terms" or k.startswith("term.")]])
    code, doc, _ = audit(d)
    assert code == 1 and "kl.declared" in failed_checks(doc), doc
    d2 = tmp_path / "unhooked"
    shutil.copytree(good_terms, d2)
    for rank in range(4):
        rewrite(d2, rank, lambda t: None, lambda m: m.update({"terms": "kl,ent"}))
    code, doc, _ = audit(d2)
    checks = {c["name"]: c for c in doc["steps"][0]["checks"]}
    assert code == 0 and checks["ent.weights"]["ok"] is None, checks
    assert "no rank hooked it" in checks["ent.weights"]["detail"]


def test_many_captures_are_read_in_parallel_and_the_first_broken_file_is_named(tmp_path):
    """80 rank captures (bench/audit_scale.py's generator, DP 40 x CP 2) are read on every core: they
    pass as written, and with two files truncated the error names the first of them in path order, as
    a sequential read would."""
    d = tmp_path / "many"
    build = os.path.dirname(os.path.dirname(os.path.abspath(LOSSGUARD)))
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "audit_scale.py"), build, "--dp", "40",
                    "--cp", "2", "--rounds", "1", "--keep", str(d)], check=True, capture_output=True)
    code, doc, err = audit(d)
    assert code == 0, (doc, err)
    for rank in (61, 17):
        path = d / f"step000000-rank{rank:05d}.safetensors"
        path.write_bytes(path.read_bytes()[:100])
    code, doc, err = audit(d)
    assert code == 2, (doc, err)
    assert "rank00017" in err and "rank00061" not in err, err


# ---- round 2 (the gate never lies): each case below was a false green, a false red, a crash or a
# hang found by an adversarial pass; every one starts from the correct DP 2 x CP 2 captures.

def every_rank(good, tmp_path, change, meta_change=None, world=4):
    d = tmp_path / "all-ranks"
    shutil.copytree(good, d)
    for rank in range(world):
        rewrite(d, rank, change, meta_change)
    return d


def scale_grad(factor):
    def change(t):
        t["grad_scale"] = t["grad_scale"] * factor
    return change


def test_gradient_ascent_fails_on_every_rank_alike(good, tmp_path):
    """grad_scale = -1 on every rank: every weight negated is gradient ascent, which Adam does not hide
    (it passed as 'uniform scale x-1')."""
    code, doc, err = audit(every_rank(good, tmp_path, scale_grad(-1.0)))
    assert code == 1, (doc, err)
    diag = doc["steps"][0]["diagnosis"]
    assert diag["kind"] == "negative-scale" and diag["scale"] == pytest.approx(-1.0), diag
    assert "gradient ascent" in failed_checks(doc)["weights"]


@pytest.mark.parametrize("factor,passes", [(3.0, True), (2.0 ** -9, True), (1e-30, False),
                                           (2.0 ** -11, False), (2.0 ** 63, True), (1e20, False)])
def test_a_uniform_scale_passes_only_where_adam_hides_it(good, tmp_path, factor, passes):
    """Adam fed gradients x s steps as Adam with eps/s (docs/semantics.md §9): hidden for
    2^-10 <= s <= 2^64; x1e-30 means no update at all and must fail, with the reason. The scales here are
    constants no product of the layout (DP 2, CP 2, M 2, B 5) makes: a layout product fails by default
    (the next test)."""
    code, doc, err = audit(every_rank(good, tmp_path, scale_grad(factor)))
    diag = doc["steps"][0]["diagnosis"]
    assert diag["kind"] == "uniform-scale" and diag["scale"] == pytest.approx(factor), diag
    if passes:
        assert code == 0 and diag["scale_problem"] is None, (diag, err)
        assert audit(every_rank(good, tmp_path / "strict", scale_grad(factor)), "--strict-scale")[0] == 1
    else:
        assert code == 1, (diag, err)
        assert ("Adam" in diag["scale_problem"]) == (factor < 1), diag["scale_problem"]
        assert "scale" in failed_checks(doc)["weights"]


def test_a_scale_the_layout_sets_fails_by_default_and_a_declared_coefficient_decides(good, tmp_path):
    """SPEC §9: x1/2 on a DP 2 x CP 2 step with M = 2 is 1/cp (or 1/dp, 1/M): at CP 1 the same step applies
    x2 this update (planted: grad_scale halved on every rank). It fails without --strict-scale, saying so;
    the same weights from a trainer that declares a loss coefficient 0.5 pass as that constant."""
    code, doc, err = audit(every_rank(good, tmp_path, scale_grad(0.5)))
    diag = doc["steps"][0]["diagnosis"]
    assert code == 1, (diag, err)
    assert diag["kind"] == "uniform-scale" and diag["layout_dependent"] is True, diag
    assert diag["named"].split(" or ") == ["1/cp", "1/dp", "1/M"], diag["named"]
    assert diag["same_step"] == "the same step at CP = 1 applies ×2 this update", diag
    assert "= 1/cp or 1/dp or 1/M: the same step at CP = 1 applies ×2 this update" in failed_checks(doc)["weights"]

    def declare(meta):
        meta["declared_scales"] = "policy_coef=0.5"
    code, doc, err = audit(every_rank(good, tmp_path / "declared", scale_grad(0.5), declare))
    diag = doc["steps"][0]["diagnosis"]
    assert code == 0 and diag["declared"] == "policy_coef = 0.5" and not diag["layout_dependent"], (diag, err)
    # A declaration that is not NAME=VALUE is an input error naming the file.
    def broken(meta):
        meta["declared_scales"] = "policy_coef"
    code, _, err = audit(every_rank(good, tmp_path / "broken", scale_grad(0.5), broken))
    assert code == 2 and "declared_scales" in err and "step000000-rank" in err, err


def test_a_claimed_world_of_2_to_the_40_is_refused_in_seconds(good, tmp_path):
    """Four small captures whose metadata claims DP 2^39 x CP 2: exit 2 at once naming the first
    missing coordinate (it grew to 22 GB, one string per missing pair)."""
    import time
    d = every_rank(good, tmp_path, lambda t: None,
                   lambda m: m.update(world_size=str(2 ** 40), dp=str(2 ** 39)))
    start = time.monotonic()
    code, _, err = audit(d)
    assert time.monotonic() - start < 20
    assert code == 2, err
    assert "DP 2 CP 0" in err and "more" in err and "claims DP 549755813888 x CP 2" in err, err
    d2 = every_rank(good, tmp_path / "over", lambda t: None,
                    lambda m: m.update(world_size=str(2 ** 62), dp=str(2 ** 61)))
    code, _, err = audit(d2)
    assert code == 2 and "at most 2^40" in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_or_pipe_is_refused_with_its_kind_not_opened(good, tmp_path):
    fifo = tmp_path / "p.safetensors"
    os.mkfifo(fifo)
    code, _, err = audit(fifo)  # audit() has a 120 s timeout: a blocking open() fails the test
    assert code == 2 and "pipe or FIFO" in err and "p.safetensors" in err, err
    r = subprocess.run(["bash", "-c", f'"{LOSSGUARD}" audit <(cat "{good}/step000000-rank00000.safetensors")'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pipe or FIFO" in r.stderr, r.stderr


def test_a_bf16_claim_the_values_contradict_keeps_float32_tolerance(good, tmp_path):
    """Float32 captures whose metadata claims bfloat16 on every rank, one token's weight x1.005: the
    claimed bf16 tolerance (7.8e-3) hid it; the values are no bf16 values, so float32's 1e-5 judges."""
    def bump(t):
        w = t["mb.0.token_weight"].clone()
        w[first_nonzero(t, "mb.0.token_weight")] *= 1.005
        t["mb.0.token_weight"] = w
    d = every_rank(good, tmp_path, lambda t: None, lambda m: m.update(dtype="bfloat16"))
    rewrite(d, 1, bump)
    code, doc, err = audit(d)
    assert code == 1 and "weights" in failed_checks(doc), (doc, err)
    kinds = [f["kind"] for f in doc["steps"][0].get("findings", doc.get("findings", []))]
    assert "dtype_claim" in json.dumps(doc), kinds


def test_a_misspelled_record_is_reported_and_an_error_under_strict(good, tmp_path):
    def change(t):
        t["skiped"] = torch.tensor(1, dtype=torch.int64)
    d = edited(good, tmp_path, 2, change)
    code, doc, err = audit(d)
    assert code == 0, err
    assert "unknown_record" in json.dumps(doc) and "skiped" in json.dumps(doc)
    code, _, err = audit(d, "--strict")
    assert code == 2 and "skiped" in err and "rank00002" in err, err


def test_global_batch_size_below_the_samples_held_is_a_finding(tmp_path):
    write_step(str(tmp_path), 2, 2, STATIC, global_batch_size=2)
    code, doc, err = audit(tmp_path)
    assert "global_batch_size_below_samples" in json.dumps(doc), doc


@pytest.mark.parametrize("skipped,scheduler,ok", [(0, 1, True), (0, 0, False), (None, 0, False)])
def test_the_lr_scheduler_advances_exactly_when_the_optimizer_steps(good, tmp_path, skipped, scheduler, ok):
    def change(t):
        t["scheduler_stepped"] = torch.tensor(scheduler, dtype=torch.int64)
        if skipped is None:
            t.pop("skipped", None)
    code, doc, err = audit(edited(good, tmp_path, 3, change))
    if ok:
        assert code == 0, (failed_checks(doc), err)
    else:
        assert code == 1 and "LR scheduler" in failed_checks(doc)["decision"], (doc, err)


# ---- slime's conventions (issue #39): whole-sample counts on every CP rank; per-rollout denominators ----
def write_slime_step(out, cp, counts="whole", reduced=None, denoms=None, weigh_by=None, sample_mean=False,
                     times_cp=True):
    """One micro-batch of samples 0-2 on every CP rank of a CP group (DP 1), recorded as slime's loss does it.
    Per-token: each CP rank's num_tokens is ``counts`` ('whole': the samples' whole count, slime; 'owned':
    the rank's own) and the loss is x cp, divided by N_reduced = ``reduced`` (default cp x N). Sample-mean:
    each sample over ``weigh_by[i]`` (default its own count) / B = 2 rollouts, ``denoms`` recorded."""
    idx = [0, 1, 2]
    whole = sum(sum(SAMPLES[i][2]) for i in idx)
    red = cp * whole if reduced is None else reduced
    reduce = "sample-mean" if sample_mean else "per-token"
    for c in range(cp):
        cap = lc.Capture(str(out), reduce=reduce, cp=cp, dp=1, rank=c, world_size=cp)
        with cap.step(0) as s:
            owned = [lc.zigzag_owned(SAMPLES[i][0], SAMPLES[i][1], cp, c) for i in idx]
            h = s.microbatch(sample_indices=idx, tokens=[tokens_of(i) for i in idx],
                             total_lengths=[SAMPLES[i][0] for i in idx], response_lengths=[SAMPLES[i][1] for i in idx],
                             loss_masks=[SAMPLES[i][2] for i in idx], cp_size=cp,
                             sample_denoms=denoms)
            mask = torch.tensor([SAMPLES[i][2][j] for i, js in zip(idx, owned) for j in js], dtype=torch.float64)
            per_token = torch.rand(mask.numel(), dtype=torch.float64).requires_grad_()
            h.hook(per_token)
            if sample_mean:
                by = weigh_by or [sum(SAMPLES[i][2]) for i in idx]
                scale = torch.tensor([1.0 / max(by[p], 1) for p, js in enumerate(owned) for _ in js], dtype=torch.float64)
                loss = (per_token * mask * scale).sum() / 2
            else:
                n_c = whole if counts == "whole" else int(mask.sum())
                h.set(num_tokens=n_c)
                loss = (per_token * mask).sum() * (cp if times_cp else 1)
            h.loss(loss)
            loss.backward()
            s.finish(grad_scale=1.0 if sample_mean else 1.0 / red, num_tokens_reduced=None if sample_mean else red,
                     skipped=False, grad_norm=1.0, global_batch_size=2 if sample_mean else None)


def test_whole_sample_counts_with_the_loss_times_cp_pass(tmp_path):
    write_slime_step(tmp_path, 2)
    code, doc, err = audit(tmp_path)
    assert code == 0, (failed_checks(doc), err)
    counts = [c for c in doc["steps"][0]["checks"] if c["name"] == "counts"][0]
    assert "whole samples" in counts["detail"]


@pytest.mark.parametrize("reduced_delta", [1, -1])
def test_whole_sample_counts_with_a_wrong_reduced_count_fail(tmp_path, reduced_delta):
    whole = sum(sum(SAMPLES[i][2]) for i in (0, 1, 2))
    write_slime_step(tmp_path, 2, reduced=2 * whole + reduced_delta)
    code, doc, err = audit(tmp_path)
    assert code == 1 and "cp x N" in failed_checks(doc)["counts"], (doc, err)


def test_whole_sample_counts_without_the_loss_times_cp_fail(tmp_path):
    """The convention holds only with the loss x cp: without it every weight is 1/cp of the truth (a scale Adam
    hides, so the weights check passes it) and counts must fail, naming the scale."""
    write_slime_step(tmp_path, 2, times_cp=False)
    code, doc, err = audit(tmp_path)
    assert code == 1 and "not those of the loss x cp" in failed_checks(doc)["counts"], (doc, err)


def test_owned_counts_with_a_cp_times_reduced_count_fail(tmp_path):
    """cp x N is accepted only from ranks that count whole samples: owned counts reduced to cp x N fail."""
    write_slime_step(tmp_path, 2, counts="owned")
    code, doc, err = audit(tmp_path)
    assert code == 1 and "num_tokens_reduced" in failed_checks(doc)["counts"], (doc, err)


def test_recorded_sample_denominators_are_the_objectives(tmp_path):
    """Samples 0 and 1 one rollout (mask total 4 + 3 = 7), sample 2 another (4): slime's per-rollout mean."""
    d = [7.0, 7.0, 4.0]
    write_slime_step(tmp_path / "rollout", 2, sample_mean=True, denoms=d, weigh_by=d)
    code, doc, err = audit(tmp_path / "rollout")
    assert code == 0, (failed_checks(doc), err)
    # the same weights recorded without the denominators: each sample over its own count is the truth
    write_slime_step(tmp_path / "undeclared", 2, sample_mean=True, weigh_by=d)
    code, doc, err = audit(tmp_path / "undeclared")
    assert code == 1 and "weights" in failed_checks(doc), (doc, err)
    # denominators recorded but the loss divided by the samples' own counts (a reducer without them)
    write_slime_step(tmp_path / "own", 2, sample_mean=True, denoms=d)
    code, doc, err = audit(tmp_path / "own")
    assert code == 1 and "weights" in failed_checks(doc), (doc, err)


def test_a_sample_with_two_denominators_is_an_input_error(tmp_path):
    write_slime_step(tmp_path, 2, sample_mean=True, denoms=[7.0, 7.0, 4.0], weigh_by=[7.0, 7.0, 4.0])
    rewrite(tmp_path, 1, lambda t: t.__setitem__("mb.0.sample_denoms", torch.tensor([7.0, 6.0, 4.0], dtype=torch.float64)))
    code, doc, err = audit(tmp_path)
    assert code == 2 and "sample_denoms" in err and "sample 1" in err, err


def test_a_batch_counted_in_rollouts_is_not_a_finding(tmp_path):
    """global_batch_unit = rollouts (slime, Relax): B below the samples held is by design; samples: a finding;
    another word, or ranks that disagree: an input error naming the file."""
    write_step(str(tmp_path), 2, 2, STATIC, global_batch_size=2)
    for r in range(4):
        rewrite(tmp_path, r, lambda t: None, lambda m: m.__setitem__("global_batch_unit", "rollouts"))
    code, doc, err = audit(tmp_path)
    assert "global_batch_size_below_samples" not in json.dumps(doc), doc
    rewrite(tmp_path, 3, lambda t: None, lambda m: m.__setitem__("global_batch_unit", "samples"))
    code, doc, err = audit(tmp_path)
    assert code == 2 and "global_batch_unit" in err, err
    rewrite(tmp_path, 3, lambda t: None, lambda m: m.__setitem__("global_batch_unit", "prompts"))
    code, doc, err = audit(tmp_path)
    assert code == 2 and "global_batch_unit = 'prompts' is not samples or rollouts" in err, err


@pytest.mark.skipif(not os.path.exists(LOSSGUARD), reason="needs the lossguard binary (build/cli/lossguard)")
def test_run_audit_takes_a_verdict_only_with_its_report(good, tmp_path):
    """A verdict stands only with the JSON report lossguard writes for it: a 'binary' that exits 0 without one
    (``true``, a wrapper that swallows the command) gives no verdict, and a stale report is not read as this
    run's; the real binary's PASS comes with its report."""
    json_path = str(tmp_path / "audit.json")
    res = lc.run_audit([str(good)], binary=LOSSGUARD, json_path=json_path)
    assert res.exit_code == 0 and res.passed, res.text
    with open(json_path) as f:
        assert json.load(f)["verdict"] == "pass"
    fake = tmp_path / "lossguard"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    with pytest.raises(lc.AuditError, match=r"exited 0 but it wrote no report at .*audit\.json: is it lossguard"):
        lc.run_audit([str(good)], binary=str(fake), json_path=json_path)      # the earlier report is not taken
    liar = tmp_path / "liar"
    liar.write_text("#!/bin/sh\nfor a; do last=$a; done\n"
                    "printf '{\"schema\": \"lossguard/1\", \"verdict\": \"fail\", \"exit_code\": 1}' > \"$last\"\n"
                    "exit 0\n")
    liar.chmod(0o755)
    with pytest.raises(lc.AuditError, match="says exit 1, the process exited 0"):
        lc.run_audit([str(good)], binary=str(liar), json_path=json_path)


def test_svg_draws_the_first_steps_ratios_from_the_result(good, tmp_path):
    """``--svg``: the measured/truth ratio per micro-batch and CP rank, as the library computed it (the renderer
    only reads the step's shard ratios and summary): every cell of a right step reads 1x; every weight x3 reads 3x
    in every cell, with the diagnosis line, and fails under --strict-scale."""
    svg = tmp_path / "right.svg"
    code, doc, err = audit(good, "--svg", str(svg))
    assert code == 0, err
    text = svg.read_text()
    assert text.startswith("<svg") and "measured (step 0)" in text and "CP rank 1" in text, text[:400]
    cells = re.findall(r'text-anchor="middle">([0-9.]+x)</text>', text)
    assert cells and set(cells) == {"1x"}, cells
    bad = tmp_path / "x3"
    shutil.copytree(good, bad)

    def triple(t):
        for k in [k for k in t if k.endswith(".token_weight")]:
            t[k] = t[k] * 3
    for r in range(4):
        rewrite(bad, r, triple)
    svg3 = tmp_path / "x3.svg"
    code, doc, err = audit(bad, "--svg", str(svg3), "--strict-scale")
    assert code == 1, (code, err)
    text3 = svg3.read_text()
    cells = re.findall(r'text-anchor="middle">([0-9.]+x)</text>', text3)
    assert cells and set(cells) == {"3x"}, cells
    assert "uniform" in text3, text3[:800]
