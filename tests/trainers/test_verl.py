"""lossguard_capture.verl against verl's own actor update (CPU, Gloo, DP 2 x 2 micro-batches), on every
release the adapter supports: 0.8.0, 0.9.0 and 0.9.1 (the pin).

tests/trainers/verl_driver.py runs verl's ``BaseEngine.train_batch`` / ``FSDPEngine.forward_backward_batch`` /
``FSDPEngine.optimizer_step`` with verl's ``losses.ppo_loss`` (policy loss, ``kl_penalty``, the entropy term,
``agg_loss``) for every ``loss_agg_mode`` and the policy losses that force one (``sapo``, ``geo_mean``), with
the KL and entropy terms, and with a term bug planted in verl's own KL aggregation (``-bug``), each twice
from the same seed, with the adapter and without.  One capture per rank and step holds every term: the
policy term as main, ``kl`` and ``entropy`` declared (SPEC §11).  The tests prove

(a) the adapter changes nothing: every micro-batch's loss and every applied gradient is bit for bit the same;
(b) the measured weights are verl's arithmetic, written out (:func:`verl_weight` — the formulas the
    report and docs/adapters/verl.md give), for every token, both steps, every term;
(c) they are the truth: ``sum_k sum_t w^k_t grad(l^k_t)`` over the main, KL and entropy terms (``l_t``
    recomputed in float64 with verl's own policy loss, ``kl_penalty`` and the model's entropy, ``agg_loss``
    replaced by the measured weights) equals the gradient the optimizer applied (after FSDP's mean over DP);
(d) what ``lossguard audit`` (when built) says about each configuration (docs/gallery.md): every declared
    term judged relative to the main term, the planted KL bug named as a failing ``kl.weights``;

and, in this process, that an unknown ``loss_agg_mode`` is a clear error with nothing recorded, which
registered policy losses aggregate with another mode than the configured one, and the adapter's guards.

    scripts/setup-trainers.sh
    ~/.cache/lossguard/venv-verl/bin/python -m pytest -q tests/trainers/test_verl.py

What differs per release is chosen from the installed verl's version (verl_driver.VERL), never from the
environment: ``token-sum`` is a configuration from 0.9.0 on (below it verl rejects the mode and the adapter
refuses it: :func:`test_token_sum_exists_from_0_9_0`; the config is not parametrized there); ``gspo`` forces
``seq-mean-token-mean`` up to 0.9.0 (:func:`test_which_policy_losses_force_a_mode`); ``dro`` exists from 0.9.0
on.  On verl < 0.9.1 without flash-attn the driver puts tests/trainers/cpu_stand_ins on ``sys.path``
(:func:`test_cpu_stand_in_bert_padding`, :func:`test_dense_layout_is_the_nested_one`).
"""
import json
import math
import os
import re
import subprocess
import sys
import warnings
from functools import partial

import pytest

