"""lossguard_capture.hf against the real transformers.Trainer (CPU, Gloo, a tiny Llama built from a config).

For every configuration (gradient accumulation 1/2/4, DP 1 and 2, average_tokens_across_devices on and
off, a model that accepts loss kwargs and one that does not) tests/trainers/hf_driver.py runs
``Trainer.train`` twice from the same seed, with the adapter and without; the tests prove

(a) the adapter changes nothing: every micro-batch's loss, and every gradient the optimizer receives,
    is bit for bit the same with and without it;
(b) the measured weights are the truth: ``sum_t w_t grad(l_t)`` with ``w_t = token_weight_t * grad_scale``
    from the captures (recomputed here in float64 from the captured tokens and the step's parameters)
    equals the gradient the Trainer's optimizer was about to apply (after backward and DDP);
(c) ``lossguard audit`` (when built) passes the correct configurations and fails the buggy ones naming
    their shape: ``hf-num-items`` (per-rank counts without average_tokens_across_devices), ``hf-ga``
    (per-micro-batch means of a model without loss kwargs; with a micro-batch that has no token, a
    uniform x1/M, which fails as a scale the layout sets), and ``norm=microbatch`` without the 1/M (a compute_loss
    override that drops num_items_in_batch);

and that fail-fast stops a buggy run at step 0, on every rank, before the optimizer step.

    scripts/setup-trainers.sh
    ~/.cache/lossguard/venv-hf/bin/python -m pytest -q tests/trainers
"""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DRIVER = os.path.join(HERE, "hf_driver.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import gallery  # noqa: E402  (docs/gallery.md's rows, when LOSSGUARD_GALLERY_DIR is set)
import hf_driver as drv  # noqa: E402

import lossguard_capture as lc  # noqa: E402
import lossguard_capture.hf as lhf  # noqa: E402
from harness import HAVE_BIN, LOSSGUARD, audit, child_env  # noqa: E402


DP1 = ["ga1-kw", "ga2-kw", "ga4-kw", "ga2-kw-noavg", "ga1-nokw", "ga2-nokw", "ga4-nokw", "ga2-kw-empty",
       "ga2-nokw-empty", "ga2-kw-dropnum"]
DP2 = ["ga1-kw", "ga2-kw", "ga4-kw", "ga1-kw-noavg", "ga2-kw-noavg", "ga1-nokw", "ga2-nokw", "ga4-nokw"]
CASES = [(1, c) for c in DP1] + [(2, c) for c in DP2]
IDS = [f"dp{w}-{c}" for w, c in CASES]


def expected(world, config):
    """(exit code, diagnosis kind, preset audit must name) — from the Trainer's arithmetic (hf.py docstring)."""
    ga, kw, avg, empty = drv.parse(config)
    if "dropnum" in config:     # a per-micro-batch mean the Trainer takes as scaled for GA: no / G
        return 1, "per-microbatch", "truth with norm=microbatch"
    if kw:
        if world == 1 or avg:
            return 0, "exact", None
        return 1, "per-rank", "hf-num-items"               # each rank divides by its own count
    if world == 1 and ga == 1:
        return 0, "exact", None                             # one micro-batch's mean is the per-token mean
    if empty:       # step 0's first micro-batch has no token: its mean is NaN with gradient 0, and the other
        return 1, "uniform-scale", "hf-ga"                  # holds every token at weight m/(n*M): x 1/M
    return 1, ("per-rank" if ga == 1 else "per-microbatch"), "hf-ga"


def _passing(world, configs):
    return ",".join(c for c in configs if expected(world, c)[0] == 0)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Both driver runs, one after the other (1 process, then 2 under torchrun): {world: out_dir}."""
    out = {}
    for world, configs in ((1, DP1), (2, DP2)):
        d = str(tmp_path_factory.mktemp(f"hf-dp{world}"))
        args = [DRIVER, "--out", d, "--configs", ",".join(configs)]
        if HAVE_BIN:      # the correct configurations also audit step 0 inside the run (fail-fast passes)
            args += ["--audit-in-run", _passing(world, configs), "--lossguard-bin", LOSSGUARD]
        if world == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
        gallery.remember_run(d, cmd)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env(quiet_warnings=False))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        out[world] = d
    return out


def run_dir(runs, world, config, which="adapter"):
    return os.path.join(runs[world], config, which)


def captures(runs, world, config, step):
    d = os.path.join(run_dir(runs, world, config), "captures", f"step{step:06d}")
    caps = []
    for r in range(world):
        path = os.path.join(d, f"step{step:06d}-rank{r:05d}.safetensors")
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        caps.append((load_file(path), meta))
    return caps


# ---- (a) the adapter changes nothing ---------------------------------------------------------------
@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_loss_and_gradient_bit_for_bit(runs, world, config):
    ga = drv.parse(config)[0]
    bits = lambda x: x.reshape(1).view(torch.int32)     # noqa: E731 - NaN == NaN, bit for bit
    for r in range(world):
        a = torch.load(os.path.join(run_dir(runs, world, config), f"losses-rank{r}.pt"))
        p = torch.load(os.path.join(run_dir(runs, world, config, "plain"), f"losses-rank{r}.pt"))
        assert len(a) == len(p) == ga * drv.STEPS
        for i, (x, y) in enumerate(zip(a, p)):
            assert x.dtype == y.dtype == torch.float32 and torch.equal(bits(x), bits(y)), (r, i, x.item(), y.item())
        for n in range(drv.STEPS):
            ga_ = torch.load(os.path.join(run_dir(runs, world, config), f"grads-step{n}-rank{r}.pt"))
            gp = torch.load(os.path.join(run_dir(runs, world, config, "plain"), f"grads-step{n}-rank{r}.pt"))
            for name in gp:
                assert torch.equal(ga_[name], gp[name]), (r, n, name, (ga_[name] - gp[name]).abs().max().item())


# ---- what the captures hold ------------------------------------------------------------------------
@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_capture_records(runs, world, config):
    ga, kw, avg, empty = drv.parse(config)
    data = drv.dataset(empty)
    by_ids = {tuple(s["input_ids"]): s for s in data}
    for n in range(drv.STEPS):
        caps = captures(runs, world, config, n)
        losses = [torch.load(os.path.join(run_dir(runs, world, config), f"losses-rank{r}.pt")) for r in range(world)]
        grads = torch.load(os.path.join(run_dir(runs, world, config), f"grads-step{n}-rank0.pt"))
        seen, rank_counts = set(), []
        for r, (t, meta) in enumerate(caps):
            assert meta == {"lossguard.schema": "audit/1", "trainer": "hf", "step": str(n), "rank": str(r), "world_size": str(world),
                            "tp": "1", "pp": "1", "cp": "1", "dp": str(world), "tp_rank": "0", "pp_rank": "0",
                            "cp_rank": "0", "dp_rank": str(r), "cp_layout": "zigzag", "reduce": "per-token",
                            "num_microbatches": str(ga), "dtype": "float32",
                            "loss_site": "transformers Trainer.compute_loss"}
            assert t["grad_scale"].item() == 1.0 / world          # DDP's mean
            assert t["global_batch_size"].item() == drv.BS * ga * world
            assert t["skipped"].item() == 0
            norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
            assert math.isclose(t["grad_norm"].item(), norm, rel_tol=1e-5)
            count = 0
            for k in range(ga):
                p = f"mb.{k}."
                idx = t[p + "sample_indices"].tolist()
                assert idx == [(k * world + r) * drv.BS + j for j in range(drv.BS)]
                assert not (set(idx) & seen)
                seen |= set(idx)
                T, R = t[p + "total_lengths"], t[p + "response_lengths"]
                assert (R == T - 1).all() and len(set(T.tolist())) == 1
                L = int(T[0])
                toks = t[p + "tokens"].view(-1, L)
                masks = t[p + "loss_masks"].view(-1, L - 1)
                for row, m in zip(toks.tolist(), masks.tolist()):
                    real = [x for x in row if x != drv.PAD]
                    assert row == real + [drv.PAD] * (L - len(real))
                    s = by_ids[tuple(real)]                        # a dataset sample, padded on the right
                    lab = s["labels"] + [-100] * (L - len(real))
                    assert m == [int(lab[j + 1] != -100) for j in range(L - 1)]
                count += int(masks.sum())
                assert "mb.%d.num_tokens" % k not in t            # the Trainer computes no per-micro-batch count
                # the recorded loss is the scalar training_step backpropagated
                want_loss = losses[r][n * ga + k].double().item()
                tw, tl = t[p + "token_weight"].double(), t[p + "token_loss"].double()
                assert (tw[masks.view(-1) == 0] == 0).all()
                if math.isnan(want_loss):                # a mean over no token: NaN value, zero gradient
                    assert math.isnan(t[p + "loss"].item()) and int(masks.sum()) == 0 and not tw.any()
                    assert not kw and empty and n == 0 and k == 0
                    continue
                assert t[p + "loss"].item() == want_loss
                assert math.isclose(t[p + "loss"].item(), float((tw * tl).sum()), rel_tol=1e-5, abs_tol=1e-7)
            rank_counts.append(count)
        N = sum(rank_counts)
        for r, (t, _) in enumerate(caps):
            if not kw:
                assert "num_tokens_reduced" not in t               # the Trainer passes no num_items_in_batch
            elif world == 1 or avg:
                assert t["num_tokens_reduced"].item() == N         # gathered over ranks
            else:
                assert t["num_tokens_reduced"].item() == rank_counts[r]   # this rank's own count


# ---- (b) the measured weights are the truth -----------------------------------------------------
def applied_and_weighted(runs, world, config, n, reweigh=lambda k, w: w):
    """Step n's applied gradient (rank 0's, after checking every replica holds the same) and
    sum_t w_t grad(l_t) with the measured weights (``reweigh(micro-batch, w)`` of them), w_t = token_weight_t *
    grad_scale, l_t = cross_entropy(logits[j], tokens[j+1]) recomputed in float64 on the step's parameters."""
    ga = drv.parse(config)[0]
    params = torch.load(os.path.join(run_dir(runs, world, config), f"params-step{n}-rank0.pt"))
    got = [torch.load(os.path.join(run_dir(runs, world, config), f"grads-step{n}-rank{r}.pt")) for r in range(world)]
    for r in range(1, world):                                  # DDP left every replica the same gradient
        assert all(torch.equal(got[r][k], got[0][k]) for k in got[0])
    model = drv.LlamaForCausalLM(drv.model_config()).double()
    model.load_state_dict({k: v.double() for k, v in params.items()})
    terms = []
    for t, _ in captures(runs, world, config, n):
        gs = t["grad_scale"].item()
        for k in range(ga):
            p = f"mb.{k}."
            L = int(t[p + "total_lengths"][0])
            toks = t[p + "tokens"].view(-1, L)
            w = reweigh(k, (t[p + "token_weight"].double() * gs).view(-1, L - 1))
            logits = model(input_ids=toks).logits                        # [B, L, V], float64
            lt = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, drv.VOCAB), toks[:, 1:].reshape(-1),
                                                   reduction="none").view(-1, L - 1)
            terms.append((w * lt).sum())
    torch.stack(terms).sum().backward()
    return got[0], {k: p.grad for k, p in model.named_parameters()}


