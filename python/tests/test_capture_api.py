"""Capture / StepRecorder: rank and topology discovery, the `with` contract, keyword-only calls, the
metadata `dtype`, one version with the CLI, and the audit helpers (run_audit, agree)."""
import os
import re
import stat
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.join(HERE, "..")
REPO = os.path.join(PKG_ROOT, "..")
sys.path.insert(0, PKG_ROOT)
import lossguard_capture as lc  # noqa: E402
from lossguard_capture import Capture, CaptureWarning  # noqa: E402


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOSSGUARD_BIN"):
        monkeypatch.delenv(k, raising=False)


# ---- packaging -----------------------------------------------------------------------------------
def test_version_is_the_clis():
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        m = re.search(r"project\(\s*lossguard\s+VERSION\s+([0-9.]+)", f.read())
    assert m, "CMakeLists.txt has no project(lossguard VERSION ...)"
    assert lc.__version__ == m.group(1)


def test_pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(PKG_ROOT, "pyproject.toml"), "rb") as f:
        pp = tomllib.load(f)
    proj = pp["project"]
    assert proj["dynamic"] == ["version"] and "version" not in proj
    assert pp["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lossguard_capture._version.__version__"}
    assert proj["requires-python"] == ">=3.10"
    deps = {re.split(r"[<>=]", d)[0]: d for d in proj["dependencies"]}
    # numpy: safetensors.torch.save_file writes through it (a fresh install failed without it)
    assert set(deps) == {"torch", "safetensors", "numpy"}
    assert all("<" in d and ">=" in d for d in deps.values()), deps          # bounded both ways
    assert "py.typed" in pp["tool"]["setuptools"]["package-data"]["lossguard_capture"]
    assert os.path.isfile(os.path.join(PKG_ROOT, "lossguard_capture", "py.typed"))


# ---- rank, world, coordinates ----------------------------------------------------------------------
def test_rank_and_world_from_the_launcher_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("WORLD_SIZE", "16")
    cap = Capture(str(tmp_path), tp=2, pp=2, cp=2)
    assert (cap.rank, cap.world_size, cap.dp) == (13, 16, 2)
    # 13 = tp + 2*(cp + 2*(dp + 2*pp)) with tp=1, cp=0, dp=1, pp=1
    assert (cap.tp_rank, cap.cp_rank, cap.dp_rank, cap.pp_rank) == (1, 0, 1, 1)


def test_rank_and_world_default_and_explicit(tmp_path):
    cap = Capture(str(tmp_path))
    assert (cap.rank, cap.world_size, cap.tp, cap.pp, cap.cp, cap.dp) == (0, 1, 1, 1, 1, 1)
    cap = Capture(str(tmp_path), rank=3, world_size=4, cp=2, dp_rank=0)     # a coordinate given wins
    assert (cap.cp_rank, cap.dp_rank) == (1, 0)


def test_rank_and_world_from_torch_distributed(tmp_path, monkeypatch):
    import torch.distributed as dist
    monkeypatch.setenv("RANK", "7")                         # the process group wins over the environment
    monkeypatch.setenv("WORLD_SIZE", "9")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        cap = Capture(str(tmp_path / "c"))
        assert (cap.rank, cap.world_size) == (0, 1)
        assert lc.audit.agree("k", lambda: {"v": 1}) == {"v": 1}       # one rank: computed here
    finally:
        dist.destroy_process_group()


def test_coordinates_megatron_order():
    """docs/semantics.md §7 worked topology TP2 CP2 DP2 PP2 (world 16): DP+CP groups [0,2,4,6], [1,3,5,7],
    [8,10,12,14], [9,11,13,15]; pipeline groups [r, r+8]."""
    co = {r: lc.coordinates(r, tp=2, cp=2, dp=2, pp=2) for r in range(16)}
    for r, c in co.items():
        assert r == c["tp_rank"] + 2 * (c["cp_rank"] + 2 * (c["dp_rank"] + 2 * c["pp_rank"]))
    groups = {}
    for r, c in co.items():
        groups.setdefault((c["tp_rank"], c["pp_rank"]), []).append(r)
    assert sorted(groups.values()) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    pipes = {}
    for r, c in co.items():
        pipes.setdefault((c["tp_rank"], c["cp_rank"], c["dp_rank"]), []).append(r)
    assert all(g == [g[0], g[0] + 8] for g in pipes.values())


