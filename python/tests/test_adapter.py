"""lossguard_capture.adapter: the one adapter shape every trainer adapter shares — the version gate, step
selection, the step directory naming, the recorder built through Capture, fail fast and the results — on a
toy "trainer" (a plain torch loop) that says only what differs, as the real adapters do."""
import os
import stat
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import lossguard_capture as lc  # noqa: E402
from lossguard_capture.adapter import Adapter, Spec, deprecated_alias, make_attach, step_dir  # noqa: E402


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOSSGUARD_BIN"):
        monkeypatch.delenv(k, raising=False)


TOY_SPEC = Spec("lossguard_capture.toy", "toy-trainer", ("1.2.0", "1.3.0"), lambda: "1.2.5",
                "it hooks ToyTrainer.loss as these versions have it")


class ToyTrainer:
    """A trainer with one micro-batch of two samples per step: loss = mean over the masked tokens."""

    def __init__(self):
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.applied = []               # the steps whose update was applied

    def loss(self, step):
        tokens = torch.tensor([1, 2, 0, 2, 1, 1])       # two samples of 3 response tokens, packed
        mask = torch.tensor([1, 1, 0, 1, 0, 1])
        l = self.w[tokens] * (step + 1)                 # per-token losses [6]
        return l, mask, (l * mask).sum() / mask.sum()

    def train(self, steps):
        for step in range(steps):
            l, mask, loss = self.loss(step)
            loss.backward()
            self.before_update(step)
            with torch.no_grad():
                self.w -= 0.1 * self.w.grad
            self.w.grad = None
            self.applied.append(step)

    def before_update(self, step):
        pass


class ToyAdapter(Adapter):
    """All a toy adapter says: its spec, and where the toy trainer's per-token loss, scaling and step
    decision are found."""

    spec = TOY_SPEC

    def _attach(self, trainer, **where):
        adapter, orig_loss = self, trainer.loss
        self._rec = None

        def loss(step):
            l, mask, value = orig_loss(step)
            if adapter.should_capture(step):
                adapter._rec = adapter.recorder(step, rank=0, world_size=1)
                mb = adapter._rec.microbatch(sample_indices=[0, 1], tokens=[[1, 2, 0], [2, 1, 1]],
                                             total_lengths=[3, 3], response_lengths=[3, 3], loss_masks=mask)
                mb.hook(l)
                mb.loss(value)
            return l, mask, value

        def before_update(step):
            if adapter._rec is not None:
                rec, adapter._rec = adapter._rec, None
                adapter.finished(step, rec.finish(grad_scale=1.0, num_tokens_reduced=4, skipped=False))
        trainer.loss, trainer.before_update = loss, before_update


attach = make_attach(ToyAdapter, """Capture ``steps`` of ``trainer`` (a ToyTrainer) into ``out_dir``.""")


#: what the fake binaries do as lossguard does: the JSON report of their verdict at ``--json PATH`` (run_audit
#: takes a verdict only with its report)
_REPORT = ('prev=; for a; do [ "$prev" = --json ] && printf \'{"schema": "lossguard/1", "verdict": "v", '
           '"exit_code": CODE}\' > "$a"; prev=$a; done\n')


def _fake_lossguard(tmp_path, code):
    p = tmp_path / f"lossguard-{code}"
    p.write_text(f"#!/bin/sh\necho 'verdict exit {code}'\necho \"args: $*\" >&2\n{_REPORT}exit {code}\n".replace(
        "CODE", str(code)))
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