def assert_same_gradient(got, want, what):
    scale = max(v.abs().max().item() for v in want.values())
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m: f"{what} {k}: {m}")


@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, world, config):
    """grad (after the Trainer's backward and DDP) == sum_t w_t grad(l_t) with the measured weights."""
    for n in range(drv.STEPS):
        got, want = applied_and_weighted(runs, world, config, n)
        assert_same_gradient(got, want, f"{config} dp{world} step {n}")


def test_gradient_check_rejects_wrong_weights(runs):
    """The identity fails when the weights are wrong: the first micro-batch's measured weights x 1.01 (at DP 1,
    GA 2, kwargs: every micro-batch holds effective tokens)."""
    got, want = applied_and_weighted(runs, 1, "ga2-kw", 0, lambda k, w: w * 1.01 if k == 0 else w)
    with pytest.raises(AssertionError):
        assert_same_gradient(got, want, "ga2-kw dp1 step 0, weights x 1.01")


# ---- (c) lossguard audit's verdicts ----------------------------------------------------------------
@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_audit_verdict(runs, world, config):
    want_code, want_kind, want_preset = expected(world, config)
    caps = os.path.join(run_dir(runs, world, config), "captures")
    steps = [os.path.join(caps, f"step{n:06d}") for n in range(drv.STEPS)]
    code, doc, err, text = audit(*steps)
    ga, kw, avg, empty = drv.parse(config)
    fields = dict(dp=world, ga=ga, model_accepts_loss_kwargs=kw, average_tokens_across_devices=avg,
                  first_microbatch_empty=empty, compute_loss_drops_num_items="dropnum" in config, config=config)
    gallery.record("hf", f"dp{world}-{config}", fields, [LOSSGUARD, "audit", *steps], code, doc, text, err)
    where = f"dp{world} {config}:\n{text}\n{err}"
    assert doc is not None, where
    assert code == want_code, where
    s0 = doc["steps"][0]
    assert s0["dtype"] == "float32", where
    assert s0["diagnosis"]["kind"] == want_kind, where
    checks = {c["name"]: c["ok"] for c in s0["checks"]}
    assert checks["coverage"] is True and checks["loss"] is True and checks["decision"] is True, where
    if want_preset is None:
        assert all(c["ok"] is not False for s in doc["steps"] for c in s["checks"]), where
        assert "truth" in s0["matches"], where
    elif want_kind == "uniform-scale":      # x1/M: set by the layout, so it fails by default (SPEC §9)
        g = drv.parse(config)[0]
        assert checks["weights"] is False and s0["diagnosis"]["named"] == "1/M", where
        assert s0["diagnosis"]["layout_dependent"] is True, where
        assert s0["diagnosis"]["same_step"] == (f"the same step at M = 1 (one micro-batch per DP rank) applies "
                                                f"×{g:g} this update"), where
        assert math.isclose(s0["diagnosis"]["scale"], 1 / g, rel_tol=1e-6), where
        assert want_preset in s0["matches"], where
        assert any(f["kind"] == "mean_over_zero_tokens" and f["step"] == 0 for f in doc["findings"]), where
        assert doc["steps"][1]["diagnosis"]["kind"] == "per-microbatch", where
    else:
        assert checks["weights"] is False, where
        assert want_preset in s0["matches"], where
        # the factor per unit in the Trainer's terms (hf.py docstring): each micro-batch's (or rank's) own
        # count n where the objective has N, then / M without loss kwargs (ga > 1), then DDP's / dp
        ga = drv.parse(config)[0]
        den = ["n"] + (["M"] if want_preset == "hf-ga" and ga > 1 else []) + (["dp"] if world > 1 else [])
        want_factor = "N/" + (den[0] if len(den) == 1 else "(" + "*".join(den) + ")")
        # where M = dp (ga = world) the two are one number: the diagnosis may name either
        same = {want_factor, want_factor.replace("dp", "M")} if ga == world else {want_factor}
        assert s0["diagnosis"]["factor"] in same, (where, s0["diagnosis"])
        assert s0["diagnosis"]["advice"].endswith("(in transformers Trainer.compute_loss)"), where
    if HAVE_BIN and want_code == 0:                      # the in-run fail-fast audit passed the same step
        meta = json.load(open(os.path.join(run_dir(runs, world, config), "meta-rank0.json")))
        assert meta["audit"]["0"]["exit_code"] == 0, meta["audit"]


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
def test_fail_fast_stops_the_buggy_run_on_every_rank(tmp_path):
    """A model without loss kwargs, GA 2, DP 2: rank 0's audit of step 0 FAILS (hf-ga); every rank raises
    AuditFailed before the optimizer step (parameters unchanged), and the job exits non-zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", DRIVER,
           "--out", str(tmp_path), "--fail-fast", "ga2-nokw", "--lossguard-bin", LOSSGUARD]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(quiet_warnings=False))
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "AuditFailed" in r.stderr
    for rank in range(2):
        with open(tmp_path / "ga2-nokw" / f"failfast-rank{rank}.json") as f:
            got = json.load(f)
        assert got["global_step"] == 0 and got["exit_code"] == 1, got
        assert got["params_unchanged"] is True, got
        assert "per-micro-batch normalisation" in got["text"] and "hf-ga" in got["text"], got["text"]
        assert "lossguard audit FAILED step 0" in got["message"]
        if rank == 0:
            gallery.record_failfast("hf", "dp2-ga2-nokw", dict(dp=2, ga=2, model_accepts_loss_kwargs=False,
                                                               config="ga2-nokw"), cmd, tmp_path, got)
    assert not (tmp_path / "ga2-nokw" / "adapter").exists()
    assert not (tmp_path / "ga2-nokw" / "captures" / "step000001").exists()


# ---- the adapter's guards, in this process -----------------------------------------------------------
def _tiny_trainer(tmp_path, **overrides):
    from transformers import TrainingArguments
    kw = dict(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=2, max_steps=1, optim="sgd",
              learning_rate=0.1, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
              disable_tqdm=True, remove_unused_columns=False, max_grad_norm=0.0)
    kw.update(overrides)
    return drv.Trainer(model=drv.make_model(True), args=TrainingArguments(**kw), train_dataset=drv.dataset()[:4],
                       data_collator=drv.collate)


def test_unsupported_version_names_the_range():
    with pytest.raises(RuntimeError, match=r"transformers>=5\.19\.0,<5\.26\.0.*transformers 4\.57\.1 is installed\."
                                           r".*nearest supported: 5\.19\.0"):
        lhf.check_version("4.57.1")
    with pytest.raises(RuntimeError, match=r"5\.18\.0: before 5\.19 .*gradient accumulation"):
        lhf.check_version("5.18.0")
    for v in ("5.26.0", "5.26.0.dev0", "5.19.0rc1", "6.0.0"):
        with pytest.raises(RuntimeError):
            lhf.check_version(v)
    for v in lhf.SPEC.verified:                              # every release the tests ran on is inside the gate
        lhf.check_version(v)
    assert {"5.19.0", "5.25.0"} <= set(lhf.SPEC.verified)
    with pytest.warns(UserWarning, match="supports"):
        lhf.check_version("5.30.0", allow_unsupported=True)
    lhf.check_version()                                      # the installed release is inside the range


def test_unsupported_configurations_refused(tmp_path):
    tr = _tiny_trainer(tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(RuntimeError, match="label_smoothing"):
        lhf.attach(tr, str(tmp_path / "c"))


def test_add_callback_finds_its_trainer(tmp_path):
    """trainer.add_callback(AuditCallback(...)) without attach(): the callback attaches itself when training
    begins; the capture is written, the Trainer's loss path is measured (weights 1/N)."""
    tr = _tiny_trainer(tmp_path)
    cb = lhf.AuditCallback(str(tmp_path / "caps"), fail_fast=False)
    tr.add_callback(cb)
    tr.train()
    assert cb.trainer is tr
    t = load_file(cb.paths[0])
    masks = t["mb.0.loss_masks"]
    N = int(masks.sum())
    assert t["num_tokens_reduced"].item() == N
    assert torch.equal(t["mb.0.token_weight"], masks.to(torch.float32) / N)
    assert torch.nn.functional.cross_entropy is not None and \
        torch.nn.functional.cross_entropy.__module__ == "torch.nn.functional"     # restored