def test_topology_and_reduce_validated(tmp_path):
    with pytest.raises(ValueError, match="not a multiple of tp\\*pp\\*cp = 4"):
        Capture(str(tmp_path), rank=0, world_size=6, tp=4)
    with pytest.raises(ValueError, match="!= world size 8"):
        Capture(str(tmp_path), rank=0, world_size=8, cp=2, dp=2)
    with pytest.raises(ValueError) as e:
        Capture(str(tmp_path), reduce="mean")
    for choice in lc.REDUCE_CHOICES:
        assert choice in str(e.value)
    assert lc.REDUCE_CHOICES == ("per-token", "sample-mean", "token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-mean", "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="reduce must be one of"):
        Capture(str(tmp_path), reduce="sum")


# ---- the step recorder -------------------------------------------------------------------------------
def _record(s, l):
    h = s.microbatch(sample_indices=[4, 9], tokens=[[1, 2, 3], [4, 5, 6, 7]], total_lengths=[3, 4],
                     response_lengths=[2, 3], loss_masks=[[1, 0], [1, 1, 1]], cp_size=1, num_tokens=4)
    h.hook(l)
    loss = (l * torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0], dtype=l.dtype)).sum() / 4
    h.loss(loss)
    return loss


def test_with_step_writes_the_capture(tmp_path):
    cap = Capture(str(tmp_path), rank=1, world_size=2, dp=2)
    x = torch.arange(5, dtype=torch.float32, requires_grad=True)
    with cap.step(7) as s:
        assert s.active and s.step == 7
        _record(s, x * 2).backward()
        path = s.finish(grad_scale=0.5, num_tokens_reduced=8, skipped=False, grad_norm=1.0, global_batch_size=4)
    assert os.path.basename(path) == "step000007-rank00001.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["dtype"] == "float32" and (meta["rank"], meta["world_size"], meta["dp"], meta["dp_rank"]) == \
        ("1", "2", "2", "1")
    a = load_file(path)
    assert a["mb.0.token_weight"].tolist() == [0.25, 0.0, 0.25, 0.25, 0.25]
    assert (a["grad_scale"].item(), a["num_tokens_reduced"].item(), a["skipped"].item(), a["grad_norm"].item(),
            a["global_batch_size"].item()) == (0.5, 8, 0, 1.0, 4)


def test_keyword_only(tmp_path):
    s = Capture(str(tmp_path)).step(0)
    with pytest.raises(TypeError):
        s.microbatch([0], [1, 2], [2], [1], [1], 1)
    with pytest.raises(TypeError):
        s.finish(1.0)
    s.abort()


def test_exception_in_with_removes_hooks_and_writes_nothing(tmp_path):
    cap = Capture(str(tmp_path))
    x = torch.ones(5, requires_grad=True)
    l = x * 3
    with pytest.raises(KeyError, match="boom"):
        with cap.step(0) as s:
            loss = _record(s, l)
            raise KeyError("boom")
    assert s.aborted and s.path is None
    loss.backward()                                       # the hook is gone: nothing more is recorded
    assert s.microbatches[0]._grads == []
    assert not os.path.exists(tmp_path) or os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="aborted"):
        s.finish(grad_scale=1.0)


def test_leaving_without_finish_warns_and_writes_nothing(tmp_path):
    cap = Capture(str(tmp_path))
    l = torch.ones(5, requires_grad=True) * 1.0
    with pytest.warns(CaptureWarning, match="without finish\\(\\): nothing was written"):
        with cap.step(3) as s:
            _record(s, l)
    assert s.closed and s.path is None
    assert not os.path.exists(tmp_path) or os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        s.microbatch(sample_indices=[0], tokens=[1], total_lengths=[1], response_lengths=[0])


