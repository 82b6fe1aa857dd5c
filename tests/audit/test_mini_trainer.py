"""The mini trainer under torchrun (Gloo, CPU) records docs/semantics.md §10 captures whose numbers are the truth:

* the files exist, one per rank and step, with the metadata and the samples the trainer placed;
* the measured weights w_t = token_weight_t * grad_scale, mapped back to (sample, response index)
  through zigzag_owned, reassemble the trainer's own all-reduced parameter gradient when the full-batch
  gradient sum_t w_t grad(l_t) is recomputed in one process (float64) — for every bug switch;
* --bug none gives w_t = m_t / N; each bug gives the weights its formula predicts (derived here from
  the trainer's arithmetic, independently of the trainer's code), and the counts, scales and skip
  decisions it records are those the formula says.

    ~/.cache/lossguard/venv/bin/python -m pytest -q tests/audit
"""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
TRAINER = os.path.join(HERE, "mini_trainer.py")
sys.path.insert(0, os.path.join(ROOT, "python"))
import lossguard_capture as lc  # noqa: E402

_spec = importlib.util.spec_from_file_location("lossguard_mini_trainer", TRAINER)
mt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mt)

CONFIGS = [(1, 2), (2, 2), (2, 1), (1, 4)]      # (dp, cp)
M, STEPS, EMPTY, SPARSE, SEED, SAMPLES = 2, 4, 1, 2, 3, 12
BUGS = ["none", "microbatch-mean", "count-dp-only", "full-sample-count", "clamp-cp1", "missing-cp-scale",
        "local-skip"]
