"""lossguard_capture.trl against TRL's real GRPOTrainer and SFTTrainer (CPU, Gloo, a tiny Llama built from a
config, a tokenizer built in-process, generation by model.generate).

For every GRPO loss_type of the pinned TRL (grpo, sapo, bnpo, dr_grpo, dapo, cispo, vespo, luspo; plus GSPO's
sequence-level importance sampling, truncated completions masked, beta KL, bf16 autocast, the entropy bonus
(a declared term ``entropy``) and steps_per_generation 1 and 4 against gradient accumulation 2), DP 1 and
(a subset) DP 2, and for SFTTrainer,
tests/trainers/trl_driver.py runs ``train`` twice from the same seed, with the adapter and without; the tests
prove

(a) the adapter changes nothing: every micro-batch's loss and every gradient the optimizer receives are bit for
    bit the same with and without it;
(b) the measured weights are the truth: ``sum_k sum_t w^k_t grad(l^k_t)`` with ``w_t = token_weight_t *
    grad_scale`` from the captures and ``l_t`` the trainer's own per-token loss (and, with the entropy bonus,
    its per-token entropies) recomputed in float64 on the step's parameters equals the gradient the optimizer
    was about to apply (after backward and DDP);
(c) the measured weights are exactly the formula each loss_type implements (:func:`formula_weights`, the
    numbers lossguard's contract presets are to model);
(d) ``lossguard audit`` (when built) says what :func:`expected` says — the entropy bonus judged as a term
    of its own, relative to the policy term — and fail-fast stops a failing run at step 0 on every rank;

and that ``lossguard_capture.hf`` refuses TRL's SFTTrainer (its loss never calls cross_entropy).

Every supported TRL release runs the whole file (lossguard_capture.trl's Releases); behaviour is chosen by
the installed version: below ``lossguard_capture.trl.SFT_SINCE`` (1.15) the SFT configurations are not
trained but must be refused at attach, in DP 1 and DP 2 (:func:`test_sft_is_refused_below_its_floor`), and
the example's ``--sft`` must stop with that refusal.

    scripts/setup-trainers.sh
    ~/.cache/lossguard/venv-hf/bin/python -m pytest -q tests/trainers/test_trl_trainer.py
"""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DRIVER = os.path.join(HERE, "trl_driver.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import gallery  # noqa: E402  (docs/gallery.md's rows, when LOSSGUARD_GALLERY_DIR is set)
import trl_driver as drv  # noqa: E402

import lossguard_capture as lc  # noqa: E402
import lossguard_capture.hf as lhf  # noqa: E402
import lossguard_capture.trl as ltrl  # noqa: E402
from harness import HAVE_BIN, LOSSGUARD, audit, child_env  # noqa: E402

try:                      # another trainer's venv may hold other versions (tests/trainers/conftest.py)
    ltrl.check_version()
    lhf.check_version()
except RuntimeError as e:
    pytest.skip(f"not the pinned TRL / transformers: {e}", allow_module_level=True)


DP1 = list(drv.CONFIGS) + ["sft"]
DP2 = ["grpo", "bnpo", "dr_grpo", "dapo", "dapo-spg4", "dapo-spg1", "sft"]
# the configurations trained and compared: sft only where the adapter measures SFTTrainer (the driver then
# only checks that attach refuses it: test_sft_is_refused_below_its_floor)
CASES = [(w, c) for w, cs in ((1, DP1), (2, DP2)) for c in cs if c != "sft" or drv.SFT_MEASURED]
IDS = [f"dp{w}-{c}" for w, c in CASES]
STEPS, GA = drv.STEPS, drv.GA


def entropy_coef(config):
    """The entropy bonus's coefficient (0: none)."""
    return drv.CONFIGS.get(config, {}).get("entropy_coef", 0.0)


def expected(world, config):
    """(exit code, step-0 diagnosis kinds accepted, what must reproduce the weights) of lossguard audit, for the
    main term.  The entropy bonus (a per-micro-batch token mean / M, grpo_trainer.py:3192-3211) fails its own
    term's weights check against the per-token objective whenever the micro-batches' counts differ: exit 1."""
    code, kinds, preset = _expected_main(world, config)
    return (1 if entropy_coef(config) else code), kinds, preset


def _expected_main(world, config):
    lt = drv.CONFIGS[config]["loss_type"] if config != "sft" else "sft"
    if config == "dapo-spg4":           # a count over the generation batch (2 steps): a uniform scale per step,
        return 1, {"uniform-scale"}, None             # and num_tokens_reduced != N fails the counts check
    if config == "dapo-spg1":           # a count per micro-batch (all-reduced over DP): per-micro-batch weights
        return 1, {"per-microbatch"}, ("hf-ga" if world == 1 else None)
    if lt == "bnpo":                    # the local micro-batch's count: the hf-ga shape
        return 1, {"per-microbatch"}, "hf-ga"
    if lt == "dr_grpo":                 # m_t/(B L): docs/semantics.md §9's seq-mean-token-sum-norm, L_norm = the
        return 0, {"exact"}, "truth"    # step's longest response (test_dr_grpo_l_norm_is_the_longest_response)
    return 0, {"exact"}, "truth"


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Both driver runs, one after the other (1 process, then 2 under torchrun): {world: out_dir}."""
    out = {}
    for world, configs in ((1, DP1), (2, DP2)):
        d = str(tmp_path_factory.mktemp(f"trl-dp{world}"))
        args = [DRIVER, "--out", d, "--configs", ",".join(configs)]
        if world == 1:
            args.append("--hf-on-sft")
        if HAVE_BIN:      # the passing configurations also audit step 0 inside the run (fail-fast passes)
            args += ["--audit-in-run", ",".join(c for c in configs if expected(world, c)[0] == 0),
                     "--lossguard-bin", LOSSGUARD]
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


def meta(runs, world, config):
    with open(os.path.join(run_dir(runs, world, config), "meta-rank0.json")) as f:
        return json.load(f)


def captures(runs, world, config, step):
    d = os.path.join(run_dir(runs, world, config), "captures", f"step{step:06d}")
    caps = []
    for r in range(world):
        path = os.path.join(d, f"step{step:06d}-rank{r:05d}.safetensors")
        with safe_open(path, framework="pt") as f:
            m = f.metadata()
        caps.append((load_file(path), m))
    return caps


def masks(t, k):
    """Micro-batch k's loss masks as [n_k, R] (every sample of a micro-batch has the same response length)."""
    R = t[f"mb.{k}.response_lengths"]
    assert len(set(R.tolist())) == 1
    return t[f"mb.{k}.loss_masks"].view(-1, int(R[0])).double()


# ---- (a) the adapter changes nothing ---------------------------------------------------------------
@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_loss_and_gradient_bit_for_bit(runs, world, config):
    bits = lambda x: x.reshape(1).view(torch.int32)     # noqa: E731 - NaN == NaN, bit for bit
    for r in range(world):
        a = torch.load(os.path.join(run_dir(runs, world, config), f"losses-rank{r}.pt"))
        p = torch.load(os.path.join(run_dir(runs, world, config, "plain"), f"losses-rank{r}.pt"))
        assert len(a) == len(p) == GA * STEPS
        for i, (x, y) in enumerate(zip(a, p)):
            assert x.dtype == y.dtype == torch.float32 and torch.equal(bits(x), bits(y)), (r, i, x.item(), y.item())
        for n in range(STEPS):
            ga_ = torch.load(os.path.join(run_dir(runs, world, config), f"grads-step{n}-rank{r}.pt"))
            gp = torch.load(os.path.join(run_dir(runs, world, config, "plain"), f"grads-step{n}-rank{r}.pt"))
            for name in gp:
                assert torch.equal(ga_[name], gp[name]), (r, n, name, (ga_[name] - gp[name]).abs().max().item())


# ---- what the captures hold ------------------------------------------------------------------------
def _check_grpo_layout(t, k, config):
    """Each completion is a sample: its prompt without padding, then the C completion positions."""
    T, R = t[f"mb.{k}.total_lengths"], t[f"mb.{k}.response_lengths"]
    toks = torch.split(t[f"mb.{k}.tokens"], T.tolist())
    for row, P, m in zip(toks, (T - R).tolist(), masks(t, k).long().tolist()):
        prompt, completion = row[:P].tolist(), row[P:].tolist()
        assert " ".join(drv.WORDS[x] for x in prompt) in drv.PROMPTS, prompt         # no padding, a real prompt
        ended = drv.EOS in completion
        n = completion.index(drv.EOS) + 1 if ended else len(completion)             # generated tokens, EOS included
        assert all(x == drv.PAD for x in completion[n:])                             # then right padding
        if config == "grpo-trunc" and not ended:                                     # mask_truncated_completions
            assert m == [0] * len(m)
        else:
            assert m == [1] * n + [0] * (len(m) - n)


def _check_sft_layout(t, k):
    """A row is a sample (prompt length 1): mask[j] = 1 iff token j+1 is a completion token or its EOS."""
    L = int(t[f"mb.{k}.total_lengths"][0])
    rows = {(r["prompt"], r["completion"]) for r in drv.sft_dataset()}
    for row, m in zip(t[f"mb.{k}.tokens"].view(-1, L).tolist(), masks(t, k).long().tolist()):
        n = row.index(drv.EOS) + 1
        assert all(x == drv.PAD for x in row[n:])
        words = [drv.WORDS[x] for x in row[:n - 1]]
        cut = [i for i in range(1, len(words)) if (" ".join(words[:i]), "".join(" " + w for w in words[i:])) in rows]
        assert len(cut) >= 1, words
        P = cut[0]
        assert m == [int(P <= j + 1 < n) for j in range(L - 1)], (words, m)


@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_capture_records(runs, world, config):
    md = meta(runs, world, config)
    lt = md.get("loss_type", "sft")
    bs = drv.CONFIGS.get(config, {}).get("per_device_train_batch_size", drv.BS)
    want_reduce = ltrl.OBJECTIVES[lt] if lt != "sft" else "per-token"
    assert md["reduce"] == want_reduce
    ent = entropy_coef(config)
    for n in range(STEPS):
        caps = captures(runs, world, config, n)
        losses = [torch.load(os.path.join(run_dir(runs, world, config), f"losses-rank{r}.pt")) for r in range(world)]
        grads = torch.load(os.path.join(run_dir(runs, world, config), f"grads-step{n}-rank0.pt"))
        seen, N = set(), 0
        for r, (t, m) in enumerate(caps):
            want_meta = {"lossguard.schema": "audit/1", "trainer": "trl", "step": str(n), "rank": str(r), "world_size": str(world),
                         "tp": "1", "pp": "1", "cp": "1", "dp": str(world), "tp_rank": "0", "pp_rank": "0",
                         "cp_rank": "0", "dp_rank": str(r), "cp_layout": "zigzag", "reduce": want_reduce,
                         "num_microbatches": str(GA), "dtype": "float32",
                         "loss_site": "trl GRPOTrainer._compute_loss / SFTTrainer.compute_loss"}
            if ent:          # the entropy bonus: per-token, the coefficient as it enters the loss, the loss mask
                want_meta.update({"terms": "entropy", "term.entropy.reduce": "per-token",
                                  "term.entropy.coef": repr(-ent), "term.entropy.mask": "loss"})
            assert m == want_meta
            assert t["grad_scale"].item() == 1.0 / world          # DDP's mean
            assert t["global_batch_size"].item() == bs * GA * world
            assert t["skipped"].item() == 0
            norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
            assert math.isclose(t["grad_norm"].item(), norm, rel_tol=1e-5)
            for k in range(GA):
                idx = t[f"mb.{k}.sample_indices"].tolist()
                assert idx == [(k * world + r) * bs + j for j in range(bs)]
                assert not (set(idx) & seen)
                seen |= set(idx)
                if lt == "sft":
                    _check_sft_layout(t, k)
                else:
                    _check_grpo_layout(t, k, config)
                mk = masks(t, k)
                N += int(mk.sum())
                assert sorted({x.split(".")[3] for x in t if x.startswith(f"mb.{k}.term.")}) == (["entropy"] if ent
                                                                                                   else [])
                total = 0.0
                for p in [f"mb.{k}."] + ([f"mb.{k}.term.entropy."] if ent else []):
                    tw, tl = t[p + "token_weight"].double(), t[p + "token_loss"].double()
                    assert (tw[mk.view(-1) == 0] == 0).all()                       # masked tokens weigh 0
                    total += float((tw * tl).sum())
                if ent:                                                             # the count it divides by
                    assert t[f"mb.{k}.term.entropy.num_tokens"].item() == int(mk.sum())
                assert t[f"mb.{k}.loss"].item() == losses[r][n * GA + k].double().item()   # what was backpropagated
                assert math.isclose(t[f"mb.{k}.loss"].item(), total, rel_tol=1e-4, abs_tol=1e-6)      # every term
                if lt == "bnpo":                                                    # the count it divides by
                    assert t[f"mb.{k}.num_tokens"].item() == int(mk.sum())
                else:
                    assert f"mb.{k}.num_tokens" not in t
        for r, (t, _) in enumerate(caps):
            if lt == "sft":
                assert t["num_tokens_reduced"].item() == N                          # gathered over the ranks
            elif lt in ("dapo", "cispo", "vespo") and md["steps_per_generation"] % GA == 0:
                assert t["num_tokens_reduced"].item() == generation_count(runs, world, config, n, 0)
            else:                 # no count (or one per micro-batch: spg < GA)
                assert "num_tokens_reduced" not in t


# ---- (b) the measured weights are the truth -----------------------------------------------------
@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, world, config):
    """grad (after backward and DDP) == sum_t w_t grad(l_t) over every rank's micro-batches (the driver's
    want-step files: the trainer's own per-token losses, recomputed in float64, weighted by the captures)."""
    for n in range(STEPS):
        d = run_dir(runs, world, config)
        got = [torch.load(os.path.join(d, f"grads-step{n}-rank{r}.pt")) for r in range(world)]
        for r in range(1, world):                                   # DDP left every replica the same gradient
            assert all(torch.equal(got[r][k], got[0][k]) for k in got[0])
        parts = [torch.load(os.path.join(d, f"want-step{n}-rank{r}.pt")) for r in range(world)]
        want = {k: sum(p[k].double() for p in parts) for k in parts[0]}
        scale = max(v.abs().max().item() for v in want.values())
        for k in want:
            torch.testing.assert_close(got[0][k].double(), want[k], rtol=1e-4, atol=1e-6 * scale,
                                       msg=lambda m: f"{config} dp{world} step {n} {k}: {m}")


