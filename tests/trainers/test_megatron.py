"""lossguard_capture.megatron against megatron-core's real training step (CPU, Gloo, a tiny GPTModel).

tests/trainers/megatron_driver.py runs, at DP x CP in {1, 2}^2 (1, 2, 2 and 4 processes under torchrun),
Megatron's ``initialize_model_parallel``, ``get_batch_on_this_cp_rank`` (the zig-zag CP split),
``forward_backward_no_pipelining`` with M = 2 micro-batches, its ``DistributedDataParallel``,
``finalize_model_grads`` and ``get_megatron_optimizer``, for five loss paths, each twice from the same
seed, with the adapter and without (lossguard_capture.megatron_cpu: the few tensors Megatron allocates on the GPU by name
are put on the CPU; nothing else changes).  The paths (megatron-core 0.15.3, 0.16.0 or 0.16.1, whichever is
installed; line numbers are 0.16.1's; weights ``w_t`` of token ``t`` in the gradient the optimizer applies;
``m_t`` its mask; ``n_c`` the CP-local count of its micro-batch on its CP rank, ``n`` the micro-batch's count
over all CP ranks; ``N`` the step's count):

  a     calculate_per_token_loss, 3-tuple (sum, CP-local count, report)   w_t = m_t / N
  b     no per-token loss, the same 3-tuple                                w_t = m_t / (max(n_c, 1) M dp cp)
  c     no per-token loss, 2-tuple sum / max(n, 1) (n all-reduced over CP) w_t = m_t / (max(n, 1) M dp)
  cnan  as c without the clamp: an empty micro-batch's tokens get 0/0 = NaN, and so does the gradient
  d     calculate_per_token_loss with c's 2-tuple (misconfiguration)      w_t = m_t cp / (max(n, 1) M)
  mtp-a a on a GPTModel with one MTP layer (mtp_num_layers 1, mtp_loss_scaling_factor f = 0.3): main as a;
        Megatron's MTP loss, the term ``mtp`` (coef f, mask roll:1: r_t = m_{t+1}):    w_t = f r_t / N
        (N the MAIN count: finalize_model_grads divides every gradient by it, gpt_model.py:654-657)
  mtp-b b on that model: main as b; mtp                     w_t = f r_t / (n^r_c M dp cp)
        (n^r_c the CP-local rolled-mask count of the micro-batch, unclamped: gpt_model.py:658-661)

The tests prove

(a) the adapter changes nothing: every backpropagated loss, every report, every ``main_grad`` after
    finalize_model_grads and the parameters after ``optimizer.step()`` are bit for bit those of the run
    without it;
(b) the measured weights are the truth: ``sum_t w_t grad(l_t)`` with ``w_t = token_weight_t * grad_scale``
    from the captures (``l_t`` recomputed in float64 on the full rows) equals the ``main_grad`` of every
    rank, and the weights are the formulas above exactly;
(c) the lossguard contract components reproduce them (``lossguard weights --contract``), and ``lossguard
    audit`` passes path a and fails the others with the diagnosis docs/gallery.md lists;
(d) with MTP the same three hold for both terms: the applied gradient is sum_k sum_t w^k_t grad(l^k_t) over
    main and mtp with the measured weights; audit names mtp-a's MTP term as divided by the main count (a
    uniform N_mtp/N relative to its objective, reproduced by megatron-mtp-per-token) and mtp-b's as
    normalised per CP shard by its own rolled count (megatron-mtp);

and that the adapter refuses what it does not handle (no finalize function, a model that is not
Megatron's DDP, a loss_func that is not a 2/3-tuple or does not receive per-token losses, THD, a row whose
last position carries loss, MTP without the model) with a clear error and no capture, and records a skipped
step; and that Megatron's unclamped MTP count (an MTP-less micro-batch without per-token loss) gives NaN
weights and gradients, and a model called without loss_mask trains MTP on masked positions (audit says so).

    scripts/setup-trainers.sh
    ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q tests/trainers/test_megatron.py
"""
import json
import math
import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest
from lossguard_capture.megatron_cpu import no_cuda_build

with no_cuda_build():                     # megatron-core 0.15.x builds a CUDA allocator at import (megatron_cpu)
    pytest.importorskip("megatron.core")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
DRIVER = os.path.join(HERE, "megatron_driver.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import gallery  # noqa: E402  (docs/gallery.md's rows, when LOSSGUARD_GALLERY_DIR is set)
import megatron_driver as drv  # noqa: E402

import lossguard_capture as lc  # noqa: E402
from harness import HAVE_BIN, LOSSGUARD, audit, child_env, same  # noqa: E402


TOPOS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)]            # (dp, cp, tp)
PATHS = ["a", "b", "c", "cnan", "d", "mtp-a", "mtp-b"]
TP_PATHS = ["a", "b", "mtp-a", "mtp-b"]   # TP 2: Megatron's tensor-parallel layers and vocab-parallel loss
MTP_PATHS = drv.MTP_PATHS
CASES = [(dp, cp, tp, p) for dp, cp, tp in TOPOS for p in (PATHS if tp == 1 else TP_PATHS)]
IDS = [f"dp{dp}-cp{cp}" + (f"-tp{tp}" if tp > 1 else "") + f"-{p}" for dp, cp, tp, p in CASES]

