"""The mini trainer's multi-term objective (--terms) under torchrun (Gloo, CPU): the main per-token NLL plus
a KL penalty, an MTP head and an auxiliary z-loss, each hooked separately (docs/semantics.md §10 terms).

* the measured weights of every term (token_weight * grad_scale, mapped back to (sample, response index)
  through zigzag_owned) equal the formulas derived here from the batch, for the correct trainer and each
  term bug (w^main = m/N, w^kl = 0.1 m/N, w^mtp = 0.3 m^mtp/N_mtp, w^aux = 0.01/A, and the bugs' changes);
* sum over terms and tokens of w grad(l), recomputed in one process (float64) with autograd on the recorded
  parameters, equals the trainer's all-reduced gradient;
* `lossguard audit` passes the correct trainer and names the term each bug breaks.

    ~/.cache/lossguard/venv/bin/python -m pytest -q tests/audit/test_mini_trainer_terms.py
"""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
TRAINER = os.path.join(HERE, "mini_trainer.py")
sys.path.insert(0, os.path.join(ROOT, "python"))
import lossguard_capture as lc  # noqa: E402


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mt = _load("lossguard_mini_trainer", TRAINER)
# the single-term test's independent helpers: the §7 placement written out again
my_placement = _load("lossguard_test_mini_trainer", os.path.join(HERE, "test_mini_trainer.py")).my_placement

STEPS, SEED, SAMPLES = 2, 3, 12
TERM_BUGS = ["none", "kl-microbatch-mean", "mtp-main-count", "aux-no-cp", "aux-undeclared"]
COEF = {"kl": 0.1, "mtp": 0.3, "aux": 0.01}
DECLARED = {"kl": ("per-token", "0.1", "loss"), "mtp": ("per-token", "0.3", "shift:1"),
            "aux": ("per-token", "0.01", "all")}
TERMS = ["main", "kl", "mtp", "aux"]
REL = 1e-6

# (id, dp, cp, M, bugs, equal lengths)
CONFIGS = [("dp2-cp2", 2, 2, 2, TERM_BUGS, False),
           ("dp1-cp1-equal", 1, 1, 4, ["none", "kl-microbatch-mean"], True)]