pytest.importorskip("verl")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DRIVER = os.path.join(HERE, "verl_driver.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import gallery  # noqa: E402  (docs/gallery.md's rows, when LOSSGUARD_GALLERY_DIR is set)
import verl_driver as drv  # noqa: E402  (also installs the CPU platform)

import lossguard_capture as lc  # noqa: E402
import lossguard_capture.verl as lverl  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils import losses as verl_losses  # noqa: E402
from harness import HAVE_BIN, LOSSGUARD, audit  # noqa: E402


CONFIGS = list(drv.CONFIGS)


def terms_of(config):
    """The terms a config's captures hold: main (the policy term), kl (use_kl_loss), entropy (entropy_coeff)."""
    c = drv.CONFIGS[config]
    return ["main"] + (["kl"] if c["kl"] else []) + (["entropy"] if c["entropy"] else [])


#: each named term's coefficient as it enters verl's loss (losses.py:128 subtracts the entropy term)
COEF = {"main": 1.0, "kl": drv.KL_COEF, "entropy": -drv.ENT_COEF}
TERM_CASES = [(c, t) for c in CONFIGS for t in terms_of(c)]
TERM_IDS = [f"{c}-{t}" for c, t in TERM_CASES]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("verl"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(drv.DP), DRIVER,
           "--out", d]
    gallery.remember_run(d, cmd)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return d


def run_dir(runs, config, which="adapter"):
    return os.path.join(runs, config, which)


def step_dir(runs, config, step):
    return os.path.join(run_dir(runs, config), "captures", f"step{step:06d}")


def captures(runs, config, step):
    d = step_dir(runs, config, step)
    out = []
    for r in range(drv.DP):
        path = os.path.join(d, f"step{step:06d}-rank{r:05d}.safetensors")
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        out.append((load_file(path), meta))
    return out


def prefix(k, term):
    """The records of ``term`` in micro-batch k: ``mb.{k}.`` (main) or ``mb.{k}.term.NAME.``."""
    return f"mb.{k}." + ("" if term == "main" else f"term.{term}.")


def measured(runs, config, term, step):
    """{global sample index: (w [R] float64 = token_weight * grad_scale, rank, micro-batch)} of one term."""
    out = {}
    for r, (t, meta) in enumerate(captures(runs, config, step)):
        gs = t["grad_scale"].item()
        for k in range(int(meta["num_microbatches"])):
            p = f"mb.{k}."
            w = t[prefix(k, term) + "token_weight"].double() * gs
            off = 0
            for i, R in zip(t[p + "sample_indices"].tolist(), t[p + "response_lengths"].tolist()):
                out[i] = (w[off:off + R], r, k)
                off += R
            assert off == w.numel()
    return out


def microbatches(runs, config, step):
    """{(rank, micro-batch): global sample indices}.  verl dispatches contiguous DP chunks and, without
    use_dynamic_bsz, chunk_tensordict splits them in order; with it, rearrange_micro_batches groups them by
    length (the grouping is taken from the captures and checked to cover the rank's chunk)."""
    c = drv.CONFIGS[config]
    n = drv.GLOBAL_BATCH // drv.DP
    if not c["dynbsz"]:
        micro = c["micro"]
        return {(r, k): list(range(r * n + k * micro, r * n + (k + 1) * micro))
                for r in range(drv.DP) for k in range(n // micro)}
    out = {}
    for r, (t, meta) in enumerate(captures(runs, config, step)):
        for k in range(int(meta["num_microbatches"])):
            out[(r, k)] = t[f"mb.{k}.sample_indices"].tolist()
        assert sorted(i for (rr, _), v in out.items() if rr == r for i in v) == list(range(r * n, (r + 1) * n))
    return out


def verl_weight(config, samples, mbs, term="main"):
    """The weight of each response token of ``term`` in the applied gradient, as verl 0.9.1 computes it
    (the KL and entropy terms times their coefficient): {global index: tensor [R]}.  N = batch_num_tokens
    (all ranks), B = global_batch_size (every sample), m_i = the sample's mask sum, L_k = the longest
    response of the micro-batch, b_k its samples, n_k its mask sum, dp = 2.  The policy loss may force a
    mode (sapo) or aggregate none (geo_mean); the KL and entropy terms always use the configured mode
    (losses.py:125, :137)."""
    c = drv.CONFIGS[config]
    masks = [s["mask"].double() for s in samples]
    N = sum(float(m.sum()) for m in masks)
    B, dp = drv.GLOBAL_BATCH, drv.DP
    mode = c["mode"]
    if term == "main" and c["loss"] in lverl.forced_modes(str(drv.VERL)):
        mode = lverl.forced_modes(str(drv.VERL))[c["loss"]]              # sapo forces it (0.9.1 core_algos.py:1688)
    coef = COEF[term]
    out = {}
    for (r, k), idx in mbs.items():
        L_k = max(samples[i]["mask"].numel() for i in idx)
        n_k = sum(float(masks[i].sum()) for i in idx)
        for i in idx:
            m = masks[i]
            mi = float(m.sum())
            if term == "main" and c["loss"] == "geo_mean":   # torch.mean over the micro-batch's samples, no dp_size
                w = m / ((mi + 1e-8) * len(idx) * dp)
            elif term == "kl" and c["bug"] == "kl-microbatch-mean":   # the planted bug: the micro-batch's own mean
                w = m / (n_k * dp)
            elif mode == "token-mean":
                w = m / N
            elif mode == "token-sum":
                w = m.clone()
            elif mode == "seq-mean-token-sum":
                w = m / B
            elif mode == "seq-mean-token-mean":
                w = m / (B * (mi + 1e-8))
            elif mode == "seq-mean-token-sum-norm":
                L = c["lsf"] or (drv.R_PAD if c["layout"] == "dense" else L_k)
                w = m / (B * L)
            out[i] = coef * w
    return out


# ---- (a) the adapter changes nothing -----------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
def test_loss_and_gradient_bit_for_bit(runs, config):
    for r in range(drv.DP):
        a = torch.load(os.path.join(run_dir(runs, config), f"losses-rank{r}.pt"))
        p = torch.load(os.path.join(run_dir(runs, config, "plain"), f"losses-rank{r}.pt"))
        n_mb = sum(int(captures(runs, config, n)[r][1]["num_microbatches"]) for n in range(drv.STEPS))
        assert len(a) == len(p) == n_mb
        assert all(x.item() == y.item() for x, y in zip(a, p)), (a, p)
        for n in range(drv.STEPS):
            ga = torch.load(os.path.join(run_dir(runs, config), f"grads-step{n}-rank{r}.pt"))
            gp = torch.load(os.path.join(run_dir(runs, config, "plain"), f"grads-step{n}-rank{r}.pt"))
            for name in gp:
                assert torch.equal(ga[name], gp[name]), (r, n, name)


# ---- what the captures hold --------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
def test_capture_records(runs, config):
    c = drv.CONFIGS[config]
    named = terms_of(config)[1:]
    for n in range(drv.STEPS):
        samples = torch.load(os.path.join(run_dir(runs, config), f"batch-step{n}.pt"))
        N = sum(int(s["mask"].sum()) for s in samples)
        mbs = microbatches(runs, config, n)
        for r, (t, meta) in enumerate(captures(runs, config, n)):
            n_mb = sum(1 for (rr, _) in mbs if rr == r)
            reduce = lverl.CLAIMS[c["mode"]]
            want = {"lossguard.schema": "audit/1", "trainer": "verl", "step": str(n), "rank": str(r), "world_size": "2",
                    "tp": "1", "pp": "1", "cp": "1", "dp": "2", "tp_rank": "0", "pp_rank": "0",
                    "cp_rank": "0", "dp_rank": str(r), "cp_layout": "zigzag", "reduce": reduce,
                    "num_microbatches": str(n_mb), "dtype": "float32",
                    "loss_site": "verl workers/utils/losses.py ppo_loss (core_algos.agg_loss)"}
            if named:                     # every term declared with the capture's reduce, its coefficient, mask loss
                want["terms"] = ",".join(named)
                for name in named:
                    want.update({f"term.{name}.reduce": reduce, f"term.{name}.coef": repr(COEF[name]),
                                 f"term.{name}.mask": "loss"})
            assert meta == want
            assert math.isclose(t["grad_scale"].item(), 1 / drv.DP, rel_tol=1e-15)      # every term's
            assert t["num_tokens_reduced"].item() == N                       # batch_num_tokens
            assert t["global_batch_size"].item() == drv.GLOBAL_BATCH
            for k in range(n_mb):
                p = f"mb.{k}."
                idx = mbs[(r, k)]
                assert t[p + "sample_indices"].tolist() == idx
                assert t[p + "total_lengths"].tolist() == [samples[i]["prompt"].numel() + samples[i]["response"].numel()
                                                           for i in idx]
                assert t[p + "response_lengths"].tolist() == [samples[i]["response"].numel() for i in idx]
                assert torch.equal(t[p + "tokens"], torch.cat([torch.cat([samples[i]["prompt"], samples[i]["response"]])
                                                              for i in idx]))
                assert torch.equal(t[p + "loss_masks"], torch.cat([samples[i]["mask"] for i in idx]))
                assert f"{p}num_tokens" not in t                      # verl computes no per-micro-batch count
                assert sorted({x.split(".")[3] for x in t if x.startswith(p + "term.")}) == sorted(named)
                total = 0.0
                for term in terms_of(config):
                    q = prefix(k, term)
                    tw = t[q + "token_weight"]
                    assert tw.numel() == t[p + "loss_masks"].numel()
                    assert (tw[t[p + "loss_masks"] == 0] == 0).all()
                    assert f"{q}num_tokens" not in t
                    if c["loss"] == "geo_mean" and term == "main":
                        assert f"{p}token_loss" not in t              # not a weighted sum of per-token losses
                        total = None
                    elif total is not None:
                        total += float((tw.double() * t[q + "token_loss"].double()).sum())
                if total is not None:          # mb.loss: the whole scalar backpropagated, the sum over the terms
                    assert math.isclose(t[p + "loss"].item(), total, rel_tol=1e-5, abs_tol=1e-7)


# ---- (b) the weights are verl's formula --------------------------------------------------------------
@pytest.mark.parametrize("config,term", TERM_CASES, ids=TERM_IDS)
def test_weights_are_verls_formula(runs, config, term):
    for n in range(drv.STEPS):
        samples = torch.load(os.path.join(run_dir(runs, config), f"batch-step{n}.pt"))
        got = measured(runs, config, term, n)
        want = verl_weight(config, samples, microbatches(runs, config, n), term)
        assert sorted(got) == list(range(drv.GLOBAL_BATCH))
        for i, w in want.items():
            torch.testing.assert_close(got[i][0], w, rtol=2e-6, atol=0,
                                       msg=lambda m: f"{config} step {n} sample {i}: {m}")


# ---- (c) the measured weights are the truth ----------------------------------------------------------
def _padded(samples, key, width, dtype=torch.float64):
    out = torch.zeros(len(samples), width, dtype=dtype)
    for i, s in enumerate(samples):
        v = s[key] if key != "adv" else torch.full((s["mask"].numel(),), s["adv"])
        out[i, :v.numel()] = v.to(dtype)
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_gradient_is_sum_of_measured_weights(runs, config, monkeypatch):
    """grad (FSDP's DP mean of the micro-batch sums) == sum_k sum_t w^k_t grad(l^k_t) over every term (main,
    kl, entropy), l_t from verl's own policy loss, kl_penalty and the model's entropy in float64 on the
    step's parameters, agg_loss replaced by the measured weights (geo_mean: torch.mean replaced by the
    measured per-sample weights).  The measured weights already hold each term's coefficient."""
    c = drv.CONFIGS[config]
    W = drv.R_MAX
    for n in range(drv.STEPS):
        samples = torch.load(os.path.join(run_dir(runs, config), f"batch-step{n}.pt"))
        params = torch.load(os.path.join(run_dir(runs, config), f"params-step{n}.pt"))
        applied = torch.load(os.path.join(run_dir(runs, config), f"grads-step{n}-rank0.pt"))
        other = torch.load(os.path.join(run_dir(runs, config), f"grads-step{n}-rank1.pt"))
        assert all(torch.equal(applied[k], other[k]) for k in applied)
        model = drv.make_model().double()
        model.load_state_dict({k: v.double() for k, v in params.items()})
        rows, ents = [], []
        for s in samples:
            ids = torch.cat([s["prompt"], s["response"]])
            P, R = s["prompt"].numel(), s["response"].numel()
            rows.append(torch.nn.functional.pad(model.log_probs_flat(ids)[P - 1:P - 1 + R], (0, W - R)))
            ents.append(torch.nn.functional.pad(model.entropy_flat(ids)[P - 1:P - 1 + R], (0, W - R)))
        lp, ent = torch.stack(rows), torch.stack(ents)
        mask = _padded(samples, "mask", W, torch.int64).bool()
        weights = {}
        for term in terms_of(config):
            got = measured(runs, config, term, n)
            weights[term] = torch.stack([torch.nn.functional.pad(got[i][0], (0, W - got[i][0].numel()))
                                         for i in range(len(samples))])
        cfg = drv.actor_config(config)
        wpg = weights["main"]
        monkeypatch.setattr(core_algos, "agg_loss",
                            lambda loss_mat, loss_mask, loss_agg_mode, **kw: (loss_mat * wpg).sum())
        real_mean = torch.mean
        if c["loss"] == "geo_mean":       # per-sample weight g_i = sum_t w_t (= g_i m_i / (m_i + 1e-8))
            monkeypatch.setattr(torch, "mean", lambda x: (x * wpg.sum(-1)).sum())
        fn = core_algos.get_policy_loss_fn(c["loss"])
        total, _ = fn(old_log_prob=_padded(samples, "old_log_probs", W), log_prob=lp,
                      advantages=_padded(samples, "adv", W), response_mask=mask, loss_agg_mode=c["mode"], config=cfg,
                      rollout_is_weights=None)
        monkeypatch.setattr(torch, "mean", real_mean)
        if c["kl"]:
            kld = core_algos.kl_penalty(lp, _padded(samples, "ref_log_prob", W), cfg.kl_loss_type)
            total = total + (kld * weights["kl"]).sum()
            assert (weights["kl"] != 0).any()
        if c["entropy"]:
            total = total + (ent * weights["entropy"]).sum()
            assert (weights["entropy"] < 0).any() and (weights["entropy"] <= 0).all()     # a bonus: -coef
        total.backward()
        for k, p in model.named_parameters():
            scale = max(p.grad.abs().max().item(), 1e-30)
            torch.testing.assert_close(applied[k].double(), p.grad, rtol=1e-4, atol=1e-6 * scale,
                                       msg=lambda m: f"{config} step {n} {k}: {m}")
        monkeypatch.undo()


# ---- (d) lossguard audit -----------------------------------------------------------------------------
#: config -> (exit code, the main term's diagnosis kind(s), a preset or change audit must name, or None).
#: seq-mean-token-sum-norm: docs/semantics.md §9's truth is m_t / (B L_norm), L_norm the step's longest
#: response (9): -lsf is exact and -dense a uniform L_norm/R_pad = 0.75.  A lossguard build whose truth omits
#: the 1/B (m_t / L_norm, before the fix of oracle/weights/weights.cpp) reads both x 1/B: accepted too.
AUDIT = {
    "token-mean": (0, "exact", "verl-token-mean"),
    "token-mean-dense": (0, "exact", "verl-token-mean"),
    "token-sum": (0, "uniform-scale", "truth with norm=none"),
    "seq-mean-token-sum": (0, "exact", "truth"),
    "seq-mean-token-mean": (0, "uniform-scale", "relax"),
    "seq-mean-token-sum-norm": (1, "per-microbatch", None),
    "seq-mean-token-sum-norm-lsf": (0, ("exact", "uniform-scale"), None),
    "seq-mean-token-sum-norm-dense": (0, "uniform-scale", None),
    "sapo-token-mean": (1, "per-sample", None),
    "sapo-seq-mean-token-mean": (0, "uniform-scale", "relax"),
    "geo_mean": (1, "per-sample", None),
    "geo_mean-m3": (1, "per-sample", None),
    "geo_mean-dynbsz": (1, "per-sample", None),
    "token-mean-dynbsz": (0, "exact", "verl-token-mean"),
    "seq-mean-token-sum-norm-dynbsz": (1, "per-microbatch", None),
    "token-mean-kl": (0, "exact", "verl-token-mean"),
    "seq-mean-token-mean-kl": (0, "uniform-scale", "relax"),
    "token-mean-kl-entropy": (0, "exact", "verl-token-mean"),
    "seq-mean-token-mean-kl-entropy": (0, "uniform-scale", "relax"),
    "token-mean-kl-bug": (1, "exact", "verl-token-mean"),       # the main term is right; kl.weights fails
    # verl's fix in 0.9.1: gspo configured with token-mean was a per-sample mean before it, exact after
    "gspo-token-mean": (1, "per-sample", None) if drv.GSPO_FORCES_MODE else (0, "exact", "verl-token-mean"),
}
#: config -> the diagnosis of each named term relative to the main term (every term not listed: exact).
#: kl-microbatch-mean: coef m_t/(n_k dp) against coef m_t/N: N/(dp n_k), per micro-batch.
TERM_AUDIT = {"token-mean-kl-bug": {"kl": "per-microbatch"}}


def _fields(config, **extra):
    """The configuration's fields for docs/gallery.md's row (tests/trainers/gallery.py)."""
    c = drv.CONFIGS[config]
    return dict(config=config, term="pg", terms=terms_of(config), **c, dp=drv.DP, global_batch_size=drv.GLOBAL_BATCH,
                microbatches_per_rank=drv.GLOBAL_BATCH // drv.DP // c["micro"], response_pad=drv.R_PAD,
                longest_response=drv.R_MAX, kl_loss_coef=drv.KL_COEF if c["kl"] else None,
                kl_loss_type=drv.actor_config(config).kl_loss_type if c["kl"] else None,
                entropy_coeff=drv.ENT_COEF if c["entropy"] else None, claim=lverl.CLAIMS[c["mode"]], **extra)


def _step_dirs(runs, config):
    return [step_dir(runs, config, n) for n in range(drv.STEPS)]


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("config", CONFIGS)
def test_audit_verdict(runs, config):
    """One audit of the step's captures judges the main term and every declared term (relative to main)."""
    want_code, want_kind, want_match = AUDIT[config]
    code, doc, err, text = audit(*_step_dirs(runs, config))
    gallery.record("verl", f"{config}-pg", _fields(config), [LOSSGUARD, "audit", *_step_dirs(runs, config)],
                   code, doc, text, err)
    where = f"{config}:\n{text}\n{err}"
    assert doc is not None and code == want_code, where
    c = drv.CONFIGS[config]
    named = terms_of(config)[1:]
    term_want = TERM_AUDIT.get(config, {})
    main_fails = want_code != 0 and not term_want        # else the exit is the term's
    for n, s in enumerate(doc["steps"]):
        samples = torch.load(os.path.join(run_dir(runs, config), f"batch-step{n}.pt"))
        B, Bnz = drv.GLOBAL_BATCH, sum(1 for x in samples if x["mask"].any())
        N = sum(int(x["mask"].sum()) for x in samples)
        checks = {x["name"]: x["ok"] for x in s["checks"]}
        assert checks["coverage"] is True and checks["weights"] is (not main_fails), where
        assert checks["loss"] is (None if c["loss"] == "geo_mean" else True), where
        if lverl.CLAIMS[c["mode"]] in ("token-mean", "per-token"):
            assert checks["counts"] is True, where                     # num_tokens_reduced == N
        d = s["diagnosis"]
        assert d["kind"] in (want_kind if isinstance(want_kind, tuple) else (want_kind,)), where
        if want_match is not None:
            assert want_match in s["matches"], where
        scale = d.get("scale")
        if config == "token-sum":
            assert scale == N, where                                   # the sum over tokens: x N of per-token
        elif want_kind == "uniform-scale" and c["mode"] != "seq-mean-token-sum-norm":
            assert math.isclose(scale, Bnz / B, rel_tol=1e-6), where   # / all B samples, not the B' with tokens
        elif config == "seq-mean-token-sum-norm-lsf" and d["kind"] == "uniform-scale":
            assert math.isclose(scale, 1 / B, rel_tol=1e-6), where
        elif config == "seq-mean-token-sum-norm-dense":
            r = drv.R_MAX / drv.R_PAD
            assert math.isclose(scale, r, rel_tol=1e-6) or math.isclose(scale, r / B, rel_tol=1e-6), where
        # the declared terms: each over the loss mask, relative to the main term's scale
        terms = {t["name"]: t for t in s.get("terms", [])}
        assert sorted(terms) == sorted(named), where
        for name in named:
            t = terms[name]
            assert t["declared"] is True and t["hooked"] is True, where
            assert (t["reduce"], t["mask"], t["tokens"]) == (lverl.CLAIMS[c["mode"]], "loss", N), where
            assert math.isclose(float(t["coef"]), COEF[name], rel_tol=1e-12), where
            assert math.isclose(t["relative_to_main"], scale if d["kind"] == "uniform-scale" else 1.0,
                                rel_tol=1e-12), where
            assert checks[f"{name}.coverage"] is True and checks[f"{name}.counts"] is None, where   # no count
            kind = term_want.get(name, "exact")
            assert t["diagnosis"]["kind"] == kind, where
            assert checks[f"{name}.weights"] is (kind == "exact"), where
        if config == "token-mean-kl-bug":   # the KL term's ratio to the truth is N / (dp n_k) per micro-batch
            mbs = microbatches(runs, config, n)
            ratios = [N / (drv.DP * sum(int(samples[i]["mask"].sum()) for i in idx)) for idx in mbs.values()]
            dg = terms["kl"]["diagnosis"]
            assert math.isclose(dg["min_ratio"], min(ratios), rel_tol=1e-6), where
            assert math.isclose(dg["max_ratio"], max(ratios), rel_tol=1e-6), where
    # a term's bug is a finding of that term's normalisation, relative to main
    found = sorted({(f["term"], f["diagnosis"]) for f in doc["findings"] if f["kind"] == "term_normalisation"})
    assert found == sorted({(t, k) for t, k in term_want.items() if k != "exact"}), where


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("config,scale", [("seq-mean-token-mean", 1.0), ("sapo-token-mean", 1.0),
                                          ("sapo-seq-mean-token-mean", 1.0), ("geo_mean", 2.0), ("geo_mean-m3", 3.0),
                                          ("geo_mean-dynbsz", None)])
def test_audit_as_sample_mean(runs, config, scale):
    """verl's seq-mean-token-mean (and sapo's forced one) is lossguard's sample-mean exactly; geo_mean is
    sample-mean x B / (dp b_k): x M for micro-batches of equal size (no / M), per micro-batch otherwise. The
    x M moves with the number of micro-batches: a scale the layout sets, which fails (SPEC §9)."""
    code, doc, err, text = audit(*_step_dirs(runs, config), "--reduce", "sample-mean")
    gallery.record("verl", f"{config}-pg-as-sample-mean", _fields(config, reduce="sample-mean"),
                   [LOSSGUARD, "audit", *_step_dirs(runs, config), "--reduce", "sample-mean"],
                   code, doc, text, err)
    assert code == (0 if scale == 1.0 else 1), text + err
    for s in doc["steps"]:
        d = s["diagnosis"]
        if scale == 1.0:
            assert d["kind"] == "exact" and "truth" in s["matches"], text
        elif scale is None:
            assert d["kind"] == "per-microbatch", text
        else:
            assert d["kind"] == "uniform-scale" and math.isclose(d["scale"], scale, rel_tol=1e-6), text
            assert d["layout_dependent"] is True and "M" in d["named"].split(" or "), text
            assert "the same step at" in d["same_step"], text


#: the docs/semantics.md §9 contract that gives verl's weights, per config (None: no component expresses it;
#: the -dynbsz configs' layout is not contiguous, which `lossguard weights` cannot be told).  The KL and
#: entropy terms follow the configured mode: the same contract, times their coefficient.
_SEQ_MEAN = "sample=mean,scale=dp*1/B,grad=mean:dp"
CONTRACTS = {
    "token-mean": "verl-token-mean", "token-mean-dense": "verl-token-mean", "token-mean-kl": "verl-token-mean",
    "token-mean-kl-entropy": "verl-token-mean", "token-mean-kl-bug": "verl-token-mean",
    "token-sum": "norm=none,scale=dp,grad=mean:dp",
    "seq-mean-token-sum": "scale=dp*1/B,grad=mean:dp",
    "seq-mean-token-mean": _SEQ_MEAN, "seq-mean-token-mean-kl": _SEQ_MEAN, "seq-mean-token-mean-kl-entropy": _SEQ_MEAN,
    "sapo-token-mean": _SEQ_MEAN, "sapo-seq-mean-token-mean": _SEQ_MEAN,
    "gspo-token-mean": _SEQ_MEAN if drv.GSPO_FORCES_MODE else "verl-token-mean",
    "seq-mean-token-sum-norm": None,           # 1 / (B x the micro-batch's longest response): no component
    "seq-mean-token-sum-norm-lsf": f"scale=dp*1/B*1/{drv.LSF},grad=mean:dp",
    "seq-mean-token-sum-norm-dense": f"scale=dp*1/B*1/{drv.R_PAD},grad=mean:dp",
    "geo_mean": "count=samples,norm=microbatch,sample=mean,grad=mean:dp",
    "geo_mean-m3": "count=samples,norm=microbatch,sample=mean,grad=mean:dp",
}
CONTRACT_CASES = [(c, t) for c, t in TERM_CASES if CONTRACTS.get(c) and not (t == "kl" and drv.CONFIGS[c]["bug"])]


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("config,term", CONTRACT_CASES, ids=[f"{c}-{t}" for c, t in CONTRACT_CASES])
def test_contract_reproduces_the_weights(runs, config, term, tmp_path):
    """`lossguard weights --contract C` on the step's batch and verl's layout (DP 2, contiguous micro-batches)
    gives every measured weight (a named term's divided by its coefficient): C is the preset to name verl's
    mode by."""
    c = drv.CONFIGS[config]
    for n in range(drv.STEPS):
        samples = torch.load(os.path.join(run_dir(runs, config), f"batch-step{n}.pt"))
        path = tmp_path / f"batch{n}.json"
        path.write_text(json.dumps({"samples": [
            {"tokens": torch.cat([x["prompt"], x["response"]]).tolist(), "response_length": x["response"].numel(),
             "loss_mask": x["mask"].tolist()} for x in samples]}))
        mbs = drv.GLOBAL_BATCH // drv.DP // c["micro"]
        r = subprocess.run([LOSSGUARD, "weights", str(path), "--reduce", lverl.CLAIMS[c["mode"]], "--contract",
                            CONTRACTS[config], "--dp", str(drv.DP), "--microbatches", str(mbs), "--per-token", "--json",
                            "-"], capture_output=True, text=True, timeout=120)
        doc = json.loads(r.stdout)
        got = measured(runs, config, term, n)
        for smp in doc["steps"][0]["samples"]:
            torch.testing.assert_close(got[smp["index"]][0] / COEF[term],
                                       torch.tensor(smp["weights"], dtype=torch.float64),
                                       rtol=1e-6, atol=0, msg=lambda m: f"{config} {term} step {n}: {m}")


# ---- in this process: errors and guards -----------------------------------------------------------------
def _microbatch(config="token-mean", step=0):
    """Rank 0's first micro-batch of the driver's step-0 mini-batch, as forward_backward_batch hands it to
    the loss function (dp_size 1, batch_num_tokens and global_batch_size of those samples)."""
    model = drv.make_model()
    samples = drv.global_batch(step, model)[:drv.GLOBAL_BATCH // drv.DP]
    data = drv.rank_batch(samples + samples, 0, drv.CONFIGS[config]["layout"])      # this rank's half: samples
    mb = tu.chunk_tensordict(data, 2)[0]
    tu.assign_non_tensor(mb, dp_size=1, batch_num_tokens=int(sum(int(s["mask"].sum()) for s in samples[:3])),
                         global_batch_size=3)
    return model, mb


def _call(cap, loss_fn, model, mb, entropy=False):
    out = {"log_probs": model(mb["input_ids"])}
    if entropy:                          # as the engine's forward_step with calculate_entropy
        out["entropy"] = model.entropy(mb["input_ids"])
    loss, metrics = loss_fn(model_output=out, data=mb, dp_group=None)
    loss.backward()
    return loss


def test_unknown_loss_agg_mode_is_an_error_and_nothing_is_recorded(tmp_path):
    cfg = drv.actor_config("token-mean")
    object.__setattr__(cfg, "loss_agg_mode", "seq-mean")      # ActorConfig itself refuses it; bypassed here
    cap = lverl.VerlAdapter(str(tmp_path / "caps"), fail_fast=False)
    loss_fn = cap.wrap(partial(verl_losses.ppo_loss, config=cfg))
    model, mb = _microbatch()
    real = (verl_losses.agg_loss, core_algos.agg_loss, verl_losses.get_policy_loss_fn, verl_losses.kl_penalty,
            verl_losses.no_padding_2_padding, torch.mean)
    cap.begin_step(0, dp=1, dp_rank=0, rank=0, world_size=1)
    modes = ["token-mean"] + (["token-sum"] if drv.HAS_TOKEN_SUM else []) + [
        "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    with pytest.raises(ValueError, match=rf"unknown loss_agg_mode 'seq-mean'.*{re.escape(', '.join(modes))}; nothing "
                                         r"was recorded"):
        _call(cap, loss_fn, model, mb)
    assert cap._open is None and not os.path.exists(tmp_path / "caps")
    assert (verl_losses.agg_loss, core_algos.agg_loss, verl_losses.get_policy_loss_fn, verl_losses.kl_penalty,
            verl_losses.no_padding_2_padding, torch.mean) == real  # every wrapper removed


def test_a_policy_loss_passing_an_unknown_mode_is_an_error(tmp_path):
    """A (registered) policy loss that hands agg_loss a mode it does not know: the adapter's error, before
    verl's own ValueError, and no file."""
    @core_algos.register_policy_loss("lossguard_test_bad_mode")
    def bad(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
            rollout_is_weights=None):
        return core_algos.agg_loss(loss_mat=-advantages * log_prob, loss_mask=response_mask,
                                   loss_agg_mode="token-avg", **config.global_batch_info), {}
    try:
        cfg = drv.actor_config("token-mean")
        object.__setattr__(cfg, "policy_loss", drv.PolicyLossConfig(loss_mode="lossguard_test_bad_mode"))
        cap = lverl.VerlAdapter(str(tmp_path / "caps"), fail_fast=False)
        loss_fn = cap.wrap(partial(verl_losses.ppo_loss, config=cfg))
        model, mb = _microbatch()
        cap.begin_step(0, dp=1, dp_rank=0, rank=0, world_size=1)
        with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'token-avg'.*nothing was recorded"):
            _call(cap, loss_fn, model, mb)
        assert cap._open is None and not os.path.exists(tmp_path / "caps")
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("lossguard_test_bad_mode", None)


def test_wrap_without_attach_and_dp1(tmp_path):
    """The lower-level API (no engine): VerlAdapter + wrap + begin_step/finish_step; dp 1, one micro-batch,
    token-mean: w = m / N."""
    cap = lverl.VerlAdapter(str(tmp_path / "caps"), fail_fast=False)
    loss_fn = cap.wrap(partial(verl_losses.ppo_loss, config=drv.actor_config("token-mean")))
    model, mb = _microbatch()
    plain = partial(verl_losses.ppo_loss, config=drv.actor_config("token-mean"))
    want = plain(model_output={"log_probs": model(mb["input_ids"])}, data=mb, dp_group=None)[0]
    cap.begin_step(7, dp=1, dp_rank=0, rank=0, world_size=1)
    got = _call(cap, loss_fn, model, mb)
    assert got.item() == want.item()
    path = cap.finish_step(grad_scale=1.0)
    assert cap.paths == {7: path}
    t = load_file(path)
    m = t["mb.0.loss_masks"]
    assert t["num_tokens_reduced"].item() == int(m.sum())
    torch.testing.assert_close(t["mb.0.token_weight"], m.float() / int(m.sum()), rtol=1e-6, atol=0)
    assert t["mb.0.sample_indices"].tolist() == [0, 1, 2]
    assert not any(".term." in k for k in t)
    assert path.endswith(os.path.join("caps", "step000007", "step000007-rank00000.safetensors"))
    # outside a step the wrapper passes through
    assert _call(cap, loss_fn, model, mb).item() == want.item()


def test_terms_in_one_capture_dp1(tmp_path):
    """use_kl_loss and entropy_coeff: one capture, the policy term as main, kl and entropy declared with the
    capture's reduce, their coefficients (entropy: -entropy_coeff, losses.py:128) and mask loss; w = coef m/N
    for each; mb.loss the whole loss.  kl=False / entropy=False leave a term out; kl_loss_coef 0 warns."""
    config = "token-mean-kl-entropy"
    cfg = drv.actor_config(config)
    model, mb = _microbatch(config)
    want = partial(verl_losses.ppo_loss, config=drv.actor_config(config))(
        model_output={"log_probs": model(mb["input_ids"]), "entropy": model.entropy(mb["input_ids"])}, data=mb,
        dp_group=None)[0]
    for kw, named in (({}, ["kl", "entropy"]), ({"kl": False}, ["entropy"]), ({"entropy": False}, ["kl"])):
        cap = lverl.VerlAdapter(str(tmp_path / f"caps{len(kw)}{''.join(kw)}"), fail_fast=False, **kw)
        loss_fn = cap.wrap(partial(verl_losses.ppo_loss, config=cfg))
        model.zero_grad()
        cap.begin_step(0, dp=1, dp_rank=0, rank=0, world_size=1)
        assert _call(cap, loss_fn, model, mb, entropy=True).item() == want.item()
        path = cap.finish_step(grad_scale=1.0)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        assert meta["terms"] == ",".join(named)
        for name in named:
            assert (meta[f"term.{name}.reduce"], meta[f"term.{name}.mask"]) == ("token-mean", "loss")
            assert float(meta[f"term.{name}.coef"]) == COEF[name]
        t = load_file(path)
        m = t["mb.0.loss_masks"].float()
        for name in ["main"] + named:
            torch.testing.assert_close(t[prefix(0, name) + "token_weight"], COEF[name] * m / m.sum(), rtol=1e-6,
                                       atol=0)
        assert sorted({k.split(".")[3] for k in t if ".term." in k}) == sorted(named)
        if len(named) == 2:
            total = sum(float((t[prefix(0, x) + "token_weight"].double() * t[prefix(0, x) + "token_loss"]).sum())
                        for x in ["main"] + named)
            assert math.isclose(t["mb.0.loss"].item(), want.item(), rel_tol=1e-6)
            assert math.isclose(t["mb.0.loss"].item(), total, rel_tol=1e-5)
    object.__setattr__(cfg, "kl_loss_coef", 0.0)
    object.__setattr__(cfg, "entropy_coeff", 0.0)        # an entropy computed for the metrics only: no term
    cap = lverl.VerlAdapter(str(tmp_path / "caps-zero"), fail_fast=False)
    loss_fn = cap.wrap(partial(verl_losses.ppo_loss, config=cfg))
    cap.begin_step(0, dp=1, dp_rank=0, rank=0, world_size=1)
    with pytest.warns(lc.CaptureWarning, match="kl_loss_coef = 0"):
        _call(cap, loss_fn, model, mb, entropy=True)
    with safe_open(cap.finish_step(grad_scale=1.0), framework="pt") as f:
        assert "terms" not in f.metadata()


def test_a_step_it_cannot_measure_stops_only_the_audited_fail_fast_step(tmp_path, capfd):
    """An entropy in some micro-batches only: the step cannot be measured. With fail fast on that step the
    run stops (RuntimeError); otherwise the step is dropped with a warning and verl's own loss is returned,
    bit for bit, the run going on (issue #53 item 5)."""
    cfg = drv.actor_config("token-mean-kl-entropy")
    model, mb = _microbatch("token-mean-kl-entropy")
    plain = partial(verl_losses.ppo_loss, config=cfg)
    want = plain(model_output={"log_probs": model(mb["input_ids"])}, data=mb, dp_group=None)[0]
    for fail_fast in (True, False):
        d = tmp_path / f"caps-{fail_fast}"
        cap = lverl.VerlAdapter(str(d), fail_fast=fail_fast, lossguard_bin=sys.executable)
        loss_fn = cap.wrap(plain)
        cap.begin_step(0, dp=1, dp_rank=0, rank=0, world_size=1)
        _call(cap, loss_fn, model, mb, entropy=True)
        if fail_fast:
            with pytest.raises(RuntimeError, match="entropy in some micro-batches and not in others"):
                _call(cap, loss_fn, model, mb, entropy=False)
        else:
            got = _call(cap, loss_fn, model, mb, entropy=False)
            assert torch.equal(got.detach(), want.detach())
            assert "this step is not measured and the run goes on" in capfd.readouterr().err
        assert cap._open is None and not os.path.exists(d)


def test_which_policy_losses_force_a_mode(tmp_path):
    """Every registered policy loss, configured token-mean: the mode it hands agg_loss (the adapter warns
    when it differs, citing the release's line), and the measured weights are that mode's.  sapo forces
    seq-mean-token-mean in every release, gspo too up to 0.9.0 (0.9.0 core_algos.py:1604-1605, 0.8.0
    :1597-1598; 0.9.1 passes the configured mode), geo_mean aggregates none; dro exists from 0.9.0 on."""
    skip = {"bypass_mode"}             # needs a rollout-correction configuration; dispatches to vanilla/reinforce
    want_forced = {"sapo": "seq-mean-token-mean", "geo_mean": "none"}
    if drv.GSPO_FORCES_MODE:
        want_forced["gspo"] = "seq-mean-token-mean"
    assert lverl.FORCED_MODES == {k: v for k, v in want_forced.items() if v != "none"}
    forced = {}
    for name in sorted(core_algos.POLICY_LOSS_REGISTRY):
        if name in skip or name.startswith("lossguard_test"):
            continue
        cfg = drv.actor_config("token-mean")
        pl = {"loss_mode": name, **({"dro_beta": 0.1} if drv.HAS_DRO else {})}     # no dro_beta field in 0.8.0
        object.__setattr__(cfg, "policy_loss", drv.PolicyLossConfig(**pl))
        cap = lverl.VerlAdapter(str(tmp_path / name), fail_fast=False)
        loss_fn = cap.wrap(partial(verl_losses.ppo_loss, config=cfg))
        model, mb = _microbatch()
        cap.begin_step(0, dp=1, dp_rank=0, rank=0, world_size=1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            _call(cap, loss_fn, model, mb)
            path = cap.finish_step(grad_scale=1.0)
        msgs = [str(x.message) for x in w if issubclass(x.category, lc.CaptureWarning)]
        forced[name] = ("none" if any("aggregates no per-token" in x for x in msgs) else
                        "seq-mean-token-mean" if any("aggregates with 'seq-mean-token-mean'" in x for x in msgs) else
                        "configured")
        if forced[name] == "seq-mean-token-mean":
            assert any(f"verl {drv.VERL} forces it: core_algos.py:" in x for x in msgs), msgs
        if name in ("vanilla", "sapo", "gspo"):     # the weights: the mode handed to agg_loss (dp 1, B 3)
            t = load_file(path)
            m, R = t["mb.0.loss_masks"].double(), t["mb.0.response_lengths"].tolist()
            if forced[name] == "seq-mean-token-mean":
                mi = torch.cat([x.sum().repeat(len(x)) for x in m.split(R)])
                want = m / (3 * (mi + 1e-8))
            else:
                want = m / m.sum()
            torch.testing.assert_close(t["mb.0.token_weight"].double(), want, rtol=2e-6, atol=0)
    for name, mode in want_forced.items():
        assert forced.pop(name) == mode, (name, mode)
    assert set(forced.values()) == {"configured"}, forced
    assert {"vanilla", "gpg", "clip_cov", "kl_cov", "cispo", "dppo_tv", "dppo_kl"} <= set(forced)
    assert ("dro" in forced) is drv.HAS_DRO and ("gspo" in forced) is not drv.GSPO_FORCES_MODE


def test_unsupported_version_names_the_range():
    with pytest.raises(RuntimeError, match=r"verl>=0\.8\.0,<0\.9\.2.*verl 0\.7\.1 is installed"):
        lverl.check_version("0.7.1")
    for v in ("0.9.2", "0.10.0", "0.9.2.dev0", "0.7.9"):
        with pytest.raises(RuntimeError):
            lverl.check_version(v)
    for v in ("0.8.0", "0.9.0", "0.9.1"):
        lverl.check_version(v)
    assert lverl.SPEC.verified == ("0.8.0", "0.9.0", "0.9.1")
    with pytest.warns(UserWarning, match="supports"):
        lverl.check_version("0.9.2", allow_unsupported=True)
    lverl.check_version()


def test_verl_0_7_is_refused_with_the_reason():
    """0.7.x: ppo_loss hands the policy loss an unpadded micro-batch and no_padding_2_padding reads
    attention_mask, another data contract; the refusal says so and names the nearest supported release."""
    for v in ("0.7.0", "0.7.1"):
        with pytest.raises(RuntimeError, match=rf"verl {re.escape(v)} is installed.*verl {re.escape(v)}: before 0\.8 "
                                               r"ppo_loss does not pad the micro-batch.*another data contract.*"
                                               r"nearest supported: 0\.8\.0"):
            lverl.check_version(v)
    with pytest.warns(UserWarning, match=r"another data contract.*Trying anyway"):
        lverl.check_version("0.7.1", allow_unsupported=True)
    assert lverl.SPEC.refusal("0.8.0") is None and lverl.SPEC.refusal("0.9.2") is None


def test_modes_and_forced_modes_per_release():
    """The adapter's per-release tables (fake version strings) and the installed release's."""
    every = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    without = tuple(m for m in every if m != "token-sum")
    for v, modes, gspo in (("0.8.0", without, True), ("0.8.5", without, True), ("0.9.0", every, True),
                           ("0.9.1", every, False), ("0.9.1.post1", every, False)):
        assert lverl.loss_agg_modes(v) == modes, v
        assert lverl.forced_modes(v) == {"sapo": "seq-mean-token-mean",
                                         **({"gspo": "seq-mean-token-mean"} if gspo else {})}, v
    assert lverl.LOSS_AGG_MODES == (every if drv.HAS_TOKEN_SUM else without)
    assert tuple(lverl.CLAIMS) == lverl.LOSS_AGG_MODES
    assert ("gspo" in lverl.FORCED_MODES) is drv.GSPO_FORCES_MODE


def test_token_sum_exists_from_0_9_0(tmp_path):
    """token-sum: from 0.9.0 verl's ActorConfig and agg_loss take it and the adapter measures it (the
    token-sum config of the driver); below, verl rejects it (ActorConfig, workers/config/actor.py:219 in
    0.8.0; agg_loss, core_algos.py:1197) and the adapter refuses it with the reason, recording nothing."""
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kw = {"dp_size": 1, "batch_num_tokens": 3, "global_batch_size": 2}
    if drv.HAS_TOKEN_SUM:
        assert "token-sum" in drv.CONFIGS and lverl.check_loss_agg_mode("token-sum") == "token-sum"
        assert drv.actor_config("token-sum").loss_agg_mode == "token-sum"
        assert core_algos.agg_loss(torch.ones_like(m), m, "token-sum", **kw).item() == 3.0
        return
    assert "token-sum" not in drv.CONFIGS and "token-sum" not in lverl.CLAIMS
    with pytest.raises(ValueError, match="Invalid loss_agg_mode: token-sum"):
        drv.FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=drv.GLOBAL_BATCH,
                            ppo_micro_batch_size_per_gpu=drv.MICRO, loss_agg_mode="token-sum",
                            policy_loss=drv.PolicyLossConfig(loss_mode="vanilla"), use_torch_compile=False)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode: token-sum"):
        core_algos.agg_loss(torch.ones_like(m), m, "token-sum", **kw)
    why = r"unknown loss_agg_mode 'token-sum': token-sum exists from verl 0\.9\.0 on.*nothing was recorded"
    with pytest.raises(ValueError, match=why):
        lverl.check_loss_agg_mode("token-sum")
    cfg = drv.actor_config("token-mean")
    object.__setattr__(cfg, "loss_agg_mode", "token-sum")        # past ActorConfig's own check
    cap = lverl.VerlAdapter(str(tmp_path / "caps"), fail_fast=False)
    loss_fn = cap.wrap(partial(verl_losses.ppo_loss, config=cfg))
    model, mb = _microbatch()
    cap.begin_step(0, dp=1, dp_rank=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match=why):
        _call(cap, loss_fn, model, mb)
    assert cap._open is None and not os.path.exists(tmp_path / "caps")


def _stand_in():
    """tests/trainers/cpu_stand_ins/flash_attn/bert_padding.py, loaded from its file (whatever sys.path holds)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "lossguard_stand_in_bert_padding", os.path.join(drv.STAND_INS, "flash_attn", "bert_padding.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_stand_in_bert_padding():
    """The pure-torch stand-in's semantics on a hand-checked batch (verl's calls: unpad_input(x, mask) ->
    kept rows, their flat indices, cu_seqlens, the longest row, the used count; pad_input its inverse;
    index_first_axis rows by index), and that the driver uses it exactly when verl < 0.9.1 has no flash-attn."""
    bp = _stand_in()
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    x = torch.arange(4 * 4 * 2, dtype=torch.float64).reshape(4, 4, 2).requires_grad_()
    kept, idx, cu, longest, used = bp.unpad_input(x, mask)
    assert idx.tolist() == [1, 2, 4, 5, 6, 7, 12, 14]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 6, 6, 8]
    assert longest == 4 and used.tolist() == [2, 4, 0, 2]
    assert torch.equal(kept, x.reshape(16, 2)[idx])
    back = bp.pad_input(kept, idx, 4, 4)
    assert torch.equal(back, x * mask[..., None])
    back.sum().backward()                                    # the gradient reaches exactly the kept positions
    assert torch.equal(x.grad, mask[..., None].double().expand(4, 4, 2))
    assert torch.equal(bp.index_first_axis(torch.arange(10)[:, None], torch.tensor([3, 0])), torch.tensor([[3], [0]]))
    _, idx2, cu2, longest2, used2 = bp.unpad_input(x, mask, unused_mask=torch.tensor([[1, 0, 0, 0]] + [[0] * 4] * 3))
    assert idx2.tolist()[:3] == [0, 1, 2] and cu2.tolist() == [0, 3, 7, 7, 9] and used2.tolist() == [2, 4, 0, 2]
    assert longest2 == 4
    if drv.CPU_STAND_IN:              # verl < 0.9.1 and `import flash_attn` failed before the driver added it
        import flash_attn.bert_padding as active
        assert drv.VERL.release < (0, 9, 1)
        assert os.path.dirname(os.path.dirname(active.__file__)) == drv.STAND_INS
    else:                             # verl 0.9.1 (its own fallback) or a real flash-attn
        assert drv.STAND_INS not in sys.path
        assert drv.VERL.release >= (0, 9, 1) or drv._flash_attn_importable()


def test_dense_layout_is_the_nested_one():
    """verl's left_right_2_no_padding (through the stand-in's unpad_input on verl < 0.9.1 without flash-attn)
    turns the -dense configs' padded rank batch into the nested layout the other configs hand the engine:
    the same tokens, sequence offsets and response fields, sample for sample."""
    samples = drv.global_batch(0, drv.make_model())
    for rank in range(drv.DP):
        dense = drv.rank_batch(samples, rank, "dense")
        nested = drv.rank_batch(samples, rank, "nested")
        assert torch.equal(dense["input_ids"].values(), nested["input_ids"].values())
        assert torch.equal(dense["input_ids"].offsets(), nested["input_ids"].offsets())
        n = len(samples) // drv.DP
        for i, s in enumerate(samples[rank * n:(rank + 1) * n]):
            R = s["response"].numel()
            assert torch.equal(dense["responses"][i, :R], s["response"])
            assert torch.equal(dense["loss_mask"][i, :R], s["mask"]) and not dense["loss_mask"][i, R:].any()


def test_guards(tmp_path):
    cap = lverl.VerlAdapter(str(tmp_path / "caps"), fail_fast=False)
    with pytest.raises(RuntimeError, match="measures verl.workers.utils.losses.ppo_loss"):
        cap.wrap(lambda model_output, data, dp_group=None: None)
    with pytest.raises(RuntimeError, match="only verl's FSDP engine"):
        lverl.attach(object(), str(tmp_path / "caps"))
    eng = drv.CPUEngine(drv.make_model(), str(tmp_path), 0, 2)
    eng.scaler = object()
    with pytest.raises(RuntimeError, match="grad scaler"):
        lverl.attach(eng, str(tmp_path / "caps"))
    with pytest.raises(RuntimeError, match="world size 1 != DP size 2"):
        cap.begin_step(0, dp=2, dp_rank=0, rank=0, world_size=1)


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
def test_fail_fast_stops_the_buggy_run_on_every_rank(tmp_path):
    """attach(engine, ..., fail_fast=True) on the planted KL bug, DP 2: rank 0's audit of step 0 FAILS (kl.weights);
    every rank raises AuditFailed from train_batch before verl's optimizer step (parameters unchanged), and the job
    exits non-zero."""
    config = "token-mean-kl-bug"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(drv.DP), DRIVER,
           "--out", str(tmp_path), "--fail-fast", config, "--lossguard-bin", LOSSGUARD]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "AuditFailed" in r.stderr
    for rank in range(drv.DP):
        with open(tmp_path / config / f"failfast-rank{rank}.json") as f:
            got = json.load(f)
        assert got["step"] == 0 and got["exit_code"] == 1 and got["verdicts"] == {"0": "fail"}, got
        assert got["params_unchanged"] is True, got
        assert "kl.weights" in got["text"] and "lossguard audit FAILED step 0" in got["message"], got["text"]
    assert os.path.exists(tmp_path / config / "captures" / "step000000" / "step000000-rank00001.safetensors")
    assert not (tmp_path / config / "captures" / "step000001").exists()


# ---- the runnable example (examples/verl_audit.py): verl's ppo_loss without an engine -----------------------
@pytest.mark.skipif(not (os.path.isfile(LOSSGUARD) and os.access(LOSSGUARD, os.X_OK)), reason="lossguard not built")
@pytest.mark.parametrize("mode,rc,said", [("token-mean", 0, "step 0 audited: pass; the update applied"),
                                          ("seq-mean-token-sum-norm", 1, "stopped at step 0 by lossguard audit")])
def test_the_example_runs(tmp_path, mode, rc, said):
    """The engine-less example as a user runs it, with partial(ppo_loss, config) POSITIONAL (the form a user
    writes; verl's worker passes config=): token-mean passes; seq-mean-token-sum-norm without
    loss_scale_factor (each micro-batch over its own longest response) is stopped before the update."""
    import subprocess
    src = open(os.path.join(ROOT, "examples", "verl_audit.py")).read()
    assert "partial(ppo_loss, config)" in src
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "verl_audit.py"), "--out", str(tmp_path),
                        "--mode", mode, "--lossguard-bin", LOSSGUARD], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == rc and said in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    with open(tmp_path / "audit-step000000.json") as f:
        assert json.load(f)["exit_code"] == rc