@pytest.mark.parametrize("fail_fast", [True, False], ids=["fail-fast", "record-only"])
def test_a_loss_that_bypasses_cross_entropy_is_an_error(tmp_path, fail_fast, capsys):
    """A compute_loss_func that does not call F.cross_entropy cannot be measured: the step is dropped (no capture
    file); with fail fast auditing that step, a clear error stops the run; without, the same words as a warning
    and the run goes on, bit for bit the run without the adapter."""
    def custom(outputs, labels, num_items_in_batch=None):
        lp = torch.log_softmax(outputs.logits[:, :-1].float(), -1)
        tgt = labels[:, 1:]
        m = tgt != -100
        return -(lp.gather(-1, tgt.clamp_min(0)[..., None])[..., 0] * m).sum() / num_items_in_batch
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=1, optim="sgd",
                             use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False)
    def trainer():
        return drv.Trainer(model=drv.make_model(True), args=args, train_dataset=drv.dataset()[:4],
                           data_collator=drv.collate, compute_loss_func=custom)
    tr = trainer()
    cb = lhf.attach(tr, str(tmp_path / "caps"), fail_fast=fail_fast, lossguard_bin=LOSSGUARD)
    if fail_fast:
        with pytest.raises(RuntimeError, match="did not call torch.nn.functional.cross_entropy"):
            tr.train()
    else:
        tr.train()
        err = capsys.readouterr().err
        assert "did not call torch.nn.functional.cross_entropy" in err, err
        assert "this step is not measured and the run goes on (fail fast is off)" in err, err
        plain = trainer()
        plain.train()
        for (n, p), (_, q) in zip(tr.model.named_parameters(), plain.model.named_parameters()):
            assert torch.equal(p, q), n
    assert not cb.paths and not os.path.exists(tmp_path / "caps" / "step000000" / "step000000-rank00000.safetensors")


