"""Multi-term objectives in the capture (docs/semantics.md §10): the `terms` declarations in the metadata,
one hook per term (`mb.{k}.term.NAME.*`), the field mask, the least precise dtype over every term, and
single-term captures left exactly as they were."""
import os
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import lossguard_capture as lc  # noqa: E402
from lossguard_capture import Capture, CaptureWarning, zigzag_owned  # noqa: E402

BASE_META = {"lossguard.schema", "step", "rank", "world_size", "tp", "pp", "cp", "dp", "tp_rank", "pp_rank",
             "cp_rank", "dp_rank", "cp_layout", "reduce", "num_microbatches"}
TERMS = {"kl": dict(coef=0.1), "mtp": dict(reduce="per-token", coef=0.3, mask="shift:1"),
         "aux": dict(coef=0.01, mask="all")}


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def meta_of(path):
    with safe_open(path, framework="pt") as f:
        return f.metadata()


def one_sample_mb(s, **kw):
    # sample 4: T=6, R=4 (prompt 2), mask 1 0 1 1 -> N = 3
    return s.microbatch(sample_indices=[4], tokens=[5, 6, 7, 8, 9, 10], total_lengths=[6], response_lengths=[4],
                        loss_masks=[1, 0, 1, 1], **kw)


def test_terms_metadata_and_hand_derived_weights(tmp_path):
    """L = sum(l_main m)/N + 0.1 sum(l_kl m)/N: dL/dl_main = m/N, dL/dl_kl = 0.1 m/N."""
    cap = Capture(str(tmp_path), terms=TERMS)
    m = torch.tensor([1.0, 0.0, 1.0, 1.0])
    N = 3.0
    with cap.step(0) as s:
        h = one_sample_mb(s, num_tokens=3)
        l_main = torch.randn(4, requires_grad=True) * 1.0
        l_kl = torch.randn(4, requires_grad=True) ** 2
        assert h.hook(l_main) is l_main
        assert h.hook(l_kl, term="kl") is l_kl
        h.set(num_tokens=torch.tensor(3), term="kl")
        L = (l_main * m).sum() / N + 0.1 * (l_kl * m).sum() / N
        h.loss(L)
        L.backward()
        path = s.finish(grad_scale=1.0, num_tokens_reduced=3)
    meta = meta_of(path)
    assert set(meta) == BASE_META | {"dtype", "terms"} | {f"term.{n}.{f}" for n in TERMS
                                                          for f in ("reduce", "coef", "mask")}
    assert meta["terms"] == "kl,mtp,aux"
    assert [meta[f"term.kl.{f}"] for f in ("reduce", "coef", "mask")] == ["per-token", "0.1", "loss"]
    assert [meta[f"term.mtp.{f}"] for f in ("reduce", "coef", "mask")] == ["per-token", "0.3", "shift:1"]
    assert [meta[f"term.aux.{f}"] for f in ("reduce", "coef", "mask")] == ["per-token", "0.01", "all"]
    assert meta["dtype"] == "float32"
    t = load_file(path)
    torch.testing.assert_close(t["mb.0.token_weight"], m / 3.0)
    torch.testing.assert_close(t["mb.0.term.kl.token_weight"], 0.1 * m / 3.0)
    assert t["mb.0.term.kl.token_weight"].dtype == torch.float32
    torch.testing.assert_close(t["mb.0.term.kl.token_loss"], l_kl.detach())
    assert t["mb.0.term.kl.num_tokens"].dtype == torch.int64 and t["mb.0.term.kl.num_tokens"].shape == ()
    assert t["mb.0.term.kl.num_tokens"].item() == 3
    assert t["mb.0.loss"].item() == pytest.approx(L.item())          # the whole scalar: every term
    # declared but never hooked: no records; only the kl term has any
    assert sorted(n for n in t if ".term." in n) == ["mb.0.term.kl.num_tokens", "mb.0.term.kl.token_loss",
                                                      "mb.0.term.kl.token_weight"]
    # the main term's records are the single-term ones
    assert "mb.0.term.main.token_weight" not in t and t["mb.0.num_tokens"].item() == 3