def test_gradient_check_rejects_wrong_weights(runs):
    """The identity of (b) is sharp enough to fail when the weights are 1% off: step 0 of dp1-dapo against its
    weighted sum x 1.01 (its gradient is non-zero: the weights hold the tokens' 1/N)."""
    d = run_dir(runs, 1, "dapo")
    got = torch.load(os.path.join(d, "grads-step0-rank0.pt"))
    want = {k: v.double() * 1.01 for k, v in torch.load(os.path.join(d, "want-step0-rank0.pt")).items()}
    scale = max(v.abs().max().item() for v in want.values())
    assert scale > 0
    with pytest.raises(AssertionError):
        for k in want:
            torch.testing.assert_close(got[k].double(), want[k], rtol=1e-4, atol=1e-6 * scale)


# ---- (c) the weights are each loss_type's formula ------------------------------------------------
def generation_count(runs, world, config, step, k):
    """N_G of micro-batch k of ``step``: TRL's num_items_in_batch (grpo_trainer.py:2498), the mask total of the
    generation batch that holds it — the micro-batches j' (counted over the run, j = step*GA + k) with
    j' // steps_per_generation == j // steps_per_generation, on every rank."""
    S = meta(runs, world, config)["steps_per_generation"]
    g = (step * GA + k) // S
    total = 0
    for j in range(g * S, (g + 1) * S):
        for t, _ in captures(runs, world, config, j // GA):
            total += int(masks(t, j % GA).sum())
    return total


def formula_weights(runs, world, config, step, t, k):
    """The weight w_t of every token of micro-batch k (rank's capture t) as TRL computes it (the lines are
    1.16.0's; the same code in every supported release).
    m: [n_k, C] masks, m_i the sample's mask total, n_k the micro-batch's rows, M gradient accumulation,
    P the DP world (DDP's mean), L max_completion_length, S steps_per_generation, N the step's token total."""
    md = meta(runs, world, config)
    lt = md.get("loss_type", "sft")
    m = masks(t, k)
    n_k, M, P = m.shape[0], GA, world
    if lt in ("grpo", "sapo"):          # :3154 ((l*m).sum(-1) / m_i.clamp(1)).mean() / M; DDP / P
        return m / (m.sum(-1, keepdim=True).clamp(min=1) * n_k * M * P)
    if lt == "bnpo":                    # :3159 (l*m).sum() / (micro-batch's own count).clamp(1) / M; / P
        return m / (m.sum().clamp(min=1) * M * P)
    if lt == "dr_grpo":                 # :3164 (l*m).sum() / (n_k * max_completion_length) / M; / P
        return m / (n_k * md["max_completion_length"] * M * P)
    if lt in ("dapo", "cispo", "vespo"):  # :3170-3173 (l*m).sum() / (N_G/P * M/S); / P
        S = md["steps_per_generation"]
        return m * S / (max(generation_count(runs, world, config, step, k), 1) * M)
    if lt == "luspo":                   # :3179 (l*m).sum(-1).mean() / M; / P
        return m / (n_k * M * P)
    if lt == "sft":                     # sft_trainer.py:1618-1624 l.sum() / num_items_in_batch * P; / P
        N = sum(int(masks(tt, kk).sum()) for tt, _ in captures(runs, world, config, step) for kk in range(GA))
        return m / N
    raise AssertionError(lt)


def entropy_weights(world, config, t, k):
    """The entropy bonus's weight (grpo_trainer.py:3192-3211): -entropy_coef * m_t / (max(n_{k,d}, 1) * M * P),
    the micro-batch's own token mean / M, DDP's mean — for every loss_type."""
    m = masks(t, k)
    return -entropy_coef(config) * m / (m.sum().clamp(min=1) * GA * world)


@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_weights_are_the_loss_types_formula(runs, world, config):
    for n in range(STEPS):
        for t, _ in captures(runs, world, config, n):
            for k in range(GA):
                w = (t[f"mb.{k}.token_weight"].double() * t["grad_scale"].double()).view(masks(t, k).shape)
                torch.testing.assert_close(w, formula_weights(runs, world, config, n, t, k), rtol=1e-6, atol=0,
                                           msg=lambda m: f"{config} dp{world} step {n} mb {k}: {m}")
                if entropy_coef(config):
                    w = (t[f"mb.{k}.term.entropy.token_weight"].double() * t["grad_scale"].double()).view(w.shape)
                    torch.testing.assert_close(w, entropy_weights(world, config, t, k), rtol=1e-6, atol=0,
                                               msg=lambda m: f"{config} dp{world} step {n} mb {k} entropy: {m}")


def test_dapo_spg4_weights_sum_to_the_steps_share_of_the_generation_batch(runs):
    """steps_per_generation 4 = 2 optimizer steps of GA 2: the count is the generation batch's (both steps), so
    step n's weights sum to S*N_n/(M*N_G) = 2*N_n/(N_0+N_1), not 1 (and their sum over both steps is 2)."""
    for world in (1, 2):
        N = [sum(int(masks(t, k).sum()) for t, _ in captures(runs, world, "dapo-spg4", n) for k in range(GA))
             for n in range(STEPS)]
        sums = [sum(float((t[f"mb.{k}.token_weight"].double() * t["grad_scale"].double()).sum())
                    for t, _ in captures(runs, world, "dapo-spg4", n) for k in range(GA)) for n in range(STEPS)]
        assert N[0] != N[1]                         # the data makes the two steps differ
        for n in range(STEPS):
            assert math.isclose(sums[n], 2 * N[n] / (N[0] + N[1]), rel_tol=1e-6), (world, N, sums)


def test_dr_grpo_l_norm_is_the_longest_response(runs):
    """audit takes L_norm = the step's longest response (it has no L_norm record): the runs must have a
    completion of max_completion_length in each step for its verdict to be about TRL's constant."""
    for world in (1, 2):
        for n in range(STEPS):
            R = max(int(t[f"mb.{k}.response_lengths"].max()) for t, _ in captures(runs, world, "dr_grpo", n)
                    for k in range(GA))
            assert R == drv.MAX_COMPLETION


# ---- (d) lossguard audit's verdicts ----------------------------------------------------------------
@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("world,config", CASES, ids=IDS)
def test_audit_verdict(runs, world, config):
    want_code, want_kinds, want_preset = expected(world, config)
    caps = os.path.join(run_dir(runs, world, config), "captures")
    steps = [os.path.join(caps, f"step{n:06d}") for n in range(STEPS)]
    code, doc, err, text = audit(*steps)
    md = meta(runs, world, config)
    fields = dict(dp=world, config=config, trainer="SFTTrainer" if config == "sft" else "GRPOTrainer",
                  overrides=drv.CONFIGS.get(config, {}), gradient_accumulation_steps=GA,
                  **{k: md[k] for k in ("loss_type", "steps_per_generation", "max_completion_length",
                                        "num_generations", "reduce") if k in md})
    gallery.record("trl", f"dp{world}-{config}", fields, [LOSSGUARD, "audit", *steps], code, doc, text, err)
    where = f"dp{world} {config}:\n{text}\n{err}"
    assert doc is not None, where
    assert code == want_code, where
    s0 = doc["steps"][0]
    assert s0["dtype"] == "float32", where
    kind = s0["diagnosis"]["kind"]
    assert kind in want_kinds, where
    checks = {c["name"]: c["ok"] for c in s0["checks"]}
    assert checks["coverage"] is True and checks["loss"] is True and checks["decision"] is True, where
    if config == "dapo-spg4":
        N = [s["global_tokens"] for s in doc["steps"]]
        for n, s in enumerate(doc["steps"]):
            assert s["diagnosis"]["kind"] == "uniform-scale", where
            assert math.isclose(s["diagnosis"]["scale"], 2 * N[n] / (N[0] + N[1]), rel_tol=1e-6), where
            assert {c["name"]: c["ok"] for c in s["checks"]}["counts"] is False, where
        return
    if want_code == 0:
        assert all(c["ok"] is not False for s in doc["steps"] for c in s["checks"]), where
        assert want_preset in s0["matches"], where
        meta0 = meta(runs, world, config)             # the in-run fail-fast audit passed the same step
        assert meta0["audit"]["0"]["exit_code"] == 0, meta0["audit"]
    else:
        assert checks["weights"] is ("exact" in want_kinds), where      # the entropy term may be what fails
        if want_preset is None:
            assert s0["matches"] == [], where        # no preset reproduces it yet
        else:
            assert want_preset in s0["matches"], where


def _term(step_doc, name):
    found = [t for t in step_doc.get("terms", []) if t["name"] == name]
    assert found, f"no term {name!r} among {[t['name'] for t in step_doc.get('terms', [])]}"
    return found[0]


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("config", ["dapo-entropy", "bnpo-entropy"])
def test_entropy_bonus_is_judged_as_its_own_term(runs, config):
    """GRPO's entropy bonus is a per-micro-batch token mean / M for every loss_type (grpo_trainer.py:3192-3211),
    declared as term entropy (per-token, coef -entropy_coef, mask loss) and judged relative to the policy term.
    dapo: the policy term is exact (the global count) and entropy.weights FAILS per micro-batch, each micro-batch
    at N / n_k / M, reproduced by trl-grpo-entropy.  bnpo: the policy term is that same per-micro-batch mean, so
    the entropy term's weights are the policy term's times its coefficient, token for token, and every preset
    that reproduces the policy term reproduces it."""
    world = 1
    code, doc, err, text = audit(*[os.path.join(run_dir(runs, world, config), "captures", f"step{n:06d}")
                                   for n in range(STEPS)])
    where = f"{config}:\n{text}\n{err}"
    assert doc is not None and code == 1, where
    assert "entropy reproduced by: " in text and "trl-grpo-entropy" in text.split("entropy reproduced by: ")[1], where
    for n, s in enumerate(doc["steps"]):
        checks = {c["name"]: c["ok"] for c in s["checks"]}
        t = _term(s, "entropy")
        assert (t["declared"], t["hooked"], t["reduce"], t["mask"]) == (True, True, "per-token", "loss"), where
        assert math.isclose(t["coef"], -drv.ENT_COEF, rel_tol=1e-12) and t["relative_to_main"] == 1.0, where
        assert checks["entropy.coverage"] is True and checks["entropy.counts"] is True, where   # its own count
        assert checks["entropy.weights"] is False, where
        assert "trl-grpo-entropy" in t["matches"], where
        dg = t["diagnosis"]
        (cap, _), = captures(runs, world, config, n)
        counts = [int(masks(cap, k).sum()) for k in range(GA)]
        N = sum(counts)
        assert len(set(counts)) > 1 and dg["kind"] == "per-microbatch", (where, counts)
        ratios = [N / (c * GA) for c in counts]          # (1/(n_k M)) / (1/N) per micro-batch
        assert math.isclose(dg["min_ratio"], min(ratios), rel_tol=1e-6), where
        assert math.isclose(dg["max_ratio"], max(ratios), rel_tol=1e-6), where
        found = [f for f in doc["findings"] if f["kind"] == "term_normalisation" and f["term"] == "entropy"]
        assert found and found[0]["diagnosis"] == "per-microbatch", where
        if config == "dapo-entropy":
            assert checks["weights"] is True and s["diagnosis"]["kind"] == "exact", where
            assert "trl-grpo-entropy" not in s["matches"], where            # a term preset: not the policy's
        else:
            assert checks["weights"] is False and s["diagnosis"]["kind"] == "per-microbatch", where
            assert set(s["matches"]) <= set(t["matches"]) and "trl-bnpo" in s["matches"], where
            for key in ("min_ratio", "max_ratio"):                           # the policy term's own ratios
                assert math.isclose(dg[key], s["diagnosis"][key], rel_tol=1e-6), where
            for k in range(GA):
                torch.testing.assert_close(cap[f"mb.{k}.term.entropy.token_weight"].double() / -drv.ENT_COEF,
                                           cap[f"mb.{k}.token_weight"].double(), rtol=1e-6, atol=0)


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
def test_fail_fast_stops_the_buggy_run_on_every_rank(tmp_path):
    """bnpo, GA 2, DP 2: rank 0's audit of step 0 FAILS (the hf-ga shape); every rank raises AuditFailed before
    the optimizer step (parameters unchanged), and the job exits non-zero."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", DRIVER,
           "--out", str(tmp_path), "--fail-fast", "bnpo", "--lossguard-bin", LOSSGUARD]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(quiet_warnings=False))
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "AuditFailed" in r.stderr
    for rank in range(2):
        with open(tmp_path / "bnpo" / f"failfast-rank{rank}.json") as f:
            got = json.load(f)
        assert got["global_step"] == 0 and got["exit_code"] == 1, got
        assert got["params_unchanged"] is True, got
        assert "per-micro-batch normalisation" in got["text"] and "hf-ga" in got["text"], got["text"]
        assert "lossguard audit FAILED step 0" in got["message"]
        if rank == 0:
            gallery.record_failfast("trl", "dp2-bnpo", dict(dp=2, config="bnpo", trainer="GRPOTrainer",
                                                            overrides=drv.CONFIGS["bnpo"],
                                                            gradient_accumulation_steps=GA), cmd, tmp_path, got)
    assert not (tmp_path / "bnpo" / "captures" / "step000001").exists()


def test_hf_adapter_cannot_measure_sftTrainer(runs):
    """TRL 1.16's SFTTrainer.compute_loss takes -log_probs from its fused LM head (sft_trainer.py:1611-1618), and
    before 1.15 its default loss_type chunked_nll sums F.nll_loss per chunk (1.14.2 sft_trainer.py:115): it
    never calls torch.nn.functional.cross_entropy, and lossguard_capture.hf says so instead of capturing."""
    with open(os.path.join(runs[1], "hf-on-sft", "hf-on-sft.json")) as f:
        err = json.load(f)["error"]
    assert err is not None and "did not call torch.nn.functional.cross_entropy" in err, err


# ---- the adapter's guards, in this process -----------------------------------------------------------
def _grpo(tmp_path, **over):
    args = drv.GRPOConfig(**{**drv.common_args(str(tmp_path), 1), "max_steps": 1, **over},
                          num_generations=drv.GENS, max_completion_length=drv.MAX_COMPLETION)
    return drv.GRPOTrainer(model=drv.make_model(), reward_funcs=drv.reward, args=args,
                           train_dataset=drv.Dataset.from_dict({"prompt": drv.PROMPTS}),
                           processing_class=drv.tokenizer())


def test_unsupported_version_names_the_range():
    with pytest.raises(RuntimeError, match=r"trl>=1\.13\.0,<1\.17\.0.*trl 1\.12\.0 is installed"):
        ltrl.check_version("1.12.0")
    for v in ("1.17.0", "1.17.0.dev0", "1.13.0rc1", "1.12.9", "2.0.0"):
        with pytest.raises(RuntimeError):
            ltrl.check_version(v)
    for v in ("1.13.0", "1.14.2", "1.16.0", "1.16.9"):
        ltrl.check_version(v)
    for v in ltrl.SPEC.verified:                              # every release the tests ran on passes the gate
        ltrl.check_version(v)
    # 1.15 is inside the range but refused: its fused LM head is Triton-only, so no test could run it here
    with pytest.raises(RuntimeError, match=r"trl 1\.15\.0: not verified: 1\.15's fused LM head runs on Triton only"
                                           r".*nearest supported: 1\.16\.0"):
        ltrl.check_version("1.15.0")
    with pytest.warns(UserWarning, match="supports"):
        ltrl.check_version("1.18.0", allow_unsupported=True)
    ltrl.check_version()                                      # the installed pin is inside the range


@pytest.mark.parametrize("world", [1, 2])
def test_sft_is_refused_below_its_floor(runs, world):
    """Below lossguard_capture.trl.SFT_SINCE (1.15) TRL builds no per-token SFT loss tensor: the driver's sft
    configuration must be refused at attach on every rank, with the reason and the nearest supported release.
    From 1.15 it is attached and trained (the sft cases of every test above)."""
    d = os.path.join(runs[world], "sft")
    if drv.SFT_MEASURED:
        assert meta(runs, world, "sft")["reduce"] == "per-token"
        assert not any(f.startswith("refused-") for f in os.listdir(d))
        return
    files = set(os.listdir(d))
    assert {f"refused-rank{r}.json" for r in range(world)} <= files and not files & {"adapter", "plain"}, files
    for r in range(world):
        with open(os.path.join(d, f"refused-rank{r}.json")) as f:
            err = json.load(f)["error"]
        assert err is not None, "attach accepted an SFTTrainer it cannot measure"
        assert err.startswith("lossguard_capture.trl does not support: "), err
        assert f"SFTTrainer on trl {drv.trl.__version__}: TRL < 1.15 computes SFT's loss without a per-token tensor" \
            in err, err
        assert "loss_type chunked_nll" in err and err.endswith(f"nearest supported: {ltrl.SFT_NEAREST}"), err


def test_liger_is_refused_where_it_bypasses_compute_loss(tmp_path):
    """TRL < 1.14's GRPOTrainer.compute_loss under use_liger_kernel calls compute_liger_loss, never
    _compute_loss (1.13.0 grpo_trainer.py:3031-3034): refused at attach.  From 1.14 liger goes through
    _compute_loss and is attached."""
    tr = _grpo(tmp_path)
    tr.use_liger_kernel = True                 # as GRPOTrainer sets it from args.use_liger_kernel
    if drv.TRL < drv.Version("1.14.0"):
        with pytest.raises(RuntimeError, match=r"use_liger_kernel on trl .*compute_liger_loss"):
            ltrl.attach(tr, str(tmp_path / "c"))
    else:
        assert ltrl.attach(tr, str(tmp_path / "c"), fail_fast=False).kind == "grpo"


def test_every_loss_type_has_an_objective():
    """The pinned TRL's loss types (GRPOConfig's help text) are exactly those OBJECTIVES knows, and the driver
    runs each of them."""
    import re
    help_text = drv.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = set(re.findall(r"'(\w+)'", help_text.split("Supported values are", 1)[1].split(".", 1)[0]))
    assert listed == set(ltrl.OBJECTIVES)
    assert {c["loss_type"] for c in drv.CONFIGS.values()} == set(ltrl.OBJECTIVES)


def test_untracked_terms_are_refused(tmp_path):
    """An MoE aux loss (grpo_trainer.py:3248-3250) is a term the adapter does not hook: refused unless
    allow_untracked_terms.  The entropy bonus is hooked (term entropy): attached without it."""
    cb = ltrl.attach(_grpo(tmp_path, entropy_coef=0.01), str(tmp_path / "c"), fail_fast=False)
    assert cb.kind == "grpo" and cb.reduce == "per-token"
    tr = _grpo(tmp_path)
    tr.aux_loss_enabled = True                 # as GRPOTrainer sets it for a model with output_router_logits
    with pytest.raises(RuntimeError, match="MoE aux loss"):
        ltrl.attach(tr, str(tmp_path / "c"))
    cb = ltrl.attach(tr, str(tmp_path / "c"), allow_untracked_terms=True, fail_fast=False)
    assert cb.kind == "grpo"


def test_entropy_bonus_over_the_high_entropy_mask(tmp_path):
    """top_entropy_quantile < 1: the bonus acts on e = mask x the high-entropy mask (grpo_trainer.py:3192), so the
    term is declared with mask field and records e per micro-batch; its weights are -coef e_t / (max(sum e, 1) M)
    and audit reads the term over that mask (coverage and counts pass)."""
    tr = _grpo(tmp_path, loss_type="dapo", entropy_coef=drv.ENT_COEF, top_entropy_quantile=0.5)
    cb = ltrl.attach(tr, str(tmp_path / "caps"), fail_fast=False)
    tr.train()
    with safe_open(cb.paths[0], framework="pt") as f:
        m = f.metadata()
    assert (m["terms"], m["term.entropy.mask"], m["term.entropy.coef"]) == ("entropy", "field", repr(-drv.ENT_COEF))
    t = load_file(cb.paths[0])
    for k in range(GA):
        e, mk = t[f"mb.{k}.term.entropy.mask"], t[f"mb.{k}.loss_masks"]
        assert e.dtype == torch.int64 and ((e == 0) | (mk == 1)).all() and 0 < int(e.sum()) < int(mk.sum())
        assert t[f"mb.{k}.term.entropy.num_tokens"].item() == int(e.sum())
        torch.testing.assert_close(t[f"mb.{k}.term.entropy.token_weight"].double(),
                                   -drv.ENT_COEF * e.double() / (int(e.sum()) * GA), rtol=1e-6, atol=0)
    if HAVE_BIN:
        code, doc, err, text = audit(os.path.dirname(cb.paths[0]))
        checks = {c["name"]: c["ok"] for c in doc["steps"][0]["checks"]}
        assert checks["entropy.coverage"] is True and checks["entropy.counts"] is True, text + err
        assert _term(doc["steps"][0], "entropy")["mask"] == "field", text


def test_other_trainers_are_refused(tmp_path):
    from transformers import Trainer, TrainingArguments
    tr = Trainer(model=drv.make_model(), args=TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True,
                                                                report_to=[]))
    with pytest.raises(RuntimeError, match="supports GRPOTrainer and SFTTrainer"):
        ltrl.attach(tr, str(tmp_path / "c"))
    sft = drv.SFTTrainer(model=drv.make_model(), args=drv.SFTConfig(**drv.common_args(str(tmp_path), 1), max_length=32),
                         train_dataset=drv.sft_dataset(), processing_class=drv.tokenizer(),
                         compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum())
    with pytest.raises(RuntimeError, match="compute_loss_func"):
        ltrl.attach(sft, str(tmp_path / "c"))


def test_add_callback_finds_its_trainer_and_an_active_profiler_is_an_error(tmp_path):
    """trainer.add_callback(AuditCallback(...)) attaches itself when training begins; a profile function set by
    someone else (sys.setprofile) makes the captured step an error — nothing is written, the profiler is kept."""
    tr = _grpo(tmp_path)
    cb = ltrl.AuditCallback(str(tmp_path / "caps"), fail_fast=False)
    tr.add_callback(cb)

    def other(frame, event, arg):
        return None
    sys.setprofile(other)
    try:
        with pytest.raises(RuntimeError, match="a profiler is active"):
            tr.train()
        assert sys.getprofile() is other
    finally:
        sys.setprofile(None)
    assert cb.trainer is tr and cb.reduce == "per-token"         # dapo: TRL's default loss_type
    assert not os.path.exists(tmp_path / "caps" / "step000000" / "step000000-rank00000.safetensors")
    tr2 = _grpo(tmp_path)
    cb2 = ltrl.AuditCallback(str(tmp_path / "caps2"), fail_fast=False)
    tr2.add_callback(cb2)
    tr2.train()
    t = load_file(cb2.paths[0])
    assert t["num_tokens_reduced"].item() == sum(int(t[f"mb.{k}.loss_masks"].sum()) for k in range(GA))


def test_fail_fast_without_a_binary_is_an_error_not_a_pass(tmp_path):
    tr = _grpo(tmp_path)
    ltrl.attach(tr, str(tmp_path / "caps"), lossguard_bin=str(tmp_path / "no-such-lossguard"))
    with pytest.raises(lc.AuditError, match="no-such-lossguard.*is not an executable file"):
        tr.train()
    assert os.path.exists(tmp_path / "caps" / "step000000" / "step000000-rank00000.safetensors")


# ---- the runnable example (examples/trl_audit.py) ----------------------------------------------------------
@pytest.mark.skipif(not (os.path.isfile(LOSSGUARD) and os.access(LOSSGUARD, os.X_OK)), reason="lossguard not built")
@pytest.mark.parametrize("flags,rc,said", [([], 0, "training finished; step 0 audited: pass"),
                                           (["--loss-type", "bnpo"], 1, "training stopped at step 0 by lossguard audit"),
                                           (["--sft"], 0, "training finished; step 0 audited: pass")])
def test_the_example_runs(tmp_path, flags, rc, said):
    """GRPO's dapo passes, bnpo (each micro-batch over its own tokens, GA 2) is stopped before step 0's update,
    SFT passes (below TRL 1.15: attach refuses the SFTTrainer and the example stops with that error, before
    training): the example a new user copies, run as they would."""
    import subprocess
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "trl_audit.py"), "--out", str(tmp_path),
                        "--lossguard-bin", LOSSGUARD, *flags], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if "--sft" in flags and not drv.SFT_MEASURED:
        assert r.returncode == 1 and "RuntimeError: lossguard_capture.trl does not support: SFTTrainer on trl" in \
            r.stderr and f"nearest supported: {ltrl.SFT_NEAREST}" in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
        assert not os.path.exists(tmp_path / "audit-step000000.json") and "training finished" not in r.stdout
        return
    assert r.returncode == rc and said in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    with open(tmp_path / "audit-step000000.json") as f:
        assert json.load(f)["exit_code"] == rc