# ---- the version gate ------------------------------------------------------------------------------
def test_version_gate_names_the_package_the_installed_and_the_supported_versions():
    with pytest.raises(RuntimeError, match=r"^lossguard_capture\.toy supports toy-trainer>=1\.2\.0,<1\.3\.0 \(it hooks "
                                           r"ToyTrainer\.loss as these versions have it\); toy-trainer 1\.1\.0 is "
                                           r"installed\."):
        TOY_SPEC.check_version("1.1.0")
    for v in ("1.3.0", "1.3.0.dev0", "1.3.0rc1", "1.2.0rc1", "2.0"):
        with pytest.raises(RuntimeError, match=f"toy-trainer {v} is installed"):
            TOY_SPEC.check_version(v)
    TOY_SPEC.check_version("1.2.0")
    TOY_SPEC.check_version()                                   # the installed one: 1.2.5
    with pytest.warns(UserWarning, match="supports toy-trainer") as got:
        TOY_SPEC.check_version("1.4.0", allow_unsupported=True)
    # the warning says what allow_unsupported does, not to pass it (it was passed)
    assert "Trying anyway (allow_unsupported=True)" in str(got[0].message)
    assert "or pass allow_unsupported" not in str(got[0].message)
    assert TOY_SPEC.requirement == "toy-trainer>=1.2.0,<1.3.0"


def test_a_known_refused_release_says_why_and_verified_releases_lie_inside_the_range():
    spec = Spec("lossguard_capture.toy", "toy-trainer", ("1.2.0", "1.4.0"), lambda: "1.2.5", "it hooks ToyTrainer.loss",
                verified=("1.2.0", "1.3.1"), refused=(("1.0.0", "1.2.0", "1.1 divides by the micro-batch count; "
                                                                          "nearest supported: 1.2.0"),))
    assert spec.verified == ("1.2.0", "1.3.1")
    with pytest.raises(RuntimeError, match=r"toy-trainer 1\.1\.7: 1\.1 divides by the micro-batch count; nearest "
                                           r"supported: 1\.2\.0\."):
        spec.check_version("1.1.7")
    with pytest.raises(RuntimeError) as got:                    # outside every known refusal: the range alone
        spec.check_version("0.9.0")
    assert "divides" not in str(got.value)
    assert spec.refusal("1.3.0") is None and spec.refusal("1.0.0") is not None
    with pytest.raises(ValueError, match="verified releases"):
        Spec("lossguard_capture.toy", "toy-trainer", ("1.2.0", "1.4.0"), lambda: "1.2.5", "r", verified=("1.4.0",))


def test_an_adapter_of_an_unsupported_version_is_refused_at_construction(tmp_path):
    class Old(ToyAdapter):
        spec = Spec("lossguard_capture.toy", "toy-trainer", ("1.2.0", "1.3.0"), lambda: "1.1.9", "reasons")

    class Also(ToyAdapter):
        requires = (Old.spec,)
    for cls in (Old, Also):
        with pytest.raises(RuntimeError, match="toy-trainer 1.1.9 is installed"):
            cls(str(tmp_path))
        with pytest.warns(UserWarning):
            cls(str(tmp_path), allow_unsupported=True)


# ---- steps, naming, the recorder -------------------------------------------------------------------
def test_step_selection_and_audit_step():
    a = ToyAdapter("c", steps=[5, 0, 5], fail_fast=False)
    assert a.steps == [0, 5] and a.audit_step == 0
    assert [s for s in range(7) if a.should_capture(s)] == [0, 5]
    assert ToyAdapter("c", steps=None).should_capture(12345) and ToyAdapter("c", steps=None).audit_step == 0
    assert ToyAdapter("c", steps=range(3), audit_step=2).audit_step == 2
    with pytest.raises(ValueError, match="steps is empty"):
        ToyAdapter("c", steps=[])
    with pytest.raises(ValueError, match="audit_step 4 is not one of the captured steps"):
        ToyAdapter("c", steps=[0, 1], audit_step=4)
    with pytest.raises(ValueError, match="reduce must be one of"):
        ToyAdapter("c", reduce="mean")


def test_step_dir_naming():
    assert step_dir("caps", 7) == os.path.join("caps", "step000007")
    assert ToyAdapter("caps").step_dir(123456) == os.path.join("caps", "step123456")


def test_recorder_is_built_through_capture(tmp_path):
    a = ToyAdapter(str(tmp_path), reduce="sample-mean")
    rec = a.recorder(3, rank=5, world_size=8, tp=2, cp=2, terms={"kl": dict(coef=0.5)})
    assert isinstance(rec, lc.StepRecorder)
    assert rec.out_dir == os.path.join(str(tmp_path), "step000003") and rec.step == 3
    # Capture's coordinates (Megatron order): 5 = tp 1 + 2*(cp 0 + 2*dp 1)
    assert (rec.tp, rec.cp, rec.dp, rec.tp_rank, rec.cp_rank, rec.dp_rank) == (2, 2, 2, 1, 0, 1)
    assert rec.reduce == "sample-mean" and rec.terms == {"kl": {"reduce": "sample-mean", "coef": "0.5", "mask": "loss"}}
    rec.abort()


