"""Recorder (the deprecated positional API, kept for the code that wrote older captures): SPEC §10 file
format round trip, the backward hook, no host sync before finish(), its DeprecationWarning, and the same
file as Capture's step recorder.  The only tests that construct it: every other one uses Capture."""
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import lossguard_capture as lc  # noqa: E402
from lossguard_capture import Capture, Recorder, zigzag_owned  # noqa: E402

# every Recorder(...) here warns; test_recorder_is_deprecated checks the warning itself
pytestmark = pytest.mark.filterwarnings("ignore:lossguard_capture.Recorder is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def test_recorder_is_deprecated(tmp_path):
    with pytest.warns(DeprecationWarning, match="Recorder is deprecated: use lossguard_capture.Capture"):
        Recorder(str(tmp_path), 0, 0, 1)
    assert "Deprecated" in Recorder.__doc__ and "Capture" in Recorder.__doc__


def test_recorder_writes_what_capture_writes(tmp_path):
    cap = Capture(str(tmp_path / "new"), rank=1, world_size=2, dp=2)
    x = torch.arange(5, dtype=torch.float32, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    with cap.step(7) as s:
        h = s.microbatch(sample_indices=[4, 9], tokens=[[1, 2, 3], [4, 5, 6, 7]], total_lengths=[3, 4],
                         response_lengths=[2, 3], loss_masks=[[1, 0], [1, 1, 1]], cp_size=1, num_tokens=4)
        l = x * 2
        h.hook(l)
        loss = (l * mask).sum() / 4
        h.loss(loss)
        loss.backward()
        path = s.finish(grad_scale=0.5, num_tokens_reduced=8, skipped=False, grad_norm=1.0, global_batch_size=4)
    rec = Recorder(str(tmp_path / "old"), 7, 1, 2, dp=2, dp_rank=1)
    h = rec.microbatch([4, 9], [[1, 2, 3], [4, 5, 6, 7]], [3, 4], [2, 3], [[1, 0], [1, 1, 1]], 1, num_tokens=4)
    l = x * 2
    h.hook(l)
    loss = (l * mask).sum() / 4
    h.loss(loss)
    loss.backward()
    old = rec.finish(0.5, 8, False, 1.0, 4)
    assert os.path.basename(path) == os.path.basename(old) == "step000007-rank00001.safetensors"
    a, b = load_file(path), load_file(old)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    with safe_open(path, "pt") as f, safe_open(old, "pt") as g:
        assert f.metadata() == g.metadata()
        assert f.metadata()["dtype"] == "float32" and f.metadata()["dp_rank"] == "1"
    assert a["mb.0.token_weight"].tolist() == [0.25, 0.0, 0.25, 0.25, 0.25]


def test_recorder_validates_as_capture(tmp_path):
    with pytest.raises(ValueError, match="reduce must be one of"):
        Recorder(str(tmp_path), 0, 0, 1, reduce="sum")
    for terms, match in (({"main": {}}, "'main'"), ({"kl": dict(mask="shift:0")}, "'kl'.*mask"),
                         ({"kl": dict(coef=float("nan"))}, "'kl'.*coef")):
        with pytest.raises(ValueError, match=match):
            Recorder(str(tmp_path), 0, 0, 1, terms=terms)
    rec = Recorder(str(tmp_path), 0, 0, 1, terms={"kl": dict(coef=0.1)})
    assert rec.terms == {"kl": {"reduce": "per-token", "coef": "0.1", "mask": "loss"}}


def _two_samples():
    # sample 10: T=16, R=8 (P=8); sample 11: T=5, R=4 (P=1)
    tokens = [list(range(16)), [3, 4, 5, 6, 7]]
    masks = [[1, 1, 0, 1, 1, 1, 1, 0], [1, 0, 1, 1]]
    return [10, 11], tokens, [16, 5], [8, 4], masks


def test_round_trip(tmp_path):
    rec = Recorder(str(tmp_path), step=3, rank=5, world_size=8, tp=1, pp=2, cp=2, dp=2,
                   tp_rank=0, pp_rank=1, cp_rank=1, dp_rank=0)
    idx, toks, T, R, masks = _two_samples()
    # cp rank 1 owns sample 10: 0..4, sample 11: 2,3  -> 7 owned tokens
    owned = [zigzag_owned(t, r, 2, 1) for t, r in zip(T, R, strict=True)]
    assert owned == [[0, 1, 2, 3, 4], [2, 3]]
    owned_mask = torch.tensor([masks[i][j] for i in range(2) for j in owned[i]], dtype=torch.float32)
    x = torch.randn(7, requires_grad=True)
    per_tok = x * 2.0
    h = rec.microbatch(idx, [torch.tensor(t) for t in toks], T, R, [torch.tensor(m) for m in masks], cp_size=2,
                       num_tokens=owned_mask.sum().to(torch.int32))
    h.hook(per_tok)
    loss = (per_tok * owned_mask).sum() / 3.0
    h.loss(loss)
    loss.backward()
    # dummy micro-batch: nothing hooked, no samples
    rec.microbatch([], [], [], [], [], cp_size=2, dummy=True)
    path = rec.finish(grad_scale=0.25, num_tokens_reduced=torch.tensor(9), skipped=False, grad_norm=1.5,
                      global_batch_size=4, metrics_values=[9.0, 4.5, 1.0], metrics_keys=["loss", "clipfrac"])
    assert os.path.basename(path) == "step000003-rank00005.safetensors"
    assert os.listdir(tmp_path) == ["step000003-rank00005.safetensors"]

    t = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta == {
        "lossguard.schema": "audit/1", "step": "3", "rank": "5", "world_size": "8",
        "tp": "1", "pp": "2", "cp": "2", "dp": "2",
        "tp_rank": "0", "pp_rank": "1", "cp_rank": "1", "dp_rank": "0",
        "cp_layout": "zigzag", "reduce": "per-token", "num_microbatches": "2", "metrics.keys": "loss,clipfrac",
        "dtype": "float32",
    }
    assert t["mb.0.sample_indices"].tolist() == [10, 11]
    assert t["mb.0.total_lengths"].tolist() == [16, 5]
    assert t["mb.0.response_lengths"].tolist() == [8, 4]
    assert t["mb.0.tokens"].tolist() == list(range(16)) + [3, 4, 5, 6, 7]
    assert t["mb.0.loss_masks"].tolist() == masks[0] + masks[1]
    for name in ("sample_indices", "total_lengths", "response_lengths", "tokens", "loss_masks",
                 "cp_size", "num_tokens", "dummy"):
        assert t["mb.0." + name].dtype == torch.int64, name
    for name in ("cp_size", "num_tokens", "loss", "dummy"):
        assert t["mb.0." + name].shape == (), name
    assert t["mb.0.cp_size"].item() == 2 and t["mb.0.num_tokens"].item() == 6 and t["mb.0.dummy"].item() == 0
    assert t["mb.0.loss"].dtype == torch.float64
    assert t["mb.0.loss"].item() == pytest.approx(loss.item())
    # dL/dl_t = m_t / 3, hand-derived
    assert t["mb.0.token_weight"].dtype == torch.float32
    torch.testing.assert_close(t["mb.0.token_weight"], owned_mask / 3.0)
    torch.testing.assert_close(t["mb.0.token_loss"], per_tok.detach())
    assert "mb.0.sample_denoms" not in t
    assert t["mb.1.dummy"].item() == 1
    assert t["mb.1.token_weight"].shape == (0,)
    assert t["mb.1.sample_indices"].shape == (0,)
    for name in ("loss", "num_tokens", "token_loss", "sample_denoms"):
        assert "mb.1." + name not in t
    assert t["grad_scale"].dtype == torch.float64 and t["grad_scale"].shape == () and t["grad_scale"].item() == 0.25
    assert t["num_tokens_reduced"].dtype == torch.int64 and t["num_tokens_reduced"].item() == 9
    assert t["skipped"].dtype == torch.int64 and t["skipped"].item() == 0
    assert t["grad_norm"].dtype == torch.float64 and t["grad_norm"].item() == 1.5
    assert t["global_batch_size"].dtype == torch.int64 and t["global_batch_size"].item() == 4
    assert t["metrics.values"].tolist() == [9.0, 4.5, 1.0]


def test_optional_records_omitted(tmp_path):
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=1)
    h = rec.microbatch([0], [1, 2, 3], [3], [2], None, cp_size=1)   # mask absent = all ones
    h.hook(torch.ones(2, requires_grad=True), record_token_loss=False)
    path = rec.finish(grad_scale=1)
    t = load_file(path)
    assert sorted(t) == sorted(["mb.0.sample_indices", "mb.0.total_lengths", "mb.0.response_lengths",
                                "mb.0.tokens", "mb.0.loss_masks", "mb.0.cp_size", "mb.0.dummy",
                                "mb.0.token_weight", "grad_scale"])
    assert t["mb.0.loss_masks"].tolist() == [1, 1]
    # the backward never reached the tensor: its tokens carried weight 0
    assert t["mb.0.token_weight"].tolist() == [0.0, 0.0]
    with safe_open(path, framework="pt") as f:
        assert "metrics.keys" not in f.metadata()
        assert f.metadata()["num_microbatches"] == "1"


def test_sample_denoms_and_float_grad_scale(tmp_path):
    rec = Recorder(str(tmp_path), step=1, rank=0, world_size=1)
    h = rec.microbatch(torch.tensor([4, 7]), torch.arange(6), torch.tensor([3, 3]), torch.tensor([2, 2]),
                       torch.tensor([1, 1, 0, 1], dtype=torch.bool), cp_size=1, sample_denoms=[5, 5])
    lt = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    h.hook(lt)
    h.set(num_tokens=torch.tensor(3.0))
    (lt * torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)).sum().backward()
    t = load_file(rec.finish(grad_scale=1.0 / 3.0))
    assert t["grad_scale"].item() == 1.0 / 3.0           # python float kept as float64 exactly
    assert t["mb.0.sample_denoms"].tolist() == [5, 5] and t["mb.0.sample_denoms"].dtype == torch.int64
    assert t["mb.0.num_tokens"].dtype == torch.int64 and t["mb.0.num_tokens"].item() == 3
    assert t["mb.0.loss_masks"].tolist() == [1, 1, 0, 1] and t["mb.0.loss_masks"].dtype == torch.int64
    assert t["mb.0.token_weight"].dtype == torch.float64
    assert t["mb.0.token_weight"].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_hook_weight_through_log_softmax(tmp_path):
    """The hook measures dL/dl_t w.r.t. the per-token loss, not the logits: for
    L = (sum_t m_t l_t) / (n * M) with n = 2 unmasked tokens and M = 4, dL/dl_t = m_t / 8."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, requires_grad=True)
    targets = torch.tensor([1, 4, 2])
    mask = torch.tensor([1.0, 0.0, 1.0])
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=1)
    h = rec.microbatch([0], [0, 1, 4, 2], [4], [3], [1, 0, 1], cp_size=1, num_tokens=2)
    l = -torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    h.hook(l)
    L = (l * mask).sum() / 2 / 4
    h.loss(L)
    L.backward()
    t = load_file(rec.finish(grad_scale=1.0))
    assert t["mb.0.token_weight"].tolist() == [0.125, 0.0, 0.125]
    torch.testing.assert_close(t["mb.0.token_loss"], l.detach())
    # and the logits' gradient is the weight times softmax - onehot, row by row
    sm = torch.softmax(logits.detach(), -1)
    oh = torch.nn.functional.one_hot(targets, 5).float()
    torch.testing.assert_close(logits.grad, (sm - oh) * torch.tensor([0.125, 0.0, 0.125])[:, None])


def test_hook_sums_repeated_backward(tmp_path):
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=1)
    h = rec.microbatch([0], [0, 1, 2], [3], [2], [1, 1], cp_size=1)
    x = torch.ones(2, requires_grad=True)
    l = x * 3
    h.hook(l)
    (l * torch.tensor([1.0, 2.0])).sum().backward(retain_graph=True)
    (l * torch.tensor([0.5, 0.5])).sum().backward()
    t = load_file(rec.finish(grad_scale=1.0))
    assert t["mb.0.token_weight"].tolist() == [1.5, 2.5]


def test_bf16_written_as_float32(tmp_path):
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=1)
    h = rec.microbatch([0], [0, 1, 2], [3], [2], [1, 1], cp_size=1)
    l = torch.ones(2, dtype=torch.bfloat16, requires_grad=True) * 2
    h.hook(l)
    h.loss((l * 0.5).sum())
    (l * 0.5).sum().backward()
    t = load_file(rec.finish(grad_scale=1.0))
    assert t["mb.0.token_weight"].dtype == torch.float32 and t["mb.0.token_weight"].tolist() == [0.5, 0.5]
    assert t["mb.0.token_loss"].dtype == torch.float32
    assert t["mb.0.loss"].dtype == torch.float64 and t["mb.0.loss"].item() == 2.0
    with safe_open(rec.path, framework="pt") as f:
        assert f.metadata()["dtype"] == "bfloat16"      # the tensor's own dtype, though written as float32


def test_no_host_sync_before_finish(tmp_path, monkeypatch):
    """Between microbatch() and finish() the recorder reads no tensor value: item/cpu/tolist/numpy and
    Python number conversion raise while the step runs; the hook keeps tensors, not numbers."""
    rec = Recorder(str(tmp_path), step=0, rank=1, world_size=2, cp=2, cp_rank=1)
    idx, toks, T, R, masks = _two_samples()
    dev_like = {  # stand-ins for device tensors
        "sample_indices": torch.tensor(idx), "tokens": [torch.tensor(t) for t in toks],
        "total_lengths": torch.tensor(T), "response_lengths": torch.tensor(R),
        "loss_masks": [torch.tensor(m) for m in masks],
    }
    calls = []

    def forbid(name):
        def f(self, *a, **k):
            calls.append(name)
            raise AssertionError(f"host sync: Tensor.{name} called before finish()")
        return f

    originals = {n: getattr(torch.Tensor, n) for n in ("item", "cpu", "tolist", "numpy", "__int__", "__float__")}
    for n in originals:
        monkeypatch.setattr(torch.Tensor, n, forbid(n))
    x = torch.randn(7, requires_grad=True)
    owned_mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 1])
    h = rec.microbatch(cp_size=torch.tensor(2), num_tokens=owned_mask.sum(), **dev_like)
    l = x * 1.0
    h.hook(l)
    L = (l * owned_mask).sum() / owned_mask.sum()
    h.loss(L)
    L.backward()
    assert len(h._grads) == 1 and isinstance(h._grads[0], torch.Tensor) and not h._grads[0].requires_grad
    assert isinstance(h._loss, torch.Tensor) and isinstance(h._token_loss, torch.Tensor)
    assert calls == []
    for n, f in originals.items():
        monkeypatch.setattr(torch.Tensor, n, f)
    t = load_file(rec.finish(grad_scale=torch.tensor(0.5, dtype=torch.float64)))
    torch.testing.assert_close(t["mb.0.token_weight"], owned_mask / 6.0)


def test_shape_checks(tmp_path):
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=2, cp=2, cp_rank=0)
    # cp rank 0 owns sample (16, 8): 5,6,7 -> 3 tokens; hooking 4 is a layout error
    h = rec.microbatch([0], list(range(16)), [16], [8], [1] * 8, cp_size=2)
    h.hook(torch.zeros(4, requires_grad=True))
    with pytest.raises(ValueError, match="owns 3"):
        rec.finish(grad_scale=1.0)
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=1)
    rec.microbatch([0], [1, 2], [3], [1], [1], cp_size=1)
    with pytest.raises(ValueError, match="tokens has 2 entries"):
        rec.finish(grad_scale=1.0)
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=1)
    rec.microbatch([0], [1, 2, 3], [3], [1], [1], cp_size=1)
    with pytest.raises(ValueError, match="no per-token loss"):
        rec.finish(grad_scale=1.0)
    # a rank that owns nothing need not hook anything
    rec = Recorder(str(tmp_path), step=0, rank=0, world_size=2, cp=2, cp_rank=0)
    rec.microbatch([0], list(range(10)), [10], [4], [1] * 4, cp_size=2)
    t = load_file(rec.finish(grad_scale=1.0))
    assert t["mb.0.token_weight"].shape == (0,)
    with pytest.raises(ValueError):
        Recorder(str(tmp_path), 0, 0, world_size=3, cp=2)


def test_public_api():
    assert lc.capture_filename(12, 3) == "step000012-rank00003.safetensors"
    assert lc.SCHEMA == "audit/1"


def test_hook_with_index_megatron_style(tmp_path):
    """Megatron computes a per-token loss for every local position; hooking it with the owned tokens'
    local index records the owned weights in local order.  Sample T=16, R=8 on cp rank 1 of 2: its
    shard is positions 4..11, the owned logits 7..11 sit at local 3..7 and predict response 0..4."""
    from lossguard_capture import zigzag_local_logit_index
    mask = [1, 0, 1, 1, 0, 1, 1, 1]
    local_loss_mask = torch.zeros(8)
    ix = torch.tensor(zigzag_local_logit_index(16, 8, 2, 1))
    owned = zigzag_owned(16, 8, 2, 1)
    local_loss_mask[ix] = torch.tensor([float(mask[j]) for j in owned])
    x = torch.randn(8, requires_grad=True)
    losses = (x * 1.0).view(1, 8)                      # [b=1, s_local]
    rec = Recorder(str(tmp_path), step=0, rank=1, world_size=2, cp=2, cp_rank=1)
    h = rec.microbatch([0], list(range(16)), [16], [8], mask, cp_size=2)
    h.hook(losses, index=ix)
    loss = (losses.view(-1) * local_loss_mask).sum() / 4
    loss.backward()
    t = load_file(rec.finish(grad_scale=1.0))
    assert t["mb.0.token_weight"].tolist() == [mask[j] / 4 for j in owned]
    torch.testing.assert_close(t["mb.0.token_loss"], x.detach()[ix])