def test_finish_then_exit_is_quiet(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Capture(str(tmp_path)).step(0) as s:
            _record(s, torch.ones(5, requires_grad=True) * 1.0).backward()
            s.finish(grad_scale=1.0)
    assert os.listdir(tmp_path) == ["step000000-rank00000.safetensors"]


def test_steps_not_selected_cost_nothing(tmp_path):
    cap = Capture(str(tmp_path), steps=[0, 10])
    assert cap.should_capture(10) and not cap.should_capture(1)
    x = torch.ones(5, requires_grad=True)
    l = x * 2
    with cap.step(1) as s:
        assert not s.active
        h = s.microbatch(sample_indices=[0], tokens=[1, 2], total_lengths=[2], response_lengths=[1])
        assert h.hook(l) is l and h.loss(5.0) == 5.0 and h.set(num_tokens=3) is None
        assert s.finish(grad_scale=1.0) is None
    assert l._backward_hooks is None or len(l._backward_hooks) == 0
    assert not os.path.exists(tmp_path) or os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype,name", [(torch.float64, "float64"), (torch.float16, "float16"),
                                        (torch.bfloat16, "bfloat16")])
def test_metadata_dtype_is_the_hooked_tensors(tmp_path, dtype, name):
    with Capture(str(tmp_path)).step(0) as s:
        _record(s, torch.ones(5, dtype=dtype, requires_grad=True) * 1).backward()
        path = s.finish(grad_scale=1.0)
    with safe_open(path, "pt") as f:
        assert f.metadata()["dtype"] == name
    assert load_file(path)["mb.0.token_weight"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_metadata_dtype_mixed_and_absent(tmp_path):
    with Capture(str(tmp_path / "a")).step(0) as s:
        _record(s, torch.ones(5, requires_grad=True) * 1).backward()
        _record(s, torch.ones(5, dtype=torch.bfloat16, requires_grad=True) * 1).backward()
        with pytest.warns(CaptureWarning, match="different dtypes"):
            path = s.finish(grad_scale=1.0)
    with safe_open(path, "pt") as f:
        assert f.metadata()["dtype"] == "bfloat16"            # the least precise: the widest tolerance
    with Capture(str(tmp_path / "b")).step(0) as s:           # nothing hooked: no dtype claimed
        s.microbatch(sample_indices=[], tokens=[], total_lengths=[], response_lengths=[], dummy=True)
        path = s.finish(grad_scale=1.0)
    with safe_open(path, "pt") as f:
        assert "dtype" not in f.metadata()


# ---- the audit helpers ---------------------------------------------------------------------------
#: what the fake binaries do as lossguard does: the JSON report of their verdict at ``--json PATH`` (run_audit
#: takes a verdict only with its report)
_REPORT = ('prev=; for a; do [ "$prev" = --json ] && printf \'{"schema": "lossguard/1", "verdict": "v", '
           '"exit_code": CODE}\' > "$a"; prev=$a; done\n')


def _fake_lossguard(tmp_path, code, text="step 0: weights FAIL per-micro-batch normalisation"):
    p = tmp_path / f"lossguard-{code}"
    p.write_text(f"#!/bin/sh\necho '{text}'\necho \"args: $*\" >&2\n{_REPORT}exit {code}\n".replace("CODE", str(code)))
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def test_run_audit_verdicts(tmp_path, monkeypatch):
    r = lc.run_audit(["caps/step000000"], binary=_fake_lossguard(tmp_path, 0, "verdict: pass"), step=0)
    assert r.passed and r.verdict == "pass" and "verdict: pass" in r.text
    assert r.command[1:] == ["audit", "caps/step000000"]
    r.raise_for_verdict()
    report = str(tmp_path / "x.json")
    r = lc.run_audit(["d"], binary=_fake_lossguard(tmp_path, 1), args=["--strict-scale"], json_path=report, step=3)
    assert r.command[1:] == ["audit", "d", "--strict-scale", "--json", report]
    with pytest.raises(lc.AuditFailed) as e:
        r.raise_for_verdict()
    assert e.value.exit_code == 1 and e.value.step == 3 and "per-micro-batch" in e.value.text
    assert "lossguard audit FAILED step 3" in str(e.value) and "args: audit d --strict-scale" in str(e.value)
    with pytest.raises(lc.AuditError, match="no verdict \\(exit 2"):
        lc.run_audit(["d"], binary=_fake_lossguard(tmp_path, 2)).raise_for_verdict()
    monkeypatch.setenv("LOSSGUARD_BIN", _fake_lossguard(tmp_path, 4))
    with pytest.raises(lc.AuditError, match="unverified"):
        lc.run_audit(["d"]).raise_for_verdict()
    monkeypatch.setenv("LOSSGUARD_BIN", str(tmp_path / "nope"))
    with pytest.raises(lc.AuditError, match="LOSSGUARD_BIN"):
        lc.find_lossguard()
    monkeypatch.delenv("LOSSGUARD_BIN")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    import sysconfig
    real_get_path = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path / "env-bin") if name == "scripts"
                        else real_get_path(name, *a, **k))
    with pytest.raises(lc.AuditError, match="no lossguard binary.*install it into this environment"):
        lc.find_lossguard()
    (tmp_path / "env-bin").mkdir()        # a wheel's copy in the environment's scripts folder, PATH without it
    installed = tmp_path / "env-bin" / "lossguard"
    os.rename(_fake_lossguard(tmp_path, 0), installed)
    assert lc.find_lossguard() == str(installed)
    rt = lc.AuditResult.from_json(r.to_json())
    assert rt.to_json() == r.to_json()