#: lossguard contract components (docs/semantics.md §9) that reproduce each path's weights
CONTRACTS = {
    "a": "megatron-per-token",                                             # norm=global:dp-cp,grad=sum
    "b": "megatron-mean",                                                  # norm=microbatch,scale=1/M,grad=mean:dp-cp
    "c": "count=full-sample,norm=microbatch,scale=cp*1/M,grad=mean:dp-cp",
    "cnan": "count=full-sample,norm=microbatch,scale=cp*1/M,grad=mean:dp-cp",   # where finite
    "d": "count=full-sample,norm=microbatch,scale=cp*1/M,grad=sum",
    "mtp-a": "megatron-per-token",
    "mtp-b": "megatron-mean",
}
#: the MTP term's contract (its weights relative to its coefficient): a preset of SPEC §11
TERM_CONTRACTS = {"mtp-a": "megatron-mtp-per-token", "mtp-b": "megatron-mtp"}
MTP_TERM = "mtp:per-token:0.3:roll:1"      # lossguard weights --term: what the adapter declares

#: step 0's diagnosis (audit's "kind") per path and (dp, cp, tp)
KIND0 = {
    "b": {(1, 1, 1): "per-microbatch", (2, 1, 1): "per-rank", (1, 2, 1): "per-cp-shard", (2, 2, 1): "per-cp-shard",
          (1, 1, 2): "per-microbatch"},
    "c": {(1, 1, 1): "per-microbatch", (2, 1, 1): "per-rank", (1, 2, 1): "per-microbatch", (2, 2, 1): "per-rank"},
    "d": {(1, 1, 1): "per-microbatch", (2, 1, 1): "per-rank", (1, 2, 1): "per-microbatch", (2, 2, 1): "per-rank"},
}
KIND0["cnan"] = KIND0["c"]                 # its finite weights are c's
KIND0["a"] = {t: "exact" for t in KIND0["b"]}
KIND0["mtp-a"] = KIND0["a"]
KIND0["mtp-b"] = {(1, 1, 1): "per-microbatch", (2, 1, 1): "per-microbatch", (1, 2, 1): "per-cp-shard",
                  (2, 2, 1): "per-cp-shard", (1, 1, 2): "per-microbatch"}
#: step 0's diagnosis of the MTP term (relative to main): mtp-a a uniform N_mtp/N (the main count divides it)
MTP_KIND0 = {"mtp-a": {t: "uniform-scale" for t in KIND0["b"]}, "mtp-b": KIND0["mtp-b"]}

#: the installed megatron-core (one of lossguard_capture.megatron.SPEC.verified)
MEGATRON_CORE = version("megatron-core")
#: the sites lossguard_capture.megatron_cpu.cuda_on_cpu rewrote (its docstring lists them), per verified release
#: (the same files and code at other lines in 0.15.3): (always, at CP > 1, at TP > 1).  The MTP paths add the MTP
#: loss tracker (every layout), at CP > 1 roll_tensor's receive buffers, at TP > 1 the all-gather of the MTP
#: layer's tensor-parallel hidden states
_SITES_016 = (["distributed/param_and_grad_buffer.py:803", "optimizer/clip_grads.py:103", "optimizer/optimizer.py:907",
               "pipeline_parallel/schedules.py:596", "transformer/multi_token_prediction.py:337", "utils.py:1207"],
              "transformer/multi_token_prediction.py:176", "tensor_parallel/mappings.py:91")