def test_fail_fast_without_a_binary_is_an_error_not_a_pass(tmp_path):
    """No verdict (here: no lossguard binary) stops the run with AuditError naming the cause; it never passes
    silently."""
    tr = _tiny_trainer(tmp_path)
    lhf.attach(tr, str(tmp_path / "caps"), lossguard_bin=str(tmp_path / "no-such-lossguard"))
    with pytest.raises(lc.AuditError, match="no-such-lossguard.*is not an executable file"):
        tr.train()
    assert os.path.exists(tmp_path / "caps" / "step000000" / "step000000-rank00000.safetensors")


# ---- custom losses: the forms users write, measured on the real Trainer (issue #43 item 1) -------------------
def _ce(*a, **k):
    return torch.nn.functional.cross_entropy(*a, **k)


def _shifted(outputs, labels):
    logits = outputs.logits[:, :-1]
    return logits, labels[:, 1:]


def _loss_forms():
    """name -> (compute_loss_func, right): each calls cross_entropy once as users write it."""
    def shift_sum(outputs, labels, num_items_in_batch=None):
        x, y = _shifted(outputs, labels)
        return _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="sum") / num_items_in_batch

    def none_then_sum(outputs, labels, num_items_in_batch=None):
        x, y = _shifted(outputs, labels)
        per_token = _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="none")
        return per_token.sum() / num_items_in_batch

    def logits_3d(outputs, labels, num_items_in_batch=None):
        x, y = _shifted(outputs, labels)
        return _ce(x.transpose(1, 2), y, reduction="sum") / num_items_in_batch

    def smoothing(outputs, labels, num_items_in_batch=None):
        x, y = _shifted(outputs, labels)
        return _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="sum", label_smoothing=0.1) / num_items_in_batch

    def ignore_minus_one(outputs, labels, num_items_in_batch=None):
        x, y = _shifted(outputs, labels)
        y = y.masked_fill(y == -100, -1)
        return _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1), ignore_index=-1, reduction="sum") / num_items_in_batch

    def module(outputs, labels, num_items_in_batch=None):
        x, y = _shifted(outputs, labels)
        return torch.nn.CrossEntropyLoss(reduction="sum")(x.reshape(-1, x.shape[-1]), y.reshape(-1)) / num_items_in_batch

    def microbatch_mean(outputs, labels, num_items_in_batch=None):      # buggy: a mean per micro-batch
        x, y = _shifted(outputs, labels)
        return _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1))

    def padded_length(outputs, labels, num_items_in_batch=None):        # buggy: over every padded position
        x, y = _shifted(outputs, labels)
        per_token = _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="none")
        return per_token.sum() / per_token.numel()
    return {"shift-sum": (shift_sum, True), "none-then-sum": (none_then_sum, True), "logits-3d": (logits_3d, True),
            "label-smoothing": (smoothing, True), "ignore-index-1": (ignore_minus_one, True),
            "CrossEntropyLoss": (module, True), "microbatch-mean": (microbatch_mean, False),
            "padded-length": (padded_length, False)}


