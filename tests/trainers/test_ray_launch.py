"""The adapter's settings reach a trainer launched the way slime launches it: a Ray actor (issue #53).

slime runs its Megatron processes as Ray actors whose environment is a few defaults plus ``--train-env-vars``
(slime/ray/actor_group.py:64-71 and :107-113 @624b824: ``ray.remote(num_gpus=1, runtime_env={"env_vars":
add_default_ray_env_vars(env_vars)})``), so a variable set where the job is submitted never reaches them. On a
real local Ray cluster (ray from PyPI, in the verl venv that pins it) an actor created that way:

* launched as a new user would (``LOSSGUARD_OUT=... LOSSGUARD_BIN=...`` in the submitting process, no
  ``--train-env-vars``) sees neither, and the init hook's check (lossguard_capture.launch, what
  lossguard_capture.slime.init runs first) refuses at once — before any rollout — naming the one line that fixes
  it, instead of an AuditError at step 0's audit after a whole rollout;
* launched with the documented line (``--train-env-vars '{"LOSSGUARD_OUT": ..., "LOSSGUARD_BIN": ...}'``) finds
  both, writes its capture into that folder and gets its verdict from the binary (pass, then a planted x2 FAIL);
* given the settings only in its ``args.train_env_vars`` (the hook running where the runtime env was not
  applied) reads them from there.

    ~/.cache/lossguard/venv-verl/bin/python -m pytest -q tests/trainers/test_ray_launch.py
"""
import os
import sys
from types import SimpleNamespace

import pytest
from harness import HAVE_BIN, LOSSGUARD  # noqa: E402

ray = pytest.importorskip("ray")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PYTHON_DIR = os.path.join(ROOT, "python")
SETTINGS = ("LOSSGUARD_OUT", "LOSSGUARD_BIN", "LOSSGUARD_STEPS", "LOSSGUARD_FAIL_FAST")


class TrainActor:
    """Stands for slime's MegatronTrainRayActor: at init it runs what lossguard_capture.slime.init runs first
    (the settings, then their check), then one recorded step and its audit."""

    def __init__(self, args):
        sys.path.insert(0, PYTHON_DIR)
        from lossguard_capture import launch
        self.args = SimpleNamespace(**args)
        self.seen = {k: os.environ.get(k) for k in SETTINGS}
        self.settings = launch.settings(self.args)
        self.error = None
        try:
            launch.check(self.settings, auditing_rank=True, who="lossguard_capture.slime.init")
        except RuntimeError as e:
            self.error = str(e)

    def init_report(self):
        s = self.settings
        return {"seen": self.seen, "out_dir": s.out_dir, "bin": s.lossguard_bin, "source": s.source,
                "error": self.error}

    def train_step(self, scale):
        """One correct step of two samples (per-token), its gradient scaled by ``scale``, recorded into the
        settings' folder and audited with the settings' binary."""
        import torch

        import lossguard_capture as lc
        from lossguard_capture.audit import run_audit
        s = self.settings
        cap = lc.Capture(s.out_dir, reduce="per-token", rank=0, world_size=1)
        masks = [[1, 1, 0], [1, 1, 1, 1]]
        n = sum(map(sum, masks))
        with cap.step(0) as st:
            h = st.microbatch(sample_indices=[0, 1], tokens=[[5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8]],
                              total_lengths=[5, 6], response_lengths=[3, 4], loss_masks=masks)
            per_token = torch.rand(7, generator=torch.Generator().manual_seed(0)).requires_grad_()
            h.hook(per_token)
            loss = (per_token * torch.tensor([x for m in masks for x in m], dtype=torch.float32)).sum() / n
            h.loss(loss)
            loss.backward()
            path = st.finish(grad_scale=scale, num_tokens_reduced=n, skipped=False, grad_norm=1.0)
        r = run_audit([os.path.dirname(path)], binary=s.lossguard_bin, timeout=120)
        return {"path": path, "exit_code": r.exit_code, "verdict": r.verdict, "text": r.text}


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.pop(k) for k in SETTINGS if k in os.environ}   # the cluster starts without them
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.update(saved)