def test_term_defaults_follow_the_captures_reduce(tmp_path):
    cap = Capture(str(tmp_path), reduce="sample-mean", terms={"kl": None, "z": {}, "b-2_x": dict(coef=2)})
    with cap.step(0) as s:
        one_sample_mb(s).hook(torch.zeros(4))
        path = s.finish(grad_scale=1.0)
    meta = meta_of(path)
    assert meta["terms"] == "kl,z,b-2_x"
    for n in ("kl", "z"):
        got = (meta[f"term.{n}.reduce"], meta[f"term.{n}.coef"], meta[f"term.{n}.mask"])
        assert got == ("sample-mean", "1.0", "loss")
    assert meta["term.b-2_x.coef"] == "2.0"


def test_terms_on_a_cp_rank_in_owned_order_and_shape_check(tmp_path):
    """CP rank 1 of 2 owns sample (16, 8): 0..4 and sample (5, 4): 2, 3 -> 7 tokens; a term tensor is held
    over the same owned tokens, so one of another length is a layout error naming the term."""
    masks = [[1, 1, 0, 1, 1, 1, 1, 0], [1, 0, 1, 1]]
    owned = [zigzag_owned(16, 8, 2, 1), zigzag_owned(5, 4, 2, 1)]
    om = torch.tensor([float(masks[i][j]) for i in range(2) for j in owned[i]])

    def mb(s):
        return s.microbatch(sample_indices=[10, 11], tokens=[list(range(16)), [3, 4, 5, 6, 7]], total_lengths=[16, 5],
                            response_lengths=[8, 4], loss_masks=masks, cp_size=2)

    # rank 1 of 2 with cp=2: cp_rank 1
    with Capture(str(tmp_path), rank=1, world_size=2, cp=2, terms={"aux": dict(coef=0.5, mask="all")}).step(0) as s:
        h = mb(s)
        l, a = torch.randn(7, requires_grad=True) * 1.0, torch.randn(7, requires_grad=True) * 1.0
        h.hook(l)
        h.hook(a, term="aux")
        (((l * om).sum() + 0.5 * a.sum()) / 4).backward()
        t = load_file(s.finish(grad_scale=1.0))
    torch.testing.assert_close(t["mb.0.token_weight"], om / 4)
    torch.testing.assert_close(t["mb.0.term.aux.token_weight"], torch.full((7,), 0.125))

    with pytest.raises(ValueError, match="term 'kl'.*owns 7"):
        with Capture(str(tmp_path), rank=1, world_size=2, cp=2).step(0) as s:
            h = mb(s)
            h.hook(torch.zeros(7))
            h.hook(torch.zeros(6), term="kl")
            s.finish(grad_scale=1.0)
    with Capture(str(tmp_path), rank=1, world_size=2, cp=2, strict=False).step(0) as s:
        h = mb(s)
        h.hook(torch.zeros(7))
        h.hook(torch.zeros(6), term="kl")
        with pytest.warns(CaptureWarning, match="term 'kl'"):
            s.finish(grad_scale=1.0)


def test_undeclared_term_is_written(tmp_path):
    cap = Capture(str(tmp_path), terms={"kl": dict(coef=0.1)})
    with cap.step(0) as s:
        h = one_sample_mb(s)
        l, z = torch.ones(4, requires_grad=True) * 1.0, torch.ones(4, requires_grad=True) * 2.0
        h.hook(l)
        h.hook(z, term="aux")                     # not declared: a silently active aux loss
        h.set(num_tokens=4, term="aux")
        ((l * torch.tensor([1.0, 0, 1, 1])).sum() / 3 + 0.01 * z.sum() / 4).backward()
        path = s.finish(grad_scale=1.0)
    meta = meta_of(path)
    assert meta["terms"] == "kl" and not any(k.startswith("term.aux.") for k in meta)
    t = load_file(path)
    torch.testing.assert_close(t["mb.0.term.aux.token_weight"], torch.full((4,), 0.0025))
    assert t["mb.0.term.aux.num_tokens"].item() == 4
    assert not any(n.startswith("mb.0.term.kl.") for n in t)    # declared, never hooked: not run


def tiny_mb(s, **kw):
    # sample 0: T=3, R=2, mask 1 1
    return s.microbatch(sample_indices=[0], tokens=[1, 2, 3], total_lengths=[3], response_lengths=[2],
                        loss_masks=[1, 1], cp_size=1, **kw)