@pytest.fixture(scope="module", params=CONFIGS, ids=[c[0] for c in CONFIGS])
def run(request, tmp_path_factory):
    name, dp, cp, M, bugs, equal = request.param
    out = str(tmp_path_factory.mktemp(f"terms-{name}"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * cp),
           TRAINER, "--out", out, "--dp", str(dp), "--cp", str(cp), "--microbatches", str(M), "--terms",
           "--bug", ",".join(bugs), "--seed", str(SEED), "--steps", str(STEPS), "--samples", str(SAMPLES),
           "--check-grad"] + (["--equal-lengths"] if equal else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return {"dp": dp, "cp": cp, "M": M, "bugs": bugs, "equal": equal, "out": out}


# ---- the truth, derived here ----------------------------------------------------------------------
class Step:
    """One (bug, step) of a run: the captures' weights per term, mapped back to (sample, response index)."""

    def __init__(self, run, bug, step):
        dp, cp, M = run["dp"], run["cp"], run["M"]
        self.dp, self.cp, self.M, self.bug, self.step = dp, cp, M, bug, step
        self.dir = os.path.join(run["out"], bug) if len(run["bugs"]) > 1 else run["out"]
        self.world = dp * cp
        self.batch = mt.make_batch(SEED, step, SAMPLES, sft=False, equal=run["equal"])
        self.place = my_placement(len(self.batch), dp, M)
        self.cap, self.meta = load_step(self.dir, step, self.world)
        self.w = {name: {} for name in TERMS}          # term -> (i, j) -> measured weight
        self.owner = {}                                # (i, j) -> (r, d, c, k)
        for r in range(self.world):
            d, c = divmod(r, cp)
            gs = self.cap[r]["grad_scale"].item()
            for k, idx in enumerate(self.place[d]):
                tws = {name: self.cap[r][f"mb.{k}." + ("" if name == "main" else f"term.{name}.") + "token_weight"]
                       .to(torch.float64) for name in TERMS}
                at = 0
                for i in idx:
                    s = self.batch[i]
                    for j in lc.zigzag_owned(s["T"], s["R"], cp, c):
                        assert (i, j) not in self.owner, f"token {(i, j)} held twice"
                        self.owner[(i, j)] = (r, d, c, k)
                        for name in TERMS:
                            self.w[name][(i, j)] = tws[name][at].item() * gs
                        at += 1
                for name in TERMS:
                    assert at == tws[name].numel(), f"rank {r} mb {k} {name}: {tws[name].numel()} weights, {at} owned"
        # masks and counts, from the batch alone
        self.m, self.m_mtp = {}, {}
        for i, s in enumerate(self.batch):
            mask = s["mask"].tolist()
            for j in range(s["R"]):
                self.m[(i, j)] = mask[j]
                self.m_mtp[(i, j)] = mask[j] * mask[j + 1] if j + 1 < s["R"] else 0
        self.N = sum(self.m.values())
        self.N_mtp = sum(self.m_mtp.values())
        self.A = sum(s["R"] for s in self.batch)
        self.n = {}                                    # (d, c, k) -> owned sum of m
        for t, (r, d, c, k) in self.owner.items():
            self.n[(d, c, k)] = self.n.get((d, c, k), 0) + self.m[t]

    def expected(self, name, t):
        bug, m, mm = self.bug, self.m[t], self.m_mtp[t]
        r, d, c, k = self.owner[t]
        if name == "main":
            return m / max(self.N, 1)
        if name == "kl":
            return 0.1 * m / max(self.n[(d, c, k)] if bug == "kl-microbatch-mean" else self.N, 1)
        if name == "mtp":
            return 0.3 * mm / max(self.N if bug == "mtp-main-count" else self.N_mtp, 1)
        if name == "aux":
            return 0.01 / (self.cp * self.A if bug == "aux-no-cp" else max(self.A, 1))
        raise AssertionError(name)

    def expected_num_tokens(self, name, d, c, k):
        """What the trainer counts for micro-batch k of (d, c): its owned count under the term's mask, but
        the loss-mask count for mtp-main-count's MTP term and the full response lengths for aux-no-cp."""
        owned = [t for t, (r, dd, cc, kk) in self.owner.items() if (dd, cc, kk) == (d, c, k)]
        if name in ("main", "kl") or (name == "mtp" and self.bug == "mtp-main-count"):
            return sum(self.m[t] for t in owned)
        if name == "mtp":
            return sum(self.m_mtp[t] for t in owned)
        if self.bug == "aux-no-cp":
            return sum(self.batch[i]["R"] for i in self.place[d][k])
        return len(owned)


def steps(run):
    for bug in run["bugs"]:
        for step in range(STEPS):
            yield Step(run, bug, step)


def expected_kind(st, name):
    """The §9 diagnosis of w/w* over tokens with w* > 0, computed from the formulas: exact, uniform-scale,
    per-rank, per-microbatch, per-cp-shard (the first that applies)."""
    ratios = {}
    correct = Step.__new__(Step)                       # the same step, judged by the correct trainer's formula
    correct.__dict__.update(st.__dict__)
    correct.bug = "none"
    for t in st.owner:
        want = correct.expected(name, t)
        if want != 0.0:
            ratios[t] = st.expected(name, t) / want

    def constant_within(key):
        groups = {}
        for t, x in ratios.items():
            groups.setdefault(key(t), set()).add(round(x, 9))
        return all(len(v) == 1 for v in groups.values())
    if all(abs(x - 1) < 1e-12 for x in ratios.values()):
        return "exact"
    if constant_within(lambda t: 0):
        return "uniform-scale"
    for kind, key in (("per-rank", lambda t: st.owner[t][1]), ("per-microbatch", lambda t: st.owner[t][1::2]),
                      ("per-cp-shard", lambda t: st.owner[t][1:])):
        if constant_within(key):
            return kind
    return "finer"


# ---- tests ----------------------------------------------------------------------------------------
def test_batch_has_the_edge_cases():
    b = mt.make_batch(SEED, 0, SAMPLES, sft=False)
    assert b[1]["R"] == 0 and b[2]["R"] > 0 and int(b[2]["mask"].sum()) == 0 and b[6]["T"] == 0
    assert all(s["R"] < s["T"] or s["T"] == 0 for s in b)         # no SFT sample: every index owned at any CP
    e = mt.make_batch(SEED, 0, SAMPLES, equal=True)
    assert all((s["T"], s["R"], s["mask"].tolist()) == (9, 6, [1] * 6) for s in e)


def test_capture_metadata_and_records(run):
    for st in steps(run):
        declared = ["kl", "mtp"] if st.bug == "aux-undeclared" else ["kl", "mtp", "aux"]
        for r in range(st.world):
            d, c = divmod(r, st.cp)
            meta, t = st.meta[r], st.cap[r]
            assert meta["terms"] == ",".join(declared)
            for name in declared:
                assert tuple(meta[f"term.{name}.{f}"] for f in ("reduce", "coef", "mask")) == DECLARED[name]
            if st.bug == "aux-undeclared":
                assert not any(key.startswith("term.aux.") for key in meta)
            assert meta["dtype"] == "float32" and meta["reduce"] == "per-token"
            assert t["grad_scale"].item() == 1.0 and t["num_tokens_reduced"].item() == st.N
            assert not t["skipped"].item()
            for k in range(st.M):
                for name in TERMS:
                    p = f"mb.{k}." + ("" if name == "main" else f"term.{name}.")
                    assert t[p + "token_weight"].dtype == torch.float32 == t[p + "token_loss"].dtype
                    assert t[p + "num_tokens"].dtype == torch.int64
                    assert t[p + "num_tokens"].item() == st.expected_num_tokens(name, d, c, k), (st.bug, r, k, name)
                assert f"mb.{k}.term.kl.mask" not in t
        # every response token of every sample is held exactly once (no SFT sample)
        assert sorted(st.owner) == sorted(st.m)


def test_weights_match_each_terms_formula(run):
    for st in steps(run):
        for name in TERMS:
            bad = []
            for t, w in st.w[name].items():
                want = st.expected(name, t)
                ok = (w == 0.0) if want == 0.0 else abs(w - want) <= REL * abs(want)
                if not ok:
                    bad.append((t, st.owner[t], w, want))
            assert not bad, f"{st.bug} step {st.step} {name}: {len(bad)} weights off, e.g. {bad[:4]}"
        if st.bug in BROKEN:          # the bug changes its term's weights (not a coincidence of this batch)
            assert expected_kind(st, BROKEN[st.bug]) != "exact", st.bug
        if st.bug in ("none", "aux-undeclared"):
            # the truth: each term's weights sum to its coefficient (main: 1)
            for name in TERMS:
                total = sum(st.w[name].values())
                assert math.isclose(total, COEF.get(name, 1.0), rel_tol=1e-6), (st.step, name, total)


def test_loss_is_sum_over_terms_of_weight_times_token_loss(run):
    for st in steps(run):
        for r in range(st.world):
            t = st.cap[r]
            for k in range(st.M):
                want = sum(float((t[f"mb.{k}.{p}token_weight"].double() * t[f"mb.{k}.{p}token_loss"].double()).sum())
                           for p in ("", "term.kl.", "term.mtp.", "term.aux."))
                assert math.isclose(t[f"mb.{k}.loss"].item(), want, rel_tol=1e-5, abs_tol=1e-7), (st.bug, r, k)


def term_losses(model, ref, s, j):
    """(l, l_kl, l_mtp, l_aux) of RL response index j, written out again: logit P-1+j predicts tokens[P+j];
    the MTP head at that logit predicts tokens[P+j+1] (target 0 for the last index)."""
    tokens, T, R = s["tokens"], s["T"], s["R"]
    P = T - R
    pos, tgt = P - 1 + j, int(tokens[P + j])
    nxt = int(tokens[P + j + 1]) if j + 1 < R else 0
    h = model.hidden(tokens)[pos]
    z = model.head(h)
    lp = torch.log_softmax(z, 0)[tgt]
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(tokens)[pos], 0)[tgt]
    return -lp, 0.5 * (lp - ref_lp) ** 2, -torch.log_softmax(model.mtp_head(h), 0)[nxt], torch.logsumexp(z, 0) ** 2