# ---- entry, results, fail fast ---------------------------------------------------------------------
def test_attach_records_the_steps_and_changes_nothing(tmp_path):
    plain, toy = ToyTrainer(), ToyTrainer()
    plain.train(3)
    run = attach(toy, str(tmp_path / "caps"), steps=[0, 2], fail_fast=False)
    assert run.attach(toy) is run                                             # idempotent
    with pytest.raises(RuntimeError, match="already attached to another ToyTrainer"):
        run.attach(ToyTrainer())
    toy.train(3)
    assert torch.equal(toy.w, plain.w) and toy.applied == [0, 1, 2]
    assert sorted(run.paths) == [0, 2] and run.results == {} and run.verdicts == {}
    for n, path in run.paths.items():
        assert path == os.path.join(str(tmp_path / "caps"), f"step{n:06d}", f"step{n:06d}-rank00000.safetensors")
        t = load_file(path)
        m = t["mb.0.loss_masks"].float()
        torch.testing.assert_close(t["mb.0.token_weight"], m / m.sum())          # the mean's weights: m / N
        with safe_open(path, "pt") as f:
            assert f.metadata()["reduce"] == "per-token"


def test_fail_fast_pass_keeps_the_verdict(tmp_path, capsys):
    toy = ToyTrainer()
    run = attach(toy, str(tmp_path / "caps"), steps=[0, 1], audit_step=1, lossguard_bin=_fake_lossguard(tmp_path, 0),
                 audit_args=["--strict-scale"])
    toy.train(2)
    assert toy.applied == [0, 1] and sorted(run.paths) == [0, 1]
    assert list(run.results) == [1] and run.verdicts == {1: "pass"}
    r = run.results[1]
    assert r.paths == [os.path.join(str(tmp_path / "caps"), "step000001")]
    assert r.command[-3:] == ["--strict-scale", "--json", os.path.join(str(tmp_path / "caps"), "audit-step000001.json")]
    err = capsys.readouterr().err
    assert "lossguard_capture.toy: capturing steps [0, 1] into" in err
    # the in-run verdict on a line of its own, with where CI finds the JSON report
    json_report = os.path.join(str(tmp_path / "caps"), "audit-step000001.json")
    assert f"step000001: PASS (exit 0; JSON report {json_report})\n" in err


def test_fail_fast_fail_stops_before_the_update(tmp_path):
    toy = ToyTrainer()
    w0 = toy.w.detach().clone()
    run = attach(toy, str(tmp_path / "caps"), lossguard_bin=_fake_lossguard(tmp_path, 1))
    with pytest.raises(lc.AuditFailed, match="lossguard audit FAILED step 0") as e:
        toy.train(2)
    assert e.value.step == 0 and e.value.exit_code == 1
    assert toy.applied == [] and torch.equal(toy.w.detach(), w0)          # the step was not applied
    assert list(run.paths) == [0] and run.verdicts == {0: "fail"}


def test_fail_fast_without_a_verdict_is_an_error(tmp_path, capsys):
    toy = ToyTrainer()
    run = attach(toy, str(tmp_path / "caps"), lossguard_bin=str(tmp_path / "no-such-lossguard"))
    err = capsys.readouterr().err
    assert "no-such-lossguard" in err and "step 0 will raise AuditError" in err          # said at attach
    with pytest.raises(lc.AuditError, match=r"lossguard_capture\.toy: step 0: no audit verdict: .*no-such-lossguard"):
        toy.train(1)
    assert toy.applied == [] and list(run.paths) == [0] and run.results == {}
    toy2 = ToyTrainer()
    attach(toy2, str(tmp_path / "caps2"), lossguard_bin=_fake_lossguard(tmp_path, 2))
    with pytest.raises(lc.AuditError, match="no verdict"):
        toy2.train(1)