CPU_SITES_BY_RELEASE = {
    "0.16.1": _SITES_016,
    "0.16.0": _SITES_016,
    "0.15.3": (["distributed/param_and_grad_buffer.py:722", "optimizer/clip_grads.py:103", "optimizer/optimizer.py:903",
                "pipeline_parallel/schedules.py:573", "transformer/multi_token_prediction.py:225", "utils.py:1029"],
               "transformer/multi_token_prediction.py:149", "tensor_parallel/mappings.py:91"),
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The five driver runs, one after the other ({(dp, cp, tp): out_dir}); the DP 1 CP 1 run also runs the
    guards.  ``LOSSGUARD_MEGATRON_RUNS=DIR`` keeps them in DIR and
    reuses those found there (while changing the tests, not the driver)."""
    out = {}
    keep = os.environ.get("LOSSGUARD_MEGATRON_RUNS")      # reuse (or keep) the runs in this folder
    for dp, cp, tp in TOPOS:
        if keep:
            d = os.path.join(keep, f"dp{dp}-cp{cp}-tp{tp}")
            if os.path.exists(os.path.join(d, "meta.json")):
                out[(dp, cp, tp)] = d
                continue
            os.makedirs(d, exist_ok=True)
        else:
            d = str(tmp_path_factory.mktemp(f"megatron-dp{dp}-cp{cp}-tp{tp}"))
        args = [DRIVER, "--out", d, "--cp", str(cp), "--tp", str(tp),
                "--paths", ",".join(PATHS if tp == 1 else TP_PATHS)]
        if (dp, cp, tp) == (1, 1, 1):
            args.append("--guards")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * cp * tp),
               *args]
        gallery.remember_run(d, cmd)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        out[(dp, cp, tp)] = d
    return out


def run_dir(runs, dp, cp, tp, path, which="adapter"):
    return os.path.join(runs[(dp, cp, tp)], path, which)


def captures(runs, dp, cp, tp, path, step):
    d = os.path.join(run_dir(runs, dp, cp, tp, path), "captures", f"step{step:06d}")
    caps = []
    for r in range(dp * cp * tp):
        p = os.path.join(d, f"step{step:06d}-rank{r:05d}.safetensors")
        with safe_open(p, framework="pt") as f:
            meta = f.metadata()
        caps.append((load_file(p), meta))
    return caps


# ---- the layout and the weight formulas, from the batch ------------------------------------------------
def cp_owner(j, cp):
    """The CP rank holding position j of a row (zig-zag: chunk r and chunk 2cp-1-r of S/(2cp) positions)."""
    if cp == 1:
        return 0
    chunk = j // (drv.S // (2 * cp))
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def rows_of(dp, d, k):
    b = drv.ROWS // (drv.M * dp)
    return [(k * dp + d) * b + i for i in range(b)]


def expected_weights(path, step, dp, cp):
    """{(row, response index j): w_t} by the formula of the path (module docstring)."""
    m = drv.masks_of(path)[step]
    path = {"mtp-a": "a", "mtp-b": "b"}.get(path, path)         # the main term of the MTP paths
    M = drv.M
    N = sum(m[i][j] for i in range(drv.ROWS) for j in range(drv.S - 1))
    out = {}
    for d in range(dp):
        for k in range(M):
            rows = rows_of(dp, d, k)
            n_c = [sum(m[i][j] for i in rows for j in range(drv.S - 1) if cp_owner(j, cp) == c) for c in range(cp)]
            n = sum(n_c)
            for i in rows:
                for j in range(drv.S - 1):
                    mt = m[i][j]
                    if path == "a":
                        w = mt / N if N else 0.0
                    elif path == "b":
                        w = mt / (max(n_c[cp_owner(j, cp)], 1) * M * dp * cp)
                    elif path == "c":
                        w = mt / (max(n, 1) * M * dp)
                    elif path == "cnan":
                        w = mt / (n * M * dp) if n else math.nan
                    else:
                        w = mt * cp / (max(n, 1) * M)
                    out[(i, j)] = w
    return out


def rolled(m_row):
    """Megatron's MTP mask at depth 1 over response indices 0..S-2: r_j = m_{j+1} (multi_token_prediction.py:
    158-161 rolls the mask left by one and zeroes the last position; m_{S-1} = 0 in every row here)."""
    return [m_row[j + 1] for j in range(drv.S - 1)]


def expected_mtp_weights(path, step, dp, cp):
    """{(row, response index j): w_t} of the MTP term (module docstring)."""
    m = drv.masks_of(path)[step]
    M, f = drv.M, drv.MTP_SCALE
    N = sum(m[i][j] for i in range(drv.ROWS) for j in range(drv.S - 1))
    out = {}
    for d in range(dp):
        for k in range(M):
            rows = rows_of(dp, d, k)
            nr_c = [sum(rolled(m[i])[j] for i in rows for j in range(drv.S - 1) if cp_owner(j, cp) == c)
                    for c in range(cp)]
            for i in rows:
                for j, r in enumerate(rolled(m[i])):
                    if path == "mtp-a":
                        out[(i, j)] = f * r / N
                    else:
                        assert nr_c[cp_owner(j, cp)] > 0         # MTP_MASKS: else Megatron's 0/0
                        out[(i, j)] = f * r / (nr_c[cp_owner(j, cp)] * M * dp * cp)
    return out


def measured_weights(runs, dp, cp, tp, path, step, term=None):
    """{(row, response index j): token_weight * grad_scale} from every rank's capture (TP rank 0's; the
    other TP ranks' captures are identical); ``term``: that term's (``mb.{k}.term.NAME.token_weight``)."""
    W = {}
    caps = captures(runs, dp, cp, tp, path, step)
    for t, meta in caps:
        if meta["tp_rank"] != "0":
            base = caps[int(meta["rank"]) - int(meta["tp_rank"])][0]
            assert same(t, base), meta
            continue
        gs = t["grad_scale"].double().item()
        r = int(meta["cp_rank"])
        for k in range(int(meta["num_microbatches"])):
            key = f"mb.{k}.token_weight" if term is None else f"mb.{k}.term.{term}.token_weight"
            w = (t[key].double() * gs).tolist()
            at = 0
            for i, T, R in zip(t[f"mb.{k}.sample_indices"].tolist(), t[f"mb.{k}.total_lengths"].tolist(),
                               t[f"mb.{k}.response_lengths"].tolist()):
                for j in lc.zigzag_owned(T, R, cp, r):
                    assert (i, j) not in W, (i, j)                       # held exactly once
                    W[(i, j)] = w[at]
                    at += 1
            assert at == len(w)
    return W


# ---- (a) the adapter changes nothing ---------------------------------------------------------------
@pytest.mark.parametrize("dp,cp,tp,path", CASES, ids=IDS)
def test_losses_gradients_and_update_bit_for_bit(runs, dp, cp, tp, path):
    for r in range(dp * cp * tp):
        a, p = run_dir(runs, dp, cp, tp, path), run_dir(runs, dp, cp, tp, path, "plain")
        for name in (f"losses-rank{r}.pt", f"reports-rank{r}.pt", f"final-rank{r}.pt",
                     *[f"grads-step{n}-rank{r}.pt" for n in range(drv.STEPS)]):
            x, y = torch.load(os.path.join(a, name)), torch.load(os.path.join(p, name))
            assert same(x, y), (name, x, y)
        assert len(torch.load(os.path.join(a, f"losses-rank{r}.pt"))[0]) == drv.M
        with open(os.path.join(a, f"opt-rank{r}.json")) as f, open(os.path.join(p, f"opt-rank{r}.json")) as g:
            assert same(json.load(f), json.load(g))


# ---- what the captures hold ------------------------------------------------------------------------
@pytest.mark.parametrize("dp,cp,tp,path", CASES, ids=IDS)
def test_capture_records(runs, dp, cp, tp, path):
    world = dp * cp * tp
    mtp = path in MTP_PATHS
    # the MTP term as the adapter declares it: coef mtp_loss_scaling_factor / mtp_num_layers, Megatron's mask
    terms_meta = {"terms": "mtp", "term.mtp.reduce": "per-token", "term.mtp.coef": repr(drv.MTP_SCALE / 1),
                  "term.mtp.mask": "roll:1"} if mtp else {}
    for n in range(drv.STEPS):
        full = drv.batch(n, drv.masks_of(path))
        m = drv.masks_of(path)[n]
        N = sum(m[i][j] for i in range(drv.ROWS) for j in range(drv.S - 1))
        for r, (t, meta) in enumerate(captures(runs, dp, cp, tp, path, n)):
            dp_rank, cp_rank, tp_rank = r // (tp * cp), (r // tp) % cp, r % tp   # Megatron's order tp-cp-ep-dp-pp
            assert meta == {"lossguard.schema": "audit/1", "trainer": "megatron", "step": str(n), "rank": str(r), "world_size": str(world),
                            "tp": str(tp), "pp": "1", "cp": str(cp), "dp": str(dp), "tp_rank": str(tp_rank),
                            "pp_rank": "0",
                            "cp_rank": str(cp_rank), "dp_rank": str(dp_rank), "cp_layout": "zigzag",
                            "reduce": "per-token", "num_microbatches": str(drv.M), "dtype": "float32",
                            "loss_site": "the loss_func your forward_step returns (schedules.forward_step_calc_loss)",
                            **terms_meta}
            kept = torch.load(os.path.join(run_dir(runs, dp, cp, tp, path), f"losses-rank{r}.pt"))[n]
            with open(os.path.join(run_dir(runs, dp, cp, tp, path), f"opt-rank{r}.json")) as f:
                opt = json.load(f)[n]
            for k in range(drv.M):
                p = f"mb.{k}."
                rows = rows_of(dp, dp_rank, k)
                assert t[p + "sample_indices"].tolist() == rows
                assert torch.equal(t[p + "tokens"], full["tokens"][rows].reshape(-1))
                assert t[p + "total_lengths"].tolist() == [drv.S] * len(rows)
                assert t[p + "response_lengths"].tolist() == [drv.S - 1] * len(rows)
                assert t[p + "loss_masks"].tolist() == [int(x) for i in rows for x in m[i][:-1]]
                assert t[p + "cp_size"].item() == cp and t[p + "dummy"].item() == 0
                n_local = sum(m[i][j] for i in rows for j in range(drv.S - 1) if cp_owner(j, cp) == cp_rank)
                if path in ("a", "mtp-a"):
                    assert t[p + "num_tokens"].item() == n_local
                else:       # a 2-tuple returns no count; without per-token loss the 3-tuple's is a divisor only
                    assert p + "num_tokens" not in t
                owned = sum(len(lc.zigzag_owned(drv.S, drv.S - 1, cp, cp_rank)) for _ in rows)
                assert t[p + "token_weight"].shape == (owned,) and t[p + "token_loss"].shape == (owned,)
                if not mtp:
                    # the recorded loss is the scalar the schedule backpropagated (after its in-place scaling)
                    assert same(t[p + "loss"], kept[k].double().reshape(())), (t[p + "loss"], kept[k])
                    assert not any(".term." in x for x in t)
                    continue
                # MTP: the main scalar plus MTPLossAutoScaler's share (its backward scale x the sum of what
                # GPTModel handed it): the objective both terms' weights are gradients of
                q = p + "term.mtp."
                assert t[q + "token_weight"].shape == (owned,) and t[q + "token_loss"].shape == (owned,)
                assert sorted(x for x in t if x.startswith(p) and ".term." in x) == [q + "token_loss",
                                                                                       q + "token_weight"]
                share = (t[q + "token_weight"].double() * t[q + "token_loss"].double()).sum().item()
                assert share > 0
                assert math.isclose(t[p + "loss"].item() - kept[k].double().item(), share, rel_tol=1e-5), \
                    (t[p + "loss"], kept[k], share)
            # a: finalize_model_grads' scaling = 1.0 / num_tokens, an int32 tensor: the float32 1/N
            want_scale = {"a": (1.0 / torch.tensor(N, dtype=torch.int32)).double().item(), "b": 1.0 / (dp * cp),
                          "c": 1.0 / (dp * cp), "cnan": 1.0 / (dp * cp), "d": 1.0}[{"mtp-a": "a", "mtp-b": "b"}
                                                                                     .get(path, path)]
            assert t["grad_scale"].item() == want_scale, (t["grad_scale"], want_scale)
            if path in ("a", "mtp-a"):
                assert t["num_tokens_reduced"].item() == N
            elif path == "d":
                assert t["num_tokens_reduced"].item() == 0               # the 2-tuple's default count 0
            else:
                assert "num_tokens_reduced" not in t
            assert t["skipped"].item() == 0 and opt["update_successful"] is True
            assert same(t["grad_norm"].item(), opt["grad_norm"])
            assert t["global_batch_size"].item() == drv.ROWS


# ---- (b) the measured weights are the truth -----------------------------------------------------
@pytest.mark.parametrize("dp,cp,tp,path", CASES, ids=IDS)
def test_weights_are_the_formula(runs, dp, cp, tp, path):
    for n in range(drv.STEPS):
        got, want = measured_weights(runs, dp, cp, tp, path, n), expected_weights(path, n, dp, cp)
        assert got.keys() == want.keys()
        for key in want:
            if math.isnan(want[key]):
                assert math.isnan(got[key]), (n, key, got[key])
            else:
                assert math.isclose(got[key], want[key], rel_tol=1e-6, abs_tol=0.0), (n, key, got[key], want[key])
    if path == "cnan":     # the empty micro-batch exists at every layout on step 1 (rows 0 and 1 empty)
        assert any(math.isnan(w) for w in measured_weights(runs, dp, cp, tp, path, 1).values())
    if path in MTP_PATHS:  # the MTP term: its own formula
        for n in range(drv.STEPS):
            got, want = measured_weights(runs, dp, cp, tp, path, n, "mtp"), expected_mtp_weights(path, n, dp, cp)
            assert got.keys() == want.keys()
            for key in want:
                assert math.isclose(got[key], want[key], rel_tol=1e-6, abs_tol=0.0), (n, key, got[key], want[key])
            # roll:1 is not shift:1 (m_t m_{t+1}): some token before a masked -> loss-bearing edge weighs
            m = drv.masks_of(path)[n]
            assert any(got[(i, j)] > 0 and m[i][j] == 0 for i, j in got)


@pytest.mark.parametrize("dp,cp,tp,path", CASES, ids=IDS)
def test_gradient_is_sum_of_measured_weights(runs, dp, cp, tp, path):
    """main_grad after finalize_model_grads (every rank) == sum_t w_t grad(l_t), float64 recomputation
    (TP 1: the float64 model is rebuilt on one rank); with MTP sum_k sum_t w^k_t grad(l^k_t) over main and
    mtp — the MTP layer's parameters (mtp.*) get their gradient from the MTP term alone."""
    if tp > 1:
        pytest.skip("the float64 recomputation builds the model on one rank (TP 1 only)")
    for n in range(drv.STEPS):
        ref = torch.load(os.path.join(run_dir(runs, dp, cp, tp, path), f"ref-grads-step{n}.pt"))
        got = [torch.load(os.path.join(run_dir(runs, dp, cp, tp, path), f"grads-step{n}-rank{r}.pt"))
               for r in range(dp * cp)]
        for r in range(1, dp * cp):                       # every DP x CP replica holds the same gradient
            assert same(got[r], got[0]), r
        assert (ref["seen"][:, : drv.S - 1] == 1).all() and (ref["seen"][:, -1] == 0).all()
        # the per-token losses the adapter recorded are Megatron's (float32) values of the same l_t
        caps = captures(runs, dp, cp, tp, path, n)
        for t, meta in caps:
            r_cp = int(meta["cp_rank"])
            for k in range(drv.M):
                owned = lc.zigzag_owned(drv.S, drv.S - 1, cp, r_cp)
                rows = t[f"mb.{k}.sample_indices"].tolist()
                want = torch.stack([ref["token_loss"][i, owned] for i in rows]).reshape(-1)
                torch.testing.assert_close(t[f"mb.{k}.token_loss"].double(), want, rtol=1e-5, atol=1e-6,
                                           equal_nan=True)      # NaN parameters after a NaN step (cnan)
                if path in MTP_PATHS:
                    want = torch.stack([ref["terms"]["mtp"]["token_loss"][i, owned] for i in rows]).reshape(-1)
                    torch.testing.assert_close(t[f"mb.{k}.term.mtp.token_loss"].double(), want, rtol=1e-5,
                                               atol=1e-6)
        if path in MTP_PATHS:
            mtp_params = [x for x in ref["grads"] if x.startswith("mtp.")]
            assert mtp_params and all(ref["grads"][x].abs().max() > 0 for x in mtp_params if "eh_proj" in x)
        want = ref["grads"]
        finite = [v[torch.isfinite(v)] for v in want.values()]
        scale = max((x.abs().max().item() for x in finite if x.numel()), default=1.0)
        nan_step = path == "cnan" and (n == 1 or dp == 2)      # an empty micro-batch: 0/0
        for name, w in want.items():
            g = got[0][name].double()
            if nan_step:
                # the NaN also flows from each row's last position (its dL/dl = 0/0 too), which no rank owns
                # and the capture does not hold: compare where both are finite
                both = torch.isfinite(g) & torch.isfinite(w)
                g, w = g[both], w[both]
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda msg: f"dp{dp} cp{cp} {path} step {n} {name}: {msg}")
        if nan_step:
            assert any(torch.isnan(v).any() for v in got[0].values())
            assert any(torch.isnan(v).any() for v in want.values())
        else:
            assert all(torch.isfinite(v).all() for v in got[0].values())