def test_measured_weights_reassemble_the_trainers_gradient(run):
    """sum over terms and tokens of w grad(l), recomputed in one process in float64 from the measured weights
    (the reference model = the step-0 parameters), equals the all-reduced gradient every rank ended the step
    with (rtol 1e-5)."""
    def model_of(path):
        model = mt.TinyLM(mtp=True).to(torch.float64)
        model.load_state_dict({k: v.to(torch.float64) for k, v in torch.load(path).items()})
        return model

    for st in steps(run):
        saved = [torch.load(os.path.join(st.dir, f"grad-step{st.step}-rank{r}.pt")) for r in range(st.world)]
        assert "mtp_head.weight" in saved[0]
        for r in range(1, st.world):
            for name in saved[0]:
                torch.testing.assert_close(saved[r][name], saved[0][name], rtol=0, atol=0)
        g = {name: torch.zeros_like(v, dtype=torch.float64) for name, v in saved[0].items()}
        for r in range(st.world):
            model = model_of(os.path.join(st.dir, f"params-step{st.step}-rank{r}.pt"))
            ref = model_of(os.path.join(st.dir, f"params-step0-rank{r}.pt")).requires_grad_(False)
            parts = []
            for t, (rr, d, c, k) in st.owner.items():
                if rr != r:
                    continue
                ls = term_losses(model, ref, st.batch[t[0]], t[1])
                parts += [st.w[name][t] * l for name, l in zip(TERMS, ls) if st.w[name][t] != 0.0]
            if not parts:
                continue
            torch.stack(parts).sum().backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    g[name] += p.grad
        scale = max(max(v.abs().max().item() for v in g.values()), 1e-30)
        for name in g:
            torch.testing.assert_close(saved[0][name].to(torch.float64), g[name], rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda s: f"{st.bug} step {st.step} {name}: {s}")
        if st.step > 0:      # the KL term pulls once the model has moved from the reference
            assert any(st.w["kl"][t] != 0.0 for t in st.owner)