REL = 1e-6


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"dp{d}-cp{c}" for d, c in CONFIGS])
def run(request, tmp_path_factory):
    dp, cp = request.param
    out = str(tmp_path_factory.mktemp(f"mini-dp{dp}-cp{cp}"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * cp),
           TRAINER, "--out", out, "--dp", str(dp), "--cp", str(cp), "--microbatches", str(M), "--bug", "all",
           "--seed", str(SEED), "--steps", str(STEPS), "--samples", str(SAMPLES), "--empty-step", str(EMPTY),
           "--sparse-step", str(SPARSE), "--check-grad"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return dp, cp, out


# ---- the truth, derived here ----------------------------------------------------------------------
def batch_of(step):
    return mt.make_batch(SEED, step, SAMPLES, empty=step == EMPTY, sparse=step == SPARSE)


def my_placement(n, dp, m):
    """docs/semantics.md §7 contiguous placement, written out again: DP blocks, then micro-batches, first ones longer."""
    def blocks(xs, parts):
        q, r = divmod(len(xs), parts)
        out, at = [], 0
        for p in range(parts):
            size = q + (p < r)
            out.append(xs[at:at + size])
            at += size
        return out
    return [blocks(b, m) for b in blocks(list(range(n)), dp)]


def nll(model, tokens, T, R, j):
    """l for response index j: RL -> logit P-1+j, target tokens[P+j]; SFT -> logit j, target tokens[j+1]
    (the last index has no target: label 0)."""
    if R == T:
        pos, tgt = j, (int(tokens[j + 1]) if j + 1 < T else 0)
    else:
        P = T - R
        pos, tgt = P - 1 + j, int(tokens[P + j])
    z = model(tokens)[pos]
    return torch.logsumexp(z, 0) - z[tgt]


class Step:
    """One (bug, step) of a run: the captures, mapped back to global (sample, response index)."""

    def __init__(self, dp, cp, out, bug, step):
        self.dp, self.cp, self.bug, self.step = dp, cp, bug, step
        self.dir = os.path.join(out, bug)
        self.world = dp * cp
        self.batch = batch_of(step)
        self.place = my_placement(len(self.batch), dp, M)
        self.cap, self.meta = load_step(self.dir, step, self.world)
        # measured weights and ownership
        self.w, self.owner = {}, {}
        for r in range(self.world):
            d, c = divmod(r, cp)
            gs = self.cap[r]["grad_scale"].item()
            for k, idx in enumerate(self.place[d]):
                tw = self.cap[r][f"mb.{k}.token_weight"].to(torch.float64)
                at = 0
                for i in idx:
                    s = self.batch[i]
                    for j in lc.zigzag_owned(s["T"], s["R"], cp, c):
                        assert (i, j) not in self.w, f"token {(i, j)} held twice"
                        self.w[(i, j)] = tw[at].item() * gs
                        self.owner[(i, j)] = (r, d, c, k)
                        at += 1
                assert at == tw.numel(), f"rank {r} mb {k}: {tw.numel()} weights, {at} owned tokens"
        self.m = {(i, j): int(self.batch[i]["mask"][j]) for (i, j) in self.w}
        self.msum = [int(s["mask"].sum()) for s in self.batch]
        self.N = sum(self.msum)
        # n[(d, c, k)]: the owned mask count of CP rank c in micro-batch k of DP rank d
        self.n = {}
        for t, (r, d, c, k) in self.owner.items():
            self.n[(d, c, k)] = self.n.get((d, c, k), 0) + self.m[t]

    def expected_weight(self, t):
        bug, cp, dp, m, N = self.bug, self.cp, self.dp, self.m[t], self.N
        r, d, c, k = self.owner[t]
        clamp_total = sum(max(x, 1) for x in self.msum)
        if m == 0:
            return 0.0
        if bug in ("none", "local-skip"):
            return m / max(N, 1)
        if bug == "microbatch-mean":          # mean over the rank's micro-batch, / M, DDP mean over dp*cp
            return m / (self.n[(d, c, k)] * M * dp * cp)
        if bug == "count-dp-only":            # count summed over DP ranks of the same CP rank only
            n_dp = sum(v for (dd, cc, kk), v in self.n.items() if cc == c)
            return m / max(n_dp, 1)
        if bug == "full-sample-count":        # every CP rank counts every sample's full mask
            return m / max(cp * N, 1)
        if bug == "clamp-cp1":
            return m / clamp_total if cp == 1 else m / max(N, 1)
        if bug == "missing-cp-scale":         # slime's count (cp copies of max(m_i,1)) without x cp
            return m / (cp * clamp_total)
        raise AssertionError(bug)

    def expected_num_tokens(self, d, c, k):
        idx = self.place[d][k]
        full = sum(self.msum[i] for i in idx)
        clamped = sum(max(self.msum[i], 1) for i in idx)
        owned = self.n.get((d, c, k), 0)
        if self.bug == "full-sample-count":
            return full
        if self.bug == "missing-cp-scale" or (self.bug == "clamp-cp1" and self.cp == 1):
            return clamped
        return owned

    def expected_reduced(self, c):
        bug, cp, N = self.bug, self.cp, self.N
        clamp_total = sum(max(x, 1) for x in self.msum)
        return {"none": N, "local-skip": N, "microbatch-mean": None,
                "count-dp-only": sum(v for (d, cc, k), v in self.n.items() if cc == c),
                "full-sample-count": cp * N, "clamp-cp1": clamp_total if cp == 1 else N,
                "missing-cp-scale": cp * clamp_total}[bug]

    def expected_skip(self, r):
        d, c = divmod(r, self.cp)
        if self.bug == "local-skip":
            return sum(v for (dd, cc, k), v in self.n.items() if (dd, cc) == (d, c)) == 0
        total = sum(self.expected_num_tokens(dd, cc, kk) for dd in range(self.dp) for cc in range(self.cp)
                    for kk in range(len(self.place[dd])))
        return total == 0


def steps(run):
    dp, cp, out = run
    for bug in BUGS:
        for step in range(STEPS):
            yield Step(dp, cp, out, bug, step)


# ---- tests ----------------------------------------------------------------------------------------
def test_capture_files_and_metadata(run):
    dp, cp, out = run
    world = dp * cp
    for bug in BUGS:
        names = sorted(os.listdir(os.path.join(out, bug)))
        caps = [n for n in names if n.endswith(".safetensors")]
        assert caps == [f"step{s:06d}-rank{r:05d}.safetensors" for s in range(STEPS) for r in range(world)]
        assert not [n for n in names if n.startswith(".tmp")]
    for st in steps(run):
        for r in range(st.world):
            d, c = divmod(r, cp)
            assert st.meta[r] == {
                "lossguard.schema": "audit/1", "step": str(st.step), "rank": str(r), "world_size": str(world),
                "tp": "1", "pp": "1", "cp": str(cp), "dp": str(dp), "tp_rank": "0", "pp_rank": "0",
                "cp_rank": str(c), "dp_rank": str(d), "cp_layout": "zigzag", "reduce": "per-token",
                "num_microbatches": str(M), "metrics.keys": "nll", "dtype": "float32"}
            t = st.cap[r]
            for k, idx in enumerate(st.place[d]):
                p = f"mb.{k}."
                assert t[p + "sample_indices"].tolist() == idx
                assert t[p + "total_lengths"].tolist() == [st.batch[i]["T"] for i in idx]
                assert t[p + "response_lengths"].tolist() == [st.batch[i]["R"] for i in idx]
                assert t[p + "tokens"].tolist() == [x for i in idx for x in st.batch[i]["tokens"].tolist()]
                assert t[p + "loss_masks"].tolist() == [x for i in idx for x in st.batch[i]["mask"].tolist()]
                assert t[p + "cp_size"].item() == cp and t[p + "dummy"].item() == 0
                assert t[p + "loss"].dtype == torch.float64
                assert t[p + "token_weight"].dtype == torch.float32 == t[p + "token_loss"].dtype
            assert t["global_batch_size"].item() == SAMPLES
            assert t["grad_scale"].dtype == torch.float64 and t["grad_norm"].dtype == torch.float64
            assert t["skipped"].dtype == torch.int64
            assert t["metrics.values"].shape == (2,)


def test_batch_has_the_edge_cases():
    b = batch_of(0)
    assert b[1]["R"] == 0 and b[2]["R"] > 0 and int(b[2]["mask"].sum()) == 0
    assert b[3]["R"] == b[3]["T"] and int(b[3]["mask"][-1]) == 0 and b[6]["T"] == 0
    assert sum(int(s["mask"].sum()) for s in b) > 0
    assert sum(int(s["mask"].sum()) for s in batch_of(EMPTY)) == 0
    assert sum(int(s["mask"].sum()) for s in batch_of(SPARSE)) == 1


def test_every_effective_token_held_exactly_once(run):
    dp, cp, out = run
    for st in steps(run):
        if st.bug != "none":
            continue
        for i, s in enumerate(st.batch):
            held = sorted(j for (ii, j) in st.w if ii == i)
            want = list(range(s["T"] - 1)) if (s["R"] == s["T"] and cp > 1 and s["T"] > 0) else list(range(s["R"]))
            assert held == want, (i, s["T"], s["R"])
        assert sum(st.m.values()) == st.N            # I2 on the real run (SFT masks are pre-shifted)


def test_measured_weights_reassemble_the_trainers_gradient(run):
    """sum_t w_t grad(l_t), recomputed in one process in float64 from the measured weights, equals the
    all-reduced, scaled gradient every rank ended the step with (rtol 1e-5)."""
    dp, cp, out = run
    for st in steps(run):
        saved = [torch.load(os.path.join(st.dir, f"grad-step{st.step}-rank{r}.pt")) for r in range(st.world)]
        for r in range(1, st.world):
            for name in saved[0]:
                torch.testing.assert_close(saved[r][name], saved[0][name], rtol=0, atol=0)
        g = {name: torch.zeros_like(v, dtype=torch.float64) for name, v in saved[0].items()}
        for r in range(st.world):
            params = torch.load(os.path.join(st.dir, f"params-step{st.step}-rank{r}.pt"))
            model = mt.TinyLM().to(torch.float64)
            model.load_state_dict({k: v.to(torch.float64) for k, v in params.items()})
            terms = [st.w[t] * nll(model, st.batch[t[0]]["tokens"], st.batch[t[0]]["T"], st.batch[t[0]]["R"], t[1])
                     for t, (rr, d, c, k) in st.owner.items() if rr == r and st.w[t] != 0.0]
            if not terms:
                continue
            torch.stack(terms).sum().backward()
            for name, p in model.named_parameters():
                g[name] += p.grad
        scale = max(max(v.abs().max().item() for v in g.values()), 1e-30)
        for name in g:
            torch.testing.assert_close(saved[0][name].to(torch.float64), g[name], rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda s: f"{st.bug} step {st.step} {name}: {s}")
        if st.N == 0:
            assert all(v.abs().max().item() == 0.0 for v in saved[0].values())


def test_weights_match_each_bugs_formula(run):
    dp, cp, out = run
    for st in steps(run):
        bad = []
        for t, w in st.w.items():
            want = st.expected_weight(t)
            if want == 0.0:
                ok = w == 0.0
            else:
                ok = abs(w - want) <= REL * abs(want)
            if not ok:
                bad.append((t, st.owner[t], w, want))
        assert not bad, f"{st.bug} dp{dp} cp{cp} step {st.step}: {len(bad)} weights off, e.g. {bad[:4]}"
        if st.bug == "none" and st.N > 0:
            # the truth m_t / N: every effective token's weights sum to 1
            assert math.isclose(sum(st.w.values()), 1.0, rel_tol=1e-6)


def test_counts_scales_and_decisions(run):
    dp, cp, out = run
    for st in steps(run):
        decisions = []
        for r in range(st.world):
            d, c = divmod(r, cp)
            t = st.cap[r]
            for k in range(M):
                assert t[f"mb.{k}.num_tokens"].item() == st.expected_num_tokens(d, c, k), (st.bug, st.step, r, k)
            want = st.expected_reduced(c)
            if want is None:
                assert "num_tokens_reduced" not in t
                assert t["grad_scale"].item() == 1.0 / (dp * cp)
            else:
                assert t["num_tokens_reduced"].item() == want, (st.bug, st.step, r)
                assert t["grad_scale"].item() == 1.0 / max(want, 1)
            skipped = bool(t["skipped"].item())
            assert skipped == st.expected_skip(r), (st.bug, st.step, r)
            decisions.append(skipped)
            grad = torch.load(os.path.join(st.dir, f"grad-step{st.step}-rank{r}.pt"))
            norm = math.sqrt(sum(float((v.to(torch.float64) ** 2).sum()) for v in grad.values()))
            if skipped:
                assert t["grad_norm"].item() == 0.0
            else:
                assert math.isclose(t["grad_norm"].item(), norm, rel_tol=1e-6, abs_tol=1e-12)
        # what each switch does to the skip decision, spelled out
        if st.step == EMPTY:
            if st.bug == "missing-cp-scale" or (st.bug == "clamp-cp1" and cp == 1):
                assert not any(decisions)      # the clamped count is never 0: steps on a no-signal batch
            else:
                assert all(decisions)
        elif st.step == SPARSE:
            if st.bug == "local-skip" and st.world > 1:
                assert decisions.count(False) == 1      # only the one rank that owns the token steps
            else:
                assert not any(decisions)
        elif st.step == SPARSE + 1 and st.bug == "local-skip" and st.world > 1:
            # the disagreement left the replicas with different parameters
            params = [torch.load(os.path.join(st.dir, f"params-step{st.step}-rank{r}.pt")) for r in range(st.world)]
            assert any(not torch.equal(params[r]["head.bias"], params[0]["head.bias"]) for r in range(st.world))


def test_loss_is_sum_of_weight_times_token_loss(run):
    for st in steps(run):
        for r in range(st.world):
            d, c = divmod(r, st.cp)
            t = st.cap[r]
            for k in range(M):
                loss = t[f"mb.{k}.loss"].item()
                tw, tl = t[f"mb.{k}.token_weight"].double(), t[f"mb.{k}.token_loss"].double()
                if st.bug == "microbatch-mean" and st.n.get((d, c, k), 0) == 0:
                    assert math.isnan(loss) and not tw.any()   # a mean over 0 tokens: NaN value, 0 gradient
                else:
                    assert math.isclose(loss, float((tw * tl).sum()), rel_tol=1e-5, abs_tol=1e-6)


# ---- lossguard audit on these captures ---------------------------------------------------------------
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lossguard_cli import LOSSGUARD, audit, check_of, load_step  # noqa: E402,F401


def test_audit_names_every_bug(run):
    """audit passes the correct trainer and names each bug where its formula says it shows."""
    dp, cp, out = run
    for bug in BUGS:
        code, doc, err = audit(os.path.join(out, bug))
        assert doc is not None, err
        by_step = {s["step"]: s for s in doc["steps"]}
        assert sorted(by_step) == list(range(STEPS))
        s0, empty, sparse = by_step[0], by_step[EMPTY], by_step[SPARSE]
        assert empty["expected"] == "skip" and s0["expected"] == "step"
        where = f"{bug} dp{dp} cp{cp}: {err}"
        if bug == "none":
            assert code == 0, where
            assert all(c["ok"] is not False for s in doc["steps"] for c in s["checks"]), where
            assert "megatron-per-token" in s0["matches"], where
        elif bug == "microbatch-mean":
            assert code == 1, where
            assert s0["diagnosis"]["kind"] == ("per-cp-shard" if cp > 1 else "per-microbatch"), where
            assert "megatron-mean" in s0["matches"], where
            # The NaN loss of a mean over zero tokens is a finding, not an inconsistency.
            assert check_of(empty, "loss")["ok"] is True, where
            assert any(f["kind"] == "mean_over_zero_tokens" for f in doc["findings"]), where
        elif bug == "count-dp-only":
            if cp == 1:
                assert code == 0, where  # over DP is over DP x CP when CP = 1
            else:
                assert code == 1, where
                assert s0["diagnosis"]["kind"] == "per-cp-shard", where
                assert check_of(s0, "counts")["ok"] is False, where
        elif bug == "full-sample-count":
            if cp == 1:
                assert code == 0, where
            else:
                assert code == 1, where
                assert s0["diagnosis"]["kind"] == "uniform-scale", where
                assert math.isclose(s0["diagnosis"]["scale"], 1 / cp, rel_tol=1e-6), where
                assert check_of(s0, "counts")["ok"] is False, where
                # x1/cp is set by the layout: the weights fail on their own, not only the counts (SPEC §9)
                assert s0["diagnosis"]["layout_dependent"] is True, (where, s0["diagnosis"])
                assert check_of(s0, "weights")["ok"] is False, where
        elif bug == "clamp-cp1":
            if cp > 1:
                assert code == 0, where
            else:
                assert code == 1, where
                assert check_of(empty, "decision")["ok"] is False, where  # counted 1 per sample: never skips
        elif bug == "missing-cp-scale":
            assert code == 1, where
            assert check_of(empty, "decision")["ok"] is False, where
            if cp > 1:
                assert s0["diagnosis"]["kind"] == "uniform-scale", where
                assert any(m.startswith("slime with") for m in s0["matches"]), (where, s0["matches"])
                # slime's missing x cp: x1/cp fails the weights by itself, whatever the counts say
                assert s0["diagnosis"]["layout_dependent"] is True, (where, s0["diagnosis"])
                assert check_of(s0, "weights")["ok"] is False, where
        elif bug == "local-skip":
            assert code == 1, where
            assert check_of(sparse, "decision")["ok"] is False, where
            assert check_of(s0, "weights")["ok"] is True, where


def test_audit_refuses_captures_that_do_not_fit(run, tmp_path):
    """Exit 2 naming the file, rank and field: a missing rank, a sample that differs, a short token_weight."""
    import shutil
    from safetensors.torch import save_file
    dp, cp, out = run
    src = os.path.join(out, "none")

    def fresh(name):
        d = tmp_path / name
        shutil.copytree(src, d)
        return d

    d = fresh("missing")
    os.remove(d / "step000000-rank00001.safetensors")
    code, _, err = audit(str(d))
    assert code == 2 and "no capture from the loss-computing rank" in err, err

    def rewrite(path, change):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path), metadata=meta)

    d = fresh("short")
    def shorten(t):
        for k in ("mb.0.token_weight", "mb.0.token_loss"):
            t[k] = t[k][:-1].clone()
    rewrite(d / "step000000-rank00000.safetensors", shorten)
    code, _, err = audit(str(d))
    assert code == 2 and "token_weight has" in err and "step000000-rank00000" in err, err

    if cp > 1:  # the CP ranks of one group hold the same samples: make rank 1's copy differ
        d = fresh("differs")
        rewrite(d / "step000000-rank00001.safetensors",
                lambda t: t.__setitem__("mb.0.tokens", (t["mb.0.tokens"] + 1).clone()))
        code, _, err = audit(str(d))
        assert code == 2 and "differs between" in err, err