def test_undeclared_terms_without_any_declaration(tmp_path):
    with Capture(str(tmp_path)).step(0) as s:
        h = tiny_mb(s)
        h.hook(torch.zeros(2))
        h.hook(torch.zeros(2), term="kl")
        path = s.finish(grad_scale=1.0)
    assert "terms" not in meta_of(path)
    assert load_file(path)["mb.0.term.kl.token_weight"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("terms, match", [
    ({"Kl": {}}, "name 'Kl'"), ({"main": {}}, "'main'"), ({"a,b": {}}, "'a,b'"), ({"1x": {}}, "'1x'"),
    ({"": {}}, "''"), ({3: {}}, "3"),
    ({"kl": dict(reduce="mean")}, "'kl'.*reduce"),
    ({"kl": dict(coef=float("nan"))}, "'kl'.*coef"), ({"kl": dict(coef=float("inf"))}, "'kl'.*coef"),
    ({"kl": dict(coef="0.1")}, "'kl'.*coef"), ({"kl": dict(coef=True)}, "'kl'.*coef"),
    ({"kl": dict(mask="shift:0")}, "'kl'.*mask"), ({"kl": dict(mask="shift:x")}, "'kl'.*mask"),
    ({"kl": dict(mask="shift:-1")}, "'kl'.*mask"), ({"kl": dict(mask="shift:1.5")}, "'kl'.*mask"),
    ({"kl": dict(mask="roll:0")}, "'kl'.*mask"), ({"kl": dict(mask="roll")}, "'kl'.*mask"),
    ({"kl": dict(mask="roll:-2")}, "'kl'.*mask"), ({"kl": dict(mask="rolls:1")}, "'kl'.*mask"),
    ({"kl": dict(mask="loss_mask")}, "'kl'.*mask"), ({"kl": dict(weight=1.0)}, "'kl'.*weight"),
    ({"kl": 0.1}, "'kl'"), (["kl"], "dict"),
])
def test_bad_declarations_raise(tmp_path, terms, match):
    with pytest.raises(ValueError, match=match):
        Capture(str(tmp_path), terms=terms)


def test_good_declarations(tmp_path):
    got = lc.check_terms({"kl": dict(mask="shift:12", coef=-3), "x9": dict(coef=torch.tensor(0.5))}, "token-mean")
    assert got == {"kl": {"reduce": "token-mean", "coef": "-3.0", "mask": "shift:12"},
                   "x9": {"reduce": "token-mean", "coef": "0.5", "mask": "loss"}}
    assert lc.check_terms(None, "per-token") == {} == lc.check_terms({}, "per-token")
    # roll:J, Megatron-core's rolled MTP mask m_{t+J}, as the CLI's --term ...:roll:J
    got = lc.check_terms({"mtp": dict(coef=0.3, mask="roll:1"), "mtp2": dict(mask="roll:2")}, "per-token")
    assert got == {"mtp": {"reduce": "per-token", "coef": "0.3", "mask": "roll:1"},
                   "mtp2": {"reduce": "per-token", "coef": "1.0", "mask": "roll:2"}}
    assert "roll:J" in lc.TERM_MASKS


def test_field_mask(tmp_path):
    cap = Capture(str(tmp_path), terms={"kl": dict(coef=0.1, mask="field"), "aux": dict(mask="all")})
    with cap.step(0) as s:
        h = one_sample_mb(s)
        with pytest.raises(ValueError, match="main term"):
            h.hook(torch.zeros(4), mask=[1, 1, 1, 1])                # the main term's mask is loss_masks
        h.hook(torch.zeros(4))
        with pytest.raises(ValueError, match="'kl'.*field"):
            h.hook(torch.zeros(4), term="kl")                        # a field term needs its mask
        with pytest.raises(ValueError, match="'aux'.*not declared with mask='field'"):
            h.hook(torch.zeros(4), term="aux", mask=[1, 1, 1, 1])
        with pytest.raises(ValueError, match="undeclared|not declared"):
            h.hook(torch.zeros(4), term="other", mask=[1, 1, 1, 1])
        h.hook(torch.zeros(4), term="kl", mask=torch.tensor([True, False, False, True]))
        path = s.finish(grad_scale=1.0)
    t = load_file(path)
    assert t["mb.0.term.kl.mask"].dtype == torch.int64 and t["mb.0.term.kl.mask"].tolist() == [1, 0, 0, 1]
    assert "mb.0.term.aux.mask" not in t and meta_of(path)["term.kl.mask"] == "field"

    def with_mask(mask):
        with Capture(str(tmp_path), terms={"kl": dict(mask="field")}).step(0) as s:
            h = one_sample_mb(s)
            h.hook(torch.zeros(4))
            h.hook(torch.zeros(4), term="kl", mask=mask)
            return s.finish(grad_scale=1.0)
    with pytest.raises(ValueError, match="'kl': the field mask has 3 entries"):
        with_mask([1, 1, 1])
    with pytest.raises(ValueError, match="'kl': the field mask holds values other than 0 and 1"):
        with_mask([1, 2, 0, 1])
    assert load_file(with_mask([1.0, 0.0, 0.0, 1.0]))["mb.0.term.kl.mask"].dtype == torch.int64


def test_one_hook_per_term_and_bad_calls(tmp_path):
    with Capture(str(tmp_path), terms={"kl": {}}).step(0) as s:
        h = one_sample_mb(s)
        h.hook(torch.zeros(4), term="kl")
        with pytest.raises(RuntimeError, match="'kl'.*already hooked"):
            h.hook(torch.zeros(4), term="kl")
        h.hook(torch.zeros(4))                                # the main term is independent
        with pytest.raises(RuntimeError, match="already hooked"):
            h.hook(torch.zeros(4))
        h.hook(torch.zeros(4), term="mtp")                    # another term too
        for bad in ("main", "KL", "a,b", ""):
            with pytest.raises(ValueError):
                h.hook(torch.zeros(4), term=bad)
        with pytest.raises(ValueError, match="sample_denoms"):
            h.set(sample_denoms=[3], term="kl")
        with pytest.raises(TypeError):
            h.hook(torch.zeros(4, dtype=torch.int64), term="z")
        t = load_file(s.finish(grad_scale=1.0))
    assert {n for n in t if ".term." in n} == {"mb.0.term.kl.token_weight", "mb.0.term.kl.token_loss",
                                                "mb.0.term.mtp.token_weight", "mb.0.term.mtp.token_loss"}


def test_term_count_without_hook(tmp_path):
    # a rank that owns nothing of the micro-batch may set a term's count without hooking: zero-length weights
    with Capture(str(tmp_path), rank=0, world_size=2, cp=2).step(0) as s:        # cp_rank 0
        h = s.microbatch(sample_indices=[0], tokens=list(range(10)), total_lengths=[10], response_lengths=[4],
                         loss_masks=[1] * 4, cp_size=2)
        h.set(num_tokens=0, term="kl")
        t = load_file(s.finish(grad_scale=1.0))
    assert t["mb.0.term.kl.token_weight"].shape == (0,) and t["mb.0.term.kl.num_tokens"].item() == 0
    # one that owns tokens must hook the term it counts
    with pytest.raises(ValueError, match="'kl': num_tokens was set but no per-token loss"):
        with Capture(str(tmp_path)).step(0) as s:
            h = tiny_mb(s)
            h.hook(torch.zeros(2))
            h.set(num_tokens=2, term="kl")
            s.finish(grad_scale=1.0)


@pytest.mark.parametrize("main, terms, want", [
    (torch.float32, [torch.bfloat16], "bfloat16"), (torch.float64, [torch.float32], "float32"),
    (torch.float16, [torch.float32, torch.bfloat16], "bfloat16"), (torch.float64, [torch.float64], "float64"),
    (torch.bfloat16, [torch.float16], "bfloat16"),
])
def test_dtype_is_the_least_precise_over_every_term(tmp_path, main, terms, want):
    with Capture(str(tmp_path)).step(0) as s:
        h = tiny_mb(s)
        h.hook(torch.ones(2, dtype=main, requires_grad=True) * 1)
        tensors = [torch.ones(2, dtype=d, requires_grad=True) * 1 for d in terms]
        for i, x in enumerate(tensors):
            h.hook(x, term=f"t{i}")
        sum(x.sum().to(torch.float32) for x in tensors).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", CaptureWarning)      # terms in other dtypes than main: no warning
            path = s.finish(grad_scale=1.0)
    assert meta_of(path)["dtype"] == want
    t = load_file(path)
    for i, d in enumerate(terms):
        w = t[f"mb.0.term.t{i}.token_weight"]
        assert w.dtype == (torch.float64 if d == torch.float64 else torch.float32) and w.tolist() == [1.0, 1.0]
    assert t["mb.0.token_weight"].dtype == (torch.float64 if main == torch.float64 else torch.float32)


def _single_term_step(s):
    h = one_sample_mb(s, num_tokens=3)
    l = torch.arange(4, dtype=torch.float32, requires_grad=True) * 1.0
    h.hook(l)
    L = (l * torch.tensor([1.0, 0, 1, 1])).sum() / 3
    h.loss(L)
    L.backward()
    return s.finish(grad_scale=0.5, num_tokens_reduced=3, skipped=False, grad_norm=1.0, global_batch_size=1,
                    metrics_values=[3.0, 1.0], metrics_keys=["nll"])


def test_single_term_captures_unchanged(tmp_path):
    """No declaration, no term hooked: the same tensor names and metadata as before terms existed,
    and `terms={}` writes the same file as no `terms`."""
    a = _single_term_step(Capture(str(tmp_path / "a")).step(0))
    b = _single_term_step(Capture(str(tmp_path / "b"), terms={}).step(0))
    assert set(meta_of(a)) == BASE_META | {"dtype", "metrics.keys"}
    assert sorted(load_file(a)) == sorted(
        [f"mb.0.{n}" for n in ("sample_indices", "total_lengths", "response_lengths", "tokens", "loss_masks",
                               "cp_size", "num_tokens", "loss", "dummy", "token_weight", "token_loss")]
        + ["grad_scale", "num_tokens_reduced", "skipped", "grad_norm", "global_batch_size", "metrics.values"])
    # (safetensors orders __metadata__ by a hash map: files are compared by content, not bytes)
    assert meta_of(a) == meta_of(b)
    ta, tb = load_file(a), load_file(b)
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[n], tb[n]) and ta[n].dtype == tb[n].dtype for n in ta)