def test_cpu_shim_sites(runs):
    """lossguard_capture.megatron_cpu.cuda_on_cpu rewrote exactly the documented places of the installed release,
    at every layout."""
    assert MEGATRON_CORE in CPU_SITES_BY_RELEASE, f"megatron-core {MEGATRON_CORE}: no recorded CPU-shim sites"
    always, at_cp, at_tp = CPU_SITES_BY_RELEASE[MEGATRON_CORE]
    for (dp, cp, tp), d in runs.items():
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
        assert meta["megatron_core"] == MEGATRON_CORE
        want = always + ([at_cp] if cp > 1 else []) + ([at_tp] if tp > 1 else [])
        assert meta["cuda_on_cpu_sites"] == sorted("megatron/core/" + w for w in want), (dp, cp, tp)


# ---- (c) contracts and audit -----------------------------------------------------------------------
def _dump(tmp_path, step, masks=drv.MASKS):
    full = drv.batch(step, masks)
    samples = [{"tokens": full["tokens"][i].tolist(), "response_length": drv.S - 1,
                "loss_mask": [int(x) for x in masks[step][i][:-1]]} for i in range(drv.ROWS)]
    p = tmp_path / f"step{step}.json"
    p.write_text(json.dumps({"samples": samples}))
    return str(p)


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("dp,cp,tp,path", CASES, ids=IDS)
def test_contract_reproduces_measured_weights(runs, tmp_path, dp, cp, tp, path):
    """lossguard weights --contract CONTRACTS[path] on the same batch and layout (DP rank d holds rows d,
    d+dp, ...: --split round-robin) predicts the measured weights (the finite ones for cnan); with MTP,
    ``--term mtp:per-token:0.3:roll:1 --contract mtp=TERM_CONTRACTS[path]`` predicts the MTP term's (its
    weights relative to its coefficient: measured = 0.3 x predicted)."""
    mtp = path in MTP_PATHS
    extra = ["--term", MTP_TERM, "--contract", f"mtp={TERM_CONTRACTS[path]}"] if mtp else []
    for n in range(drv.STEPS):
        r = subprocess.run([LOSSGUARD, "weights", _dump(tmp_path, n, drv.masks_of(path)), "--contract", CONTRACTS[path],
                            *extra, "--cp", str(cp), "--tp", str(tp), "--dp", str(dp), "--microbatches", str(drv.M),
                            "--split", "round-robin", "--per-token", "--json", "-"],
                           capture_output=True, text=True, timeout=120)
        doc = json.loads(r.stdout)
        pred = {(s["index"], j): w for s in doc["steps"][0]["samples"] for j, w in enumerate(s["weights"])}
        got = measured_weights(runs, dp, cp, tp, path, n)
        assert pred.keys() == got.keys()
        for key, w in got.items():
            if not math.isnan(w):
                assert math.isclose(w, pred[key], rel_tol=1e-6, abs_tol=1e-12), (n, key, w, pred[key])
        if mtp:
            (term,) = [t for t in doc["steps"][0]["terms"] if t["name"] == "mtp"]
            assert term["contract"]["preset"] == TERM_CONTRACTS[path] and term["mask"] == "roll:1"
            pred = {(s["index"], j): drv.MTP_SCALE * w for s in term["samples"] for j, w in enumerate(s["weights"])}
            got = measured_weights(runs, dp, cp, tp, path, n, "mtp")
            assert pred.keys() == got.keys()
            for key, w in got.items():
                assert math.isclose(w, pred[key], rel_tol=1e-6, abs_tol=1e-12), (n, key, w, pred[key])


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
@pytest.mark.parametrize("dp,cp,tp,path", CASES, ids=IDS)
def test_audit_verdict(runs, dp, cp, tp, path):
    caps = os.path.join(run_dir(runs, dp, cp, tp, path), "captures")
    steps = [os.path.join(caps, f"step{n:06d}") for n in range(drv.STEPS)]
    code, doc, err, text = audit(*steps)
    mtp = path in MTP_PATHS
    fields = dict(dp=dp, cp=cp, tp=tp, path=path, calculate_per_token_loss=path in ("a", "d", "mtp-a"),
                  loss_func="3-tuple" if path in ("a", "b", "mtp-a", "mtp-b") else "2-tuple", microbatches=drv.M,
                  contract=CONTRACTS[path])
    if mtp:
        fields.update(mtp_num_layers=1, mtp_loss_scaling_factor=drv.MTP_SCALE, term=MTP_TERM,
                      term_contract=TERM_CONTRACTS[path])
    gallery.record("megatron", f"dp{dp}-cp{cp}" + (f"-tp{tp}" if tp > 1 else "") + f"-{path}", fields,
                   [LOSSGUARD, "audit", *steps], code, doc, text, err)
    where = f"dp{dp} cp{cp} tp{tp} {path}:\n{text}\n{err}"
    assert doc is not None, where
    assert code == (0 if path == "a" else 1), where
    s0 = doc["steps"][0]
    assert s0["dtype"] == "float32", where
    assert s0["diagnosis"]["kind"] == KIND0[path][(dp, cp, tp)], where
    checks = [{c["name"]: c["ok"] for c in s["checks"]} for s in doc["steps"]]
    if path == "a":
        assert all(c["ok"] is not False for s in doc["steps"] for c in s["checks"]), where
        assert all("megatron-per-token" in s["matches"] for s in doc["steps"]), where
    elif path == "b":
        # without per-token loss the 3-tuple's count is the micro-batch mean's divisor, not recorded as a count
        assert checks[0]["weights"] is False and checks[0]["counts"] is None, where
        assert "megatron-mean" in s0["matches"], where
    elif path == "c":
        assert checks[0]["weights"] is False and checks[0]["counts"] is None, where
    elif path == "d":       # the 2-tuple's count is the schedule's default 0: counts fail too
        assert checks[0]["weights"] is False and checks[0]["counts"] is False, where
        assert "num_tokens_reduced 0" in text, where
    elif mtp:
        for n, (s, c) in enumerate(zip(doc["steps"], checks)):
            # the loss check holds both terms: mb.{k}.loss includes MTPLossAutoScaler's share
            assert c["coverage"] is True and c["loss"] is True and c["decision"] is True, where
            assert c["mtp.coverage"] is True and c["mtp.counts"] is None and c["mtp.weights"] is False, where
            (term,) = s["terms"]
            assert (term["name"], term["declared"], term["hooked"], term["reduce"], term["mask"]) == \
                ("mtp", True, True, "per-token", "roll:1"), where
            assert math.isclose(term["coef"], drv.MTP_SCALE), where
            m = drv.masks_of(path)[n]
            N = sum(m[i][j] for i in range(drv.ROWS) for j in range(drv.S - 1))
            N_mtp = sum(sum(rolled(m[i])) for i in range(drv.ROWS))
            assert term["tokens"] == N_mtp < N, where
            assert TERM_CONTRACTS[path] in term["matches"], where
            if n == 0:
                assert term["diagnosis"]["kind"] == MTP_KIND0[path][(dp, cp, tp)], where
            if path == "mtp-a":
                # Megatron divides the MTP loss by the MAIN count (0.16.1 finalize_model_grads.py:484-497):
                # relative to its own objective (its N_mtp tokens) a uniform N_mtp/N
                assert c["weights"] is True and "megatron-per-token" in s["matches"], where
                assert term["diagnosis"]["kind"] == "uniform-scale", where
                assert math.isclose(term["diagnosis"]["scale"], N_mtp / N, rel_tol=1e-6), where
            else:
                assert c["weights"] is False and "megatron-mean" in s["matches"], where
        assert re.search(r"mtp reproduced by: .*" + re.escape(TERM_CONTRACTS[path]) + r"(,|$)", text, re.M), where
    else:                   # cnan: the step with an empty micro-batch has NaN weights and a NaN grad_norm
        bad = 0 if dp == 2 else 1
        assert checks[bad]["weights"] is False and checks[bad]["decision"] is False, where
        assert "not finite" in text and "grad_norm" in text, where