# ---- lossguard audit on these captures ---------------------------------------------------------------
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lossguard_cli import LOSSGUARD, audit, check_of, load_step, term_of  # noqa: E402,F401


BROKEN = {"kl-microbatch-mean": "kl", "mtp-main-count": "mtp", "aux-no-cp": "aux"}


def test_audit_names_the_broken_term(run):
    for bug in run["bugs"]:
        d = os.path.join(run["out"], bug) if len(run["bugs"]) > 1 else run["out"]
        code, doc, err = audit(d)
        where = f"{bug} dp{run['dp']} cp{run['cp']}: {err}"
        assert doc is not None, where
        by_step = {s["step"]: s for s in doc["steps"]}
        assert sorted(by_step) == list(range(STEPS)), where
        for step in range(STEPS):
            s = by_step[step]
            st = Step(run, bug, step)
            if bug == "none":
                assert code == 0, where
                assert all(c["ok"] is not False for c in s["checks"]), (where, s["checks"])
                for name in ("kl", "mtp", "aux"):
                    assert check_of(s, f"{name}.weights")["ok"] is True, where
                    t = term_of(s, name)
                    assert (t["reduce"], t["mask"]) == (DECLARED[name][0], DECLARED[name][2]), where
                    assert math.isclose(float(t["coef"]), COEF[name], rel_tol=1e-12), where
                    assert t["diagnosis"]["kind"] == "exact", (where, t)
                continue
            assert code == 1, where
            if bug == "aux-undeclared":
                assert check_of(s, "aux.declared")["ok"] is False, (where, s["checks"])
                for name in ("kl", "mtp"):
                    assert check_of(s, f"{name}.weights")["ok"] is True, where
                continue
            broken = BROKEN[bug]
            assert check_of(s, f"{broken}.weights")["ok"] is False, (where, s["checks"])
            assert check_of(s, "weights")["ok"] is True, where          # the main term is right
            for other in ("kl", "mtp", "aux"):
                if other != broken:
                    assert check_of(s, f"{other}.weights")["ok"] is True, (where, other)
            dg = term_of(s, broken)["diagnosis"]
            assert dg is not None, where
            if bug == "kl-microbatch-mean":
                want = expected_kind(st, "kl")
                assert dg["kind"] == want, (where, dg, want)
                if want == "uniform-scale":          # equal lengths, all-ones masks: every n_k = N/M
                    assert math.isclose(dg["scale"], run["M"], rel_tol=1e-6), (where, dg)
            elif bug == "mtp-main-count":
                assert dg["kind"] == "uniform-scale", (where, dg)
                assert math.isclose(dg["scale"], st.N_mtp / st.N, rel_tol=1e-6), (where, dg, st.N_mtp, st.N)
            elif bug == "aux-no-cp":                  # run at cp > 1 only (at cp 1 it is correct)
                assert dg["kind"] == "uniform-scale", (where, dg)
                assert math.isclose(dg["scale"], 1 / run["cp"], rel_tol=1e-6), (where, dg)