class PipelineAdapter(ToyAdapter):
    """An adapter whose ``_attach`` takes keywords besides its target (Megatron's shape: the model chunks, the
    optimizer)."""

    def _attach(self, config, *, model=None, optimizer=None):
        self.where = (config, model, optimizer)


def test_make_attach_is_each_modules_attach_with_the_adapters_signature(tmp_path):
    """One ``attach`` for every adapter module: the target named as ``_attach`` names it, ``steps=(0,)`` and
    ``fail_fast=True`` by default, ``_attach``'s keywords handed to it, every other keyword the constructor's;
    what ``help(module.attach)`` shows is the module's."""
    import inspect

    assert str(inspect.signature(attach)) == ("(trainer: Any, out_dir: str, *, steps: collections.abc.Sequence[int] "
                                              "| None = (0,), fail_fast: bool = True, **options: Any) -> "
                                              f"{__name__}.ToyAdapter")
    assert attach.__doc__.startswith("Capture ``steps`` of ``trainer`` (a ToyTrainer)")
    assert (attach.__module__, attach.__name__, attach.__qualname__) == (__name__, "attach", "attach")
    run = attach(trainer=ToyTrainer(), out_dir=str(tmp_path / "a"), audit_step=0)       # keywords, as a def takes
    assert isinstance(run, ToyAdapter) and run.steps == [0] and run.fail_fast is True
    with pytest.raises(TypeError, match="out_dir"):
        attach(ToyTrainer())
    with pytest.raises(TypeError, match="model"):                  # not the toy's: a constructor option, refused
        attach(ToyTrainer(), str(tmp_path / "b"), model=[])

    pipeline = make_attach(PipelineAdapter, """
        Capture ``steps`` of a pipeline.
          ``model``: the chunks.""")
    assert str(inspect.signature(pipeline)).startswith(
        "(config: Any, out_dir: str, *, steps: collections.abc.Sequence[int] | None = (0,), fail_fast: bool = True, "
        "model=None, optimizer=None, **options: Any) -> ")
    assert pipeline.__doc__ == "Capture ``steps`` of a pipeline.\n  ``model``: the chunks."
    cfg, chunks = object(), [object()]
    run = pipeline(cfg, str(tmp_path / "c"), steps=None, fail_fast=False, model=chunks, timeout=5)
    assert run.where == (cfg, chunks, None) and run.steps is None and run.fail_fast is False and run.timeout == 5.0


def test_deprecated_alias_keeps_the_old_defaults_and_warns(tmp_path):
    Old = deprecated_alias(ToyAdapter, "OldToy", "lossguard_capture.toy.attach(...)", steps=None, fail_fast=False)
    assert issubclass(Old, ToyAdapter) and Old.__name__ == "OldToy" and "Deprecated" in Old.__doc__
    with pytest.warns(DeprecationWarning, match=r"lossguard_capture\.toy\.OldToy is deprecated: use "
                                                r"lossguard_capture\.toy\.attach"):
        old = Old(str(tmp_path))
    assert old.steps is None and old.fail_fast is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert Old(str(tmp_path), steps=[3], fail_fast=True).steps == [3]


def test_the_in_run_lines_go_through_tqdm_when_it_is_there(monkeypatch, capsys):
    """A training loop's progress bar (tqdm, as the HF Trainer draws it) and the adapter's lines: with tqdm
    installed each line goes through tqdm.write (which clears and redraws the bar), else print."""
    import types

    from lossguard_capture import adapter as ad
    written = []
    fake = types.ModuleType("tqdm.auto")
    fake.tqdm = types.SimpleNamespace(write=lambda line, file=None: written.append((line, file)))
    monkeypatch.setitem(sys.modules, "tqdm.auto", fake)
    ad.say("lossguard_capture.toy: lossguard audit x: PASS (exit 0)")
    assert written == [("lossguard_capture.toy: lossguard audit x: PASS (exit 0)", sys.stderr)]
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)          # not installed: import fails
    ad.say("second")
    assert capsys.readouterr().err == "second\n"