# ---- guards -----------------------------------------------------------------------------------------
def test_refusals_and_skip(runs):
    d = runs[(1, 1, 1)]
    with open(os.path.join(d, "guards.json")) as f:
        g = json.load(f)
    want = {
        "no-finalize": r"config\.finalize_model_grads_func is None",
        "not-ddp": r"a model chunk of type GPTModel, not megatron\.core\.distributed\.DistributedDataParallel",
        "last-position-carries-loss": r"the last position of row\(s\) \[0\] carries loss",
        "loss-not-a-tuple": r"loss_func returned Tensor; Megatron expects \(loss, num_tokens, report\) or "
                            r"\(loss, report\)",
        "logits-not-per-token": r"loss_func received \(2, 8, 32\) torch\.float32 \(logits\?\) and handed lossguard no "
                                r"per-token losses: call audit\.per_token\(token_losses\)",
        "thd": r"THD packed sequences \(packed_seq_params\) are not \[b, s\] rows: wrap the loss function with "
               r"audit\.packed_loss_func",
        "mtp-without-model": r"mtp_num_layers = 1 without model=: the MTP loss is hooked on the GPTModel",
    }
    for name, pattern in want.items():
        assert g[name]["error"] is not None and re.search(pattern, g[name]["error"]), (name, g[name])
        assert g[name]["error"].startswith("RuntimeError: lossguard_capture.megatron"), g[name]
        assert g[name]["files"] == [], (name, g[name])                 # nothing recorded
    assert g["not-captured"] == {"error": None, "files": [], "extra": {"identity": True}}
    # fail fast off: the same THD step is a warning, not a stop — nothing recorded, the loss function unwrapped
    assert g["thd-record-only"] == {"error": None, "files": [], "extra": {"identity": True}}, g["thd-record-only"]
    for name, skipped in (("zero-tokens-skipped", 1), ("zero-tokens-stepped", 0)):
        assert g[name]["error"] is None and g[name]["files"] == ["captures/step000000/step000000-rank00000.safetensors"]
        t = load_file(os.path.join(d, "guards", name, g[name]["files"][0]))
        assert t["skipped"].item() == skipped and t["num_tokens_reduced"].item() == 0
        assert t["grad_scale"].item() == 1.0                      # finalize does not scale when N == 0
        if skipped:
            assert "grad_norm" not in t
        if HAVE_BIN:    # megatron-core itself steps on a zero-token step: the decision check fails (bug 2)
            code, doc, err, text = audit(os.path.join(d, "guards", name, "captures"))
            assert code == skipped ^ 1, text
            decision = {c["name"]: c["ok"] for c in doc["steps"][0]["checks"]}["decision"]
            assert decision is bool(skipped), text
    # MTP without per-token loss: micro-batch 0 carries loss at position 0 only, so its rolled (MTP) mask is
    # empty; gpt_model.py:659-661 divides by that count unclamped: NaN weights, NaN gradient, and the step
    # goes on (audit: mtp.weights not finite, decision fails on the NaN grad_norm)
    e = g["mtp-empty-rolled-mask"]
    assert e["error"] is None and len(e["files"]) == 1, e
    assert e["extra"] == {"identity": False, "grad_finite": False, "scaler_restored": True}, e
    t = load_file(os.path.join(d, "guards", "mtp-empty-rolled-mask", e["files"][0]))
    assert torch.isnan(t["mb.0.term.mtp.token_weight"]).all() and torch.isfinite(t["mb.1.term.mtp.token_weight"]).all()
    assert torch.isfinite(t["mb.0.token_weight"]).all()               # the main 3-tuple clamps its count
    # the model called without loss_mask: Megatron's MTP mask is all ones (gpt_model.py:615-617), so the MTP
    # head trains on positions the loss mask excludes; audit's mtp.coverage names them
    e = g["mtp-model-without-loss-mask"]
    assert e["error"] is None and e["extra"] == {"identity": False, "grad_finite": True, "scaler_restored": True}, e
    if HAVE_BIN:
        code, doc, err, text = audit(os.path.join(d, "guards", "mtp-empty-rolled-mask", "captures"))
        c = {x["name"]: x["ok"] for x in doc["steps"][0]["checks"]}
        assert code == 1 and c["mtp.weights"] is False and c["decision"] is False, text
        assert "term.mtp.token_weight[0] = -nan" in text or "term.mtp.token_weight[0] = nan" in text, text
        code, doc, err, text = audit(os.path.join(d, "guards", "mtp-model-without-loss-mask", "captures"))
        c = {x["name"]: x["ok"] for x in doc["steps"][0]["checks"]}
        assert code == 1 and c["weights"] is True and c["mtp.coverage"] is False, text
        assert "outside term mtp's mask (roll:1) but weighs" in text, text


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
def test_fail_fast_before_the_update(runs):
    """attach(config, ..., fail_fast=True): path b's step 0 is written and audited when the optimizer is about to
    apply it; audit FAILS, AuditFailed comes out of optimizer.step() and the parameters are those of the step's
    start.  Path a PASSES and the step is applied.  The capture written then records what optimizer.step()
    returns: not skipped, its gradient norm."""
    d = runs[(1, 1, 1)]
    with open(os.path.join(d, "guards.json")) as f:
        g = json.load(f)
    one = ["captures/step000000/step000000-rank00000.safetensors"]
    fail, ok = g["fail-fast-fail"], g["fail-fast-pass"]
    assert fail["error"] is None and fail["files"] == one, fail
    assert fail["extra"]["audit_failed"] == {"step": 0, "exit_code": 1}, fail
    assert fail["extra"]["params_unchanged"] is True and fail["extra"]["verdicts"] == {"0": "fail"}, fail
    assert fail["extra"]["paths"] == [0], fail
    assert ok["error"] is None and ok["files"] == one and "audit_failed" not in ok["extra"], ok
    assert ok["extra"]["params_unchanged"] is False and ok["extra"]["verdicts"] == {"0": "pass"}, ok
    t = load_file(os.path.join(d, "guards", "fail-fast-pass", one[0]))
    assert t["skipped"].item() == 0 and t["grad_norm"].item() == ok["extra"]["opt_grad_norm"], (t.keys(), ok)
    code, doc, err, text = audit(os.path.join(d, "guards", "fail-fast-fail", "captures"))
    assert code == 1, text