def _agree_worker(rank, world, init, out):
    import json

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    res = {}
    # 1. everyone arrives: every rank gets rank 0's result
    res["both"] = lc.audit.agree("both", lambda: {"exit_code": 1, "from": dist.get_rank()}, timeout=30)
    # 2. rank 1 never arrives: rank 0 reports it after the timeout instead of waiting forever
    if rank == 0:
        res["missing"] = lc.audit.agree("missing", lambda: {"never": True}, timeout=1.0)
    # 3. rank 0 never answers: rank 1 raises after its wait
    if rank == 1:
        try:
            lc.audit.agree("silent", lambda: {}, timeout=1.0, wait_timeout=1.0)
            res["silent"] = "returned"
        except lc.AuditError as e:
            res["silent"] = str(e)
    with open(os.path.join(out, f"agree-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def test_agree_across_two_processes_never_hangs(tmp_path):
    import json

    import torch.multiprocessing as mp
    mp.spawn(_agree_worker, args=(2, f"file://{tmp_path}/pg", str(tmp_path)), nprocs=2, join=True)
    r0 = json.load(open(tmp_path / "agree-0.json"))
    r1 = json.load(open(tmp_path / "agree-1.json"))
    assert r0["both"] == r1["both"] == {"exit_code": 1, "from": 0}
    assert r0["missing"] == {"error": "only 1 of 2 ranks reached the audit of missing within 1 s"}
    assert "rank 1: no audit verdict from rank 0 for silent within 1 s" in r1["silent"]


def test_the_trainer_is_written_as_metadata(tmp_path):
    """Capture(trainer=...) writes metadata `trainer` (audit lists that trainer's presets first); without it
    the key is absent; every adapter passes its own name (lossguard_capture.hf -> "hf")."""
    for trainer, want in (("hf", "hf"), (None, None)):
        cap = lc.Capture(str(tmp_path / str(trainer)), rank=0, world_size=1, trainer=trainer)
        with cap.step(0) as s:
            h = s.microbatch(sample_indices=[0], tokens=[1, 2, 3], total_lengths=[3], response_lengths=[2],
                             loss_masks=[1, 1])
            loss = torch.tensor([0.5, 0.25], requires_grad=True)
            h.hook(loss)
            loss.sum().backward()
            path = s.finish(grad_scale=1.0)
        with safe_open(path, framework="pt") as f:
            assert f.metadata().get("trainer") == want