def test_inactive_step_takes_the_term_arguments(tmp_path):
    cap = Capture(str(tmp_path), steps=[1], terms={"kl": dict(mask="field")})
    with cap.step(0) as s:
        h = s.microbatch(sample_indices=[0], tokens=[1, 2], total_lengths=[2], response_lengths=[1])
        x = torch.zeros(1)
        assert h.hook(x, term="kl", mask=[1]) is x and h.hook(x, True, None, term=None) is x
        assert h.set(num_tokens=1, term="kl") is None
        s.finish(grad_scale=1.0)
    assert os.listdir(tmp_path) == []


def test_no_host_sync_with_terms(tmp_path, monkeypatch):
    cap = Capture(str(tmp_path), terms={"kl": dict(mask="field")})
    originals = {n: getattr(torch.Tensor, n) for n in ("item", "cpu", "tolist", "numpy", "__int__", "__float__")}

    def forbid(name):
        def f(self, *a, **k):
            raise AssertionError(f"host sync: Tensor.{name} called before finish()")
        return f
    with cap.step(0) as s:
        for n in originals:
            monkeypatch.setattr(torch.Tensor, n, forbid(n))
        h = s.microbatch(sample_indices=torch.tensor([0]), tokens=torch.tensor([1, 2, 3]),
                         total_lengths=torch.tensor([3]), response_lengths=torch.tensor([2]),
                         loss_masks=torch.tensor([1, 1]), cp_size=1)
        x, y = torch.ones(2, requires_grad=True) * 1, torch.ones(2, requires_grad=True) * 1
        h.hook(x)
        h.hook(y, term="kl", mask=torch.tensor([1, 0]))
        h.set(num_tokens=torch.tensor(1), term="kl")
        (x.sum() + 0.5 * y.sum()).backward()
        for n, f in originals.items():
            monkeypatch.setattr(torch.Tensor, n, f)
        t = load_file(s.finish(grad_scale=1.0))
    assert t["mb.0.term.kl.token_weight"].tolist() == [0.5, 0.5] and t["mb.0.term.kl.mask"].tolist() == [1, 0]