def test_unsupported_version_names_the_range():
    import lossguard_capture.megatron as lcm
    assert lcm.SUPPORTED == ("0.15.0", "0.17.0") and lcm.SPEC.verified == ("0.15.3", "0.16.0", "0.16.1")
    for v in lcm.SPEC.verified:
        lcm.check_version(v)
    # 0.14.x and older: no clamp of the token count, the nearest supported release named
    with pytest.raises(RuntimeError, match=r"megatron-core>=0\.15\.0,<0\.17\.0.*megatron-core 0\.14\.0 is installed.*"
                                           r"does not clamp the token count.*0/0 = NaN; nearest supported: 0\.15\.3"):
        lcm.check_version("0.14.0")
    # 0.17 and later: not verified (Python >= 3.12)
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.1: not verified: 0\.17 and later require Python "
                                           r">= 3\.12.*nearest supported: 0\.16\.1"):
        lcm.check_version("0.17.1")
    for v in ("0.12.3", "0.14.1", "0.17.0", "0.17.0rc1", "0.19.2", "1.0.0"):
        with pytest.raises(RuntimeError):
            lcm.check_version(v)
    with pytest.warns(UserWarning, match="supports.*clamp"):
        lcm.check_version("0.14.0", allow_unsupported=True)
    lcm.check_version()                                      # the installed release is inside the range
    assert lcm.megatron_version() == MEGATRON_CORE and MEGATRON_CORE in lcm.SPEC.verified