FORMS = list(_loss_forms())


def _train_form(tmp_path, form, adapter, context=None):
    from transformers import TrainingArguments
    fn, _ = _loss_forms()[form]
    args = TrainingArguments(output_dir=str(tmp_path / f"o-{adapter}"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=0.1, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False, max_grad_norm=0.0, seed=drv.SEED)
    tr = drv.RecordingTrainer(model=drv.make_model(True), args=args, train_dataset=drv.dataset()[:8],
                              data_collator=drv.collate, compute_loss_func=fn, in_order=True)
    cb = lhf.attach(tr, str(tmp_path / "caps"), fail_fast=False) if adapter else None
    if context is None:
        tr.train()
    else:
        with context():
            tr.train()
    return tr, cb


@pytest.mark.parametrize("form", FORMS)
def test_custom_loss_forms_are_measured(tmp_path, form):
    """Each form on the real Trainer (GA 2): with the adapter bit for bit the run without it; the right forms'
    weights are exactly m_t / N and audit passes them; the buggy ones are measured as they are and failed."""
    plain, _ = _train_form(tmp_path / "plain", form, False)
    tr, cb = _train_form(tmp_path / "adapter", form, True)
    assert len(tr.step_losses) == len(plain.step_losses) == 2
    for a, b in zip(tr.step_losses, plain.step_losses):
        assert a.dtype == b.dtype and torch.equal(a, b), form
    for (n, p), (_, q) in zip(tr.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(p, q), n
    t = load_file(cb.paths[0])
    N = int(t["num_tokens_reduced"])
    right = _loss_forms()[form][1]
    for k in (0, 1):
        w, m = t[f"mb.{k}.token_weight"], t[f"mb.{k}.loss_masks"].to(torch.float32)
        if right:
            assert torch.equal(w, m / N), (form, k)
    if HAVE_BIN:
        code, doc, err, text = audit(os.path.dirname(cb.paths[0]))
        checks = {c["name"]: c for c in doc["steps"][0]["checks"]}
        assert code == (0 if right else 1), (form, checks["weights"]["detail"], err)
        if not right:
            assert checks["weights"]["ok"] is False and "normalisation" in checks["weights"]["detail"]


def _measured_like_plain(tr, cb, plain):
    """A GA-2 run with the adapter (``tr``, its callback ``cb``) against the same run without it: the losses and
    parameters bit for bit, every weight m_t / N, and audit passes."""
    for a, b in zip(tr.step_losses, plain.step_losses):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for (n, p), (_, q) in zip(tr.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(p, q), n
    t = load_file(cb.paths[0])
    N = int(t["num_tokens_reduced"])
    for k in (0, 1):
        assert torch.equal(t[f"mb.{k}.token_weight"], t[f"mb.{k}.loss_masks"].to(torch.float32) / N), k
    if HAVE_BIN:
        code, doc, err, text = audit(os.path.dirname(cb.paths[0]))
        assert code == 0, text + err


class _CountingMode(torch.overrides.TorchFunctionMode):
    """A TorchFunctionMode as FLOP counters and profilers install one: every torch function passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _flop_counter():
    """torch's own FLOP counter: a TorchDispatchMode (below autograd: every aten op of forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode
    return FlopCounterMode(display=False)


@pytest.mark.parametrize("context", [lambda: torch.device("cpu"), _CountingMode, _flop_counter],
                         ids=["torch.device", "mode", "FlopCounterMode"])
def test_a_run_inside_a_torch_function_mode_is_audited(tmp_path, context):
    """Under an active TorchFunctionMode (``with torch.device("cpu"): trainer.train()``, a FLOP counter) torch's
    cross_entropy re-dispatches through handle_torch_function by its module-global name, which the adapter has
    replaced for the micro-batch: the wrapper is entered twice for one call. The run is still measured: bit for
    bit the run without the adapter, weights m_t / N, audit passes (it refused step 0 with 'cross_entropy called
    2 times'). The same under torch's FlopCounterMode, a TorchDispatchMode that sees every aten op."""
    plain, _ = _train_form(tmp_path / "plain", "shift-sum", False, context)
    tr, cb = _train_form(tmp_path / "adapter", "shift-sum", True, context)
    _measured_like_plain(tr, cb, plain)


def _train_wrapped(tmp_path, adapter, **training):
    """The Trainer's own loss path (the model computes it from labels), GA 2, with TrainingArguments ``training``
    (gradient checkpointing, torch.compile)."""
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path / f"o-{adapter}"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=0.1, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False, max_grad_norm=0.0, seed=drv.SEED, **training)
    tr = drv.RecordingTrainer(model=drv.make_model(True), args=args, train_dataset=drv.dataset()[:8],
                              data_collator=drv.collate, in_order=True)
    cb = lhf.attach(tr, str(tmp_path / "caps"), fail_fast=False) if adapter else None
    tr.train()
    return tr, cb


@pytest.mark.parametrize("training", [dict(gradient_checkpointing=True),
                                      dict(torch_compile=True, torch_compile_backend="aot_eager")],
                         ids=["activation-checkpointing", "torch.compile"])
def test_a_run_under_checkpointing_or_compile_is_measured(tmp_path, training):
    """Activation checkpointing (the forward recomputed in backward) and torch.compile of the model (Dynamo
    traces the forward, the loss inside it): bit for bit the run without the adapter, weights m_t / N, audit
    passes."""
    plain, _ = _train_wrapped(tmp_path / "plain", False, **training)
    tr, cb = _train_wrapped(tmp_path / "adapter", True, **training)
    _measured_like_plain(tr, cb, plain)


def test_a_custom_loss_that_cannot_be_placed_says_what_to_change(tmp_path):
    """Two cross_entropy calls in one compute_loss, or targets that are not the labels shifted by one: refused
    (fail fast auditing the step: the run stops) with what lossguard can measure instead; nothing written."""
    def twice(outputs, labels, num_items_in_batch=None):
        x, y = _shifted(outputs, labels)
        a = _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="sum")
        return (a + _ce(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="sum")) / num_items_in_batch

    def unshifted(outputs, labels, num_items_in_batch=None):
        x = outputs.logits
        return _ce(x.reshape(-1, x.shape[-1]), labels.reshape(-1), reduction="sum") / num_items_in_batch
    for fn, needle in ((twice, "called 2 times"), (unshifted, "not the batch's labels as the logits predict them")):
        tr = _tiny_trainer(tmp_path)
        tr.compute_loss_func = fn
        cb = lhf.attach(tr, str(tmp_path / "caps"), fail_fast=True, lossguard_bin=LOSSGUARD)
        with pytest.raises(RuntimeError, match=needle) as e:
            tr.train()
        assert "compute the per-token losses in one call and reduce them yourself" in str(e.value)
        assert not cb.paths


# ---- the runnable example (examples/hf_trainer_audit.py) ---------------------------------------------------
@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("flag,rc,said", [("", 0, "training finished; step 0 audited: pass"),
                                          ("--no-loss-kwargs", 1, "training stopped at step 0 by lossguard audit")])
def test_the_example_runs(tmp_path, flag, rc, said):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_trainer_audit.py"), "--out",
                        str(tmp_path), "--lossguard-bin", LOSSGUARD, *([flag] if flag else [])],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == rc and said in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    with open(tmp_path / "audit-step000000.json") as f:                 # the report CI reads
        assert json.load(f)["exit_code"] == rc