def actor(train_env_vars, args=None):
    """Created as slime creates its trainers: runtime env = slime's defaults + --train-env-vars (PYTHONPATH only
    so that the actor imports this checkout's lossguard_capture and this module, wherever pytest runs from)."""
    env = {"RAY_USE_UVLOOP": "0", "PYTHONPATH": os.pathsep.join([PYTHON_DIR, HERE]), **train_env_vars}
    cls = ray.remote(num_cpus=1, runtime_env={"env_vars": env})(TrainActor)
    return cls.remote({"train_env_vars": {}, **(args or {})})


def test_a_variable_set_at_submission_does_not_reach_the_actor_and_init_says_the_fix(cluster, tmp_path):
    os.environ["LOSSGUARD_OUT"] = str(tmp_path / "captures")                # as a new user launches it
    os.environ["LOSSGUARD_BIN"] = LOSSGUARD
    try:
        a = actor({})
        rep = ray.get(a.init_report.remote())
    finally:
        del os.environ["LOSSGUARD_OUT"], os.environ["LOSSGUARD_BIN"]
    assert rep["seen"] == {k: None for k in SETTINGS}, rep
    assert rep["source"]["LOSSGUARD_OUT"] == "default" and rep["bin"] is None, rep
    assert rep["error"] is not None and "--train-env-vars '{\"LOSSGUARD_BIN\"" in rep["error"], rep
    assert "lossguard_capture.slime.init" in rep["error"]
    ray.kill(a)


@pytest.mark.skipif(not HAVE_BIN, reason=f"{LOSSGUARD} not built (set LOSSGUARD_BIN)")
def test_the_documented_line_reaches_the_actor_which_writes_and_gets_its_verdict(cluster, tmp_path):
    out = str(tmp_path / "captures")
    a = actor({"LOSSGUARD_OUT": out, "LOSSGUARD_BIN": LOSSGUARD})
    rep = ray.get(a.init_report.remote())
    assert rep["error"] is None, rep
    assert rep["seen"]["LOSSGUARD_OUT"] == out and rep["source"]["LOSSGUARD_BIN"] == "environment", rep
    good = ray.get(a.train_step.remote(1.0))
    assert good["path"].startswith(os.path.join(out, "")), good
    assert os.path.exists(good["path"]) and good["exit_code"] == 0 and good["verdict"] == "pass", good["text"]
    bad = ray.get(a.train_step.remote(2.0))                               # a planted x2 (a constant: strict)
    assert bad["exit_code"] == 0 and "uniform scale ×2" in bad["text"], bad["text"]
    ray.kill(a)


def test_settings_in_the_trainers_own_args_are_read_where_the_environment_lacks_them(cluster, tmp_path):
    out = str(tmp_path / "from-args")
    a = actor({}, {"train_env_vars": {"LOSSGUARD_OUT": out, "LOSSGUARD_FAIL_FAST": "0"}})
    rep = ray.get(a.init_report.remote())
    assert rep["error"] is None and rep["out_dir"] == out, rep
    assert rep["source"]["LOSSGUARD_OUT"] == "--train-env-vars", rep
    assert os.path.isdir(out)
    ray.kill(a)


def test_an_unwritable_folder_is_refused_at_init_naming_it(cluster, tmp_path):
    """A folder that cannot be made (its parent is a file: fails as root too)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    a = actor({"LOSSGUARD_OUT": str(blocker / "captures"), "LOSSGUARD_FAIL_FAST": "0"})
    rep = ray.get(a.init_report.remote())
    assert rep["error"] is not None and "LOSSGUARD_OUT" in rep["error"] and "not writable" in rep["error"], rep
    assert "--train-env-vars '{\"LOSSGUARD_OUT\"" in rep["error"], rep
    ray.kill(a)
