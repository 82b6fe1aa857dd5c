"""One adapter shape: what every trainer adapter of lossguard_capture does the same way, written once.

Every adapter is entered the same way, on every rank, before training::

    import lossguard_capture.hf                    # or .trl, .megatron, .verl
    run = lossguard_capture.hf.attach(target, "captures", steps=(0,), fail_fast=True)
    ...                                            # train as usual
    run.paths                                      # {step: this rank's capture file}
    run.results, run.verdicts                      # {step: AuditResult}, {step: "pass" / "fail" / ...}

``target`` is what the trainer's loss path hangs off (a ``transformers.Trainer``, a Megatron
``TransformerConfig``, a verl engine).  ``steps``: the optimizer steps recorded (``None``: every step);
``fail_fast``: audit one of them (``audit_step``, default the first) from rank 0 and, when ``lossguard
audit`` says FAIL, raise :class:`lossguard_capture.AuditFailed` on every rank before the optimizer applies
that step (where the trainer's structure allows: each adapter's docstring says where it audits).

As nccl-tests keeps one struct of callbacks per collective around one shared engine, each adapter module
says only what differs — a :class:`Spec` (its package, the versions it was checked against, what it relies
on) and a subclass of :class:`Adapter` whose ``_attach`` wires the trainer: where its per-token loss, its
scaling and its step decision are found.  This module holds the rest, once:

* the version gate (:meth:`Spec.check_version`: a clear error naming the package, the installed version
  and the supported ones; ``allow_unsupported=True`` only warns);
* step selection (:meth:`Adapter.should_capture`) and the step directory naming
  (:func:`step_dir`: ``out_dir/step{n:06d}/``, one capture per rank inside);
* the recorder, built through :class:`lossguard_capture.Capture` (:meth:`Adapter.recorder`);
* the end of a recorded step (:meth:`Adapter.write_step`: write it or drop it, never half) and fail fast
  (:meth:`Adapter.finished`: record the written path and, for the audited step, run ``lossguard
  audit`` on rank 0, hand the verdict to every rank with bounded waits, :func:`lossguard_capture.audit.agree`,
  and raise on FAIL);
* the results (``paths``, ``results``, ``verdicts``) on the object ``attach`` returns;
* ``attach`` itself (:func:`make_attach`): each module binds it in one line, ``attach =
  make_attach(TheAdapter, doc)``, its signature read from the adapter's ``_attach``.
"""

import importlib
import inspect
import itertools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from .audit import AuditError, AuditResult, agree, find_lossguard, run_audit, share_captures
from .capture import Capture, _rank_and_world
from .recorder import StepRecorder, check_reduce

__all__ = ["Spec", "Adapter", "CannotMeasure", "step_dir", "deprecated_alias", "make_attach", "Attach"]

_ADAPTER_IDS = itertools.count()
_A = TypeVar("_A", bound="Adapter")
_A_co = TypeVar("_A_co", bound="Adapter", covariant=True)


def step_dir(out_dir: str, step: int) -> str:
    """The folder of optimizer step ``step``'s captures: ``out_dir/step{step:06d}`` (what ``lossguard audit``
    is given; one ``step{n:06d}-rank{r:05d}.safetensors`` per rank inside)."""
    return os.path.join(out_dir, f"step{int(step):06d}")


class Spec:
    """What an adapter was checked against: the ``package`` (its distribution name), the ``supported``
    versions ``[low, high)``, how to read the ``installed`` version, and what the adapter ``relies_on``
    (said in the error).  ``module`` names the adapter in messages (``lossguard_capture.hf``).

    ``verified``: the releases inside the range whose loss path the adapter's tests ran on (the trainer tests,
    ``make gallery``); ``refused``: ``(low, high, reason)`` for known releases outside the range, the reason
    saying what differs on the loss path and the nearest supported release (said in the error); ``loss_site``:
    the trainer's function whose loss the adapter measures, named when audit says what to change."""

    def __init__(self, module: str, package: str, supported: tuple[str, str], installed: Callable[[], str],
                 relies_on: str, *, verified: Sequence[str] = (),
                 refused: Sequence[tuple[str, str, str]] = (), loss_site: str = ""):
        self.module, self.package, self.supported = module, package, (str(supported[0]), str(supported[1]))
        #: where the trainer computes the loss the adapter measures (captures' ``loss_site``: audit's advice)
        self.loss_site = str(loss_site)
        self.installed, self.relies_on = installed, relies_on
        self.verified = tuple(str(v) for v in verified)
        self.refused = tuple((str(lo), str(hi), str(why)) for lo, hi, why in refused)
        outside = [v for v in self.verified if not self.supports(v)]
        if outside:
            raise ValueError(f"{module}: verified releases {outside} lie outside the supported range {supported}")

    def refusal(self, version: str) -> str | None:
        """Why ``version`` is refused, when it falls in a known ``refused`` range; else None."""
        from packaging.version import Version
        v = Version(version)
        for lo, hi, why in self.refused:
            if Version(lo) <= v and v.release < Version(hi).release:
                return why
        return None

    def require(self, name: str, install: str) -> Any:
        """Import and return module ``name`` (what the adapter needs); ImportError saying what to ``install``
        and the supported range when it is missing."""
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"{self.module} needs {name} ({install}); supported: {self.requirement}") from e

    @property
    def requirement(self) -> str:
        """``package>=low,<high``."""
        return f"{self.package}>={self.supported[0]},<{self.supported[1]}"

    def supports(self, version: str) -> bool:
        """Whether ``version`` is in ``[low, high)`` and in no ``refused`` range (a release inside the range the
        tests could not run on); a pre-release of ``high`` (``high.dev0``, ``high rc1``) counts as ``high``:
        outside."""
        from packaging.version import Version  # a dependency of every trainer adapted here
        v, lo, hi = Version(version), Version(self.supported[0]), Version(self.supported[1])
        return lo <= v and v.release < hi.release and self.refusal(version) is None

    def check_version(self, version: str | None = None, *, allow_unsupported: bool = False) -> None:
        """RuntimeError naming the package, ``version`` (default: the installed one) and the supported range
        when it is outside :attr:`supported`; a warning instead with ``allow_unsupported``."""
        v = version or self.installed()
        if self.supports(v):
            return
        msg = f"{self.module} supports {self.requirement} ({self.relies_on}); {self.package} {v} is installed.  "
        why = self.refusal(v)
        if why:
            msg += f"{self.package} {v}: {why}.  "
        if not allow_unsupported:
            raise RuntimeError(msg + "Install a supported version (scripts/setup-trainers.sh pins one), or pass "
                                     "allow_unsupported=True to try anyway: the adapter then still measures the real "
                                     "weights, but an unverified loss path may be missed or mis-described.")
        # asked for: say what it means, not how to ask for it
        warnings.warn(msg + "Trying anyway (allow_unsupported=True): the weights are still measured, but an "
                            "unverified loss path may be missed or mis-described.", stacklevel=2)

    def __repr__(self) -> str:
        return f"Spec({self.module!r}, {self.requirement!r})"


def say(line: str) -> None:
    """One line on stderr, on a line of its own: through ``tqdm.write`` when tqdm is installed (a training
    loop's progress bar is cleared and redrawn around it instead of being glued to it), else ``print``."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(line, file=sys.stderr, flush=True)
        return
    tqdm.write(line, file=sys.stderr)


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class CannotMeasure(RuntimeError):
    """A captured step the adapter cannot measure (its loss path is not the one the adapter reads): the step is
    dropped; where fail fast audits that step the error stops the run, else :meth:`Adapter.say_unmeasured`
    warns and the run goes on — an adapter never stops a run it cannot measure unless asked to.  ``output``:
    the trainer's own result, when it was computed before the problem showed (the caller returns it)."""

    def __init__(self, msg: str, output: Any = None):
        super().__init__(msg)
        self.output = output


class Adapter:
    """The shared engine of every adapter, and the results object ``attach`` returns (module docstring).

    ``out_dir``: the captures go to ``out_dir/step{n:06d}/``.  ``steps``: the optimizer steps recorded
    (``None``: every step).  ``fail_fast``: audit ``audit_step`` (default: the first of ``steps``) and raise
    :class:`lossguard_capture.AuditFailed` on every rank when it FAILS (:class:`lossguard_capture.AuditError`
    when there is no verdict: no binary, a timeout, captures audit refused).  ``lossguard_bin``: the binary
    (else ``$LOSSGUARD_BIN``, else ``lossguard`` on ``PATH``); ``audit_args``: extra ``lossguard audit``
    arguments (e.g. ``["--strict-scale"]``); ``timeout``: seconds for audit and for each rank's wait.
    ``reduce``: the objective claimed (``None``: the adapter's own claim).  ``strict``: inconsistent records
    raise in ``finish()``.  ``allow_unsupported``: an unsupported version only warns.

    Results: ``paths`` maps each written step to this rank's file, ``results`` each audited step to its
    :class:`lossguard_capture.AuditResult`, ``verdicts`` each audited step to its verdict.

    A subclass sets ``spec`` (and ``requires``: further packages it checks) and implements ``_attach``."""

    spec: ClassVar[Spec]
    requires: ClassVar[tuple[Spec, ...]] = ()

    def __init__(self, out_dir: str, *, steps: Iterable[int] | None = (0,), fail_fast: bool = True,
                 audit_step: int | None = None, lossguard_bin: str | None = None,
                 audit_args: Sequence[str] = (), timeout: float = 300.0, reduce: str | None = "per-token",
                 strict: bool = True, allow_unsupported: bool = False):
        self.allow_unsupported = bool(allow_unsupported)
        for spec in (self.spec, *self.requires):
            spec.check_version(allow_unsupported=self.allow_unsupported)
        self.out_dir = out_dir
        self.steps: list[int] | None = None if steps is None else sorted({int(s) for s in steps})
        if self.steps is not None and not self.steps:
            raise ValueError("steps is empty (None captures every step)")
        self.fail_fast = bool(fail_fast)
        if audit_step is None:
            audit_step = 0 if self.steps is None else self.steps[0]
        if self.steps is not None and int(audit_step) not in self.steps:
            raise ValueError(f"audit_step {audit_step} is not one of the captured steps {self.steps}")
        self.audit_step = int(audit_step)
        self.lossguard_bin = lossguard_bin
        self.audit_args = list(audit_args)
        self.timeout = float(timeout)
        self.reduce: str | None = None if reduce is None else check_reduce(reduce)
        self.strict = strict
        self.paths: dict[int, str] = {}
        self.results: dict[int, AuditResult] = {}
        self._target_ref: Callable[[], Any] | None = None
        self._id = next(_ADAPTER_IDS)
        self._audits = 0

    # -- what each adapter says -----------------------------------------------------------------
    def _attach(self, target: Any, /, **where: Any) -> None:
        """Check ``target`` and wire the adapter into it (instance attributes; classes untouched)."""
        raise NotImplementedError

    def _describe(self) -> str:
        """What the attach message says about the trainer (on rank 0)."""
        return f"reduce={self.reduce}"

    # -- entry ----------------------------------------------------------------------------------
    @property
    def target(self) -> Any:
        """What the adapter is attached to (None before :meth:`attach`)."""
        return None if self._target_ref is None else self._target_ref()

    def attach(self: _A, target: Any, **where: Any) -> _A:
        """Wire the adapter into ``target`` (idempotent; another target is an error) and return it."""
        current = self.target
        if current is target:
            return self
        if current is not None:
            raise RuntimeError(f"this {type(self).__name__} is already attached to another {type(current).__name__}")
        self._attach(target, **where)
        self._target_ref = _ref(target)
        if self.is_main_rank():
            steps = "all" if self.steps is None else self.steps
            say(f"{self.spec.module}: capturing steps {steps} into {self.out_dir} ({self._describe()})")
            if self.fail_fast:
                try:
                    find_lossguard(self.lossguard_bin)
                except AuditError as e:
                    say(f"{self.spec.module}: warning: {e}; step {self.audit_step} will raise AuditError")
        return self

    @staticmethod
    def is_main_rank() -> bool:
        """Rank 0 (of torch.distributed, else of the launcher's ``RANK``): the one that prints and audits."""
        return _rank_and_world()[0] == 0

    # -- steps ----------------------------------------------------------------------------------
    def should_capture(self, step: int) -> bool:
        """Whether optimizer step ``step`` is recorded (``steps=None``: every step)."""
        return self.steps is None or int(step) in self.steps

    def step_dir(self, step: int) -> str:
        """``out_dir/step{step:06d}``."""
        return step_dir(self.out_dir, step)

    def recorder(self, step: int, *, reduce: str | None = None, terms: Any = None,
                 **coordinates: Any) -> StepRecorder:
        """Step ``step``'s recorder, writing into :meth:`step_dir`, built through
        :class:`lossguard_capture.Capture` with this rank's ``coordinates`` (``rank``, ``world_size``, ``tp``,
        ``cp``, ``dp``, ``tp_rank``...; what is not given is found) and the step's declared ``terms``."""
        cap = Capture(self.step_dir(step), reduce=check_reduce(reduce or self.reduce), strict=self.strict,
                      terms=terms, trainer=self.spec.module.rsplit(".", 1)[-1],
                      loss_site=self.spec.loss_site or None, **coordinates)
        rec = cap.step(step)
        assert isinstance(rec, StepRecorder)          # Capture(steps=None) records every step it is asked
        return rec

    # -- a finished step: results and fail fast -------------------------------------------------
    def stops_at(self, step: int) -> bool:
        """Whether a step the adapter cannot measure stops the run: only the step fail fast audits."""
        return self.fail_fast and int(step) == self.audit_step

    def say_unmeasured(self, msg: str) -> None:
        """The warning for a step the adapter cannot measure and drops, the run going on."""
        say(f"{msg} — this step is not measured and the run goes on "
            f"({'fail fast audits step ' + str(self.audit_step) if self.fail_fast else 'fail fast is off'})")

    def write_step(self, step: int, finish: Callable[[], str], abort: Callable[[], None]) -> str:
        """The one step lifecycle every adapter ends a recorded step with, at its last moment before the optimizer
        applies the step: ``finish()`` writes the step's capture and returns its path; on any error ``abort()``
        drops what the step holds (hooks, the open recorder) and the error goes on (an adapter that can go on
        without the step catches its :class:`CannotMeasure`); then :meth:`finished` keeps the path and, for the
        audited step, audits it (AuditFailed on FAIL)."""
        try:
            path = finish()
        except BaseException:
            abort()
            raise
        self.finished(step, path)
        return path

    def finished(self, step: int, path: str) -> None:
        """Step ``step``'s capture is written at ``path``: keep it and, with ``fail_fast``, audit the audited
        step now (:meth:`audit`).  Every rank calls it at the same point: the adapter's last moment before the
        optimizer applies the step."""
        self.paths[int(step)] = path
        if self.fail_fast and int(step) == self.audit_step:
            self.audit(int(step))

    def audit(self, step: int) -> AuditResult:
        """``lossguard audit out_dir/step{n:06d}`` on rank 0 (a JSON report beside it,
        ``audit-step{n:06d}.json``); every rank learns the verdict (bounded waits), keeps it in
        ``results`` and raises AuditFailed on FAIL, AuditError when there is none.  Call it on every rank."""
        where = self.step_dir(step)
        json_path = os.path.join(self.out_dir, f"audit-step{int(step):06d}.json")

        def compute() -> dict[str, Any]:
            return run_audit([where], binary=self.lossguard_bin, args=self.audit_args, timeout=self.timeout,
                             json_path=json_path, step=step).to_json()

        self._audits += 1
        key = f"{self.spec.module}/{self._id}/{self._audits}/step{step}"
        # every rank's capture reaches rank 0's folder over the job's own process group: no shared folder needed
        share_captures(key, self.paths.get(int(step)), where, timeout=self.timeout)
        got = agree(key, compute, timeout=self.timeout)
        if "error" in got:
            raise AuditError(f"{self.spec.module}: step {step}: no audit verdict: {got['error']}")
        result = AuditResult.from_json(got)
        self.results[int(step)] = result
        if self.is_main_rank():
            say(f"{self.spec.module}: lossguard audit {where}: {result.verdict.upper()} (exit {result.exit_code}; "
                f"JSON report {json_path})")
        result.raise_for_verdict()
        return result

    @property
    def verdicts(self) -> dict[int, str]:
        """Each audited step's verdict: ``pass``, ``fail``, ``error``, ``fault`` or ``unverified``."""
        return {s: r.verdict for s, r in self.results.items()}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.out_dir!r}, steps={self.steps}, fail_fast={self.fail_fast}, "
                f"paths={len(self.paths)}, verdicts={self.verdicts})")


def deprecated_alias(cls: type[Adapter], name: str, use: str, **old_defaults: Any) -> type[Adapter]:
    """A subclass of ``cls`` called ``name`` that keeps an old entry's defaults (``old_defaults``) and warns
    (DeprecationWarning) that ``use`` replaces it."""
    def __init__(self: Adapter, out_dir: str, **options: Any) -> None:
        warnings.warn(f"{cls.spec.module}.{name} is deprecated: use {use}", DeprecationWarning, stacklevel=2)
        cls.__init__(self, out_dir, **{**old_defaults, **options})

    doc = (f"Deprecated: {cls.__name__} with the old defaults "
           f"({', '.join(f'{k}={v!r}' for k, v in old_defaults.items())}); use {use}.")
    return type(name, (cls,), {"__init__": __init__, "__doc__": doc, "__module__": cls.__module__,
                               "__qualname__": name})


class Attach(Protocol[_A_co]):
    """What a type checker sees of an adapter module's ``attach`` (:func:`make_attach`): the target (given
    positionally), ``out_dir``, ``steps``, ``fail_fast`` and the adapter's keywords; returns the adapter."""

    def __call__(self, target: Any, /, out_dir: str, *, steps: Sequence[int] | None = (0,), fail_fast: bool = True,
                 **options: Any) -> _A_co: ...


def make_attach(cls: type[_A], doc: str) -> Attach[_A]:
    """An adapter module's ``attach``, the one entry of every adapter (module docstring), for adapter ``cls``:
    ``attach(target, out_dir, *, steps=(0,), fail_fast=True, **options)`` builds ``cls(out_dir, steps=steps,
    fail_fast=fail_fast, **options)`` and returns its :meth:`Adapter.attach` to ``target``.

    The signature is read from ``cls._attach``: the target is named as its first parameter (``trainer``,
    ``engine``, ``config``), and its keyword parameters (Megatron's ``model``, ``optimizer``, ``scheduler``) are
    ``attach``'s too, with their defaults, handed to :meth:`Adapter.attach`; every other keyword is a
    constructor option.  ``doc`` is what ``help(module.attach)`` says.  A module binds it once::

        attach = make_attach(MyAdapter, "Capture ``steps`` of ``trainer`` ...")
    """
    P = inspect.Parameter
    target, *rest = list(inspect.signature(cls._attach).parameters.values())[1:]   # after self
    where = [p for p in rest if p.kind is P.KEYWORD_ONLY]
    sig = inspect.Signature([P(target.name, P.POSITIONAL_OR_KEYWORD, annotation=Any),
                             P("out_dir", P.POSITIONAL_OR_KEYWORD, annotation=str),
                             P("steps", P.KEYWORD_ONLY, default=(0,), annotation=Sequence[int] | None),
                             P("fail_fast", P.KEYWORD_ONLY, default=True, annotation=bool),
                             *where,
                             P("options", P.VAR_KEYWORD, annotation=Any)], return_annotation=cls)

    def attach(*args: Any, **kwargs: Any) -> _A:
        call = sig.bind(*args, **kwargs)      # a TypeError names what is missing or unexpected, as a def would
        call.apply_defaults()
        a = call.arguments
        adapter = cls(a["out_dir"], steps=a["steps"], fail_fast=a["fail_fast"], **a["options"])
        return adapter.attach(a[target.name], **{p.name: a[p.name] for p in where})

    attach.__doc__ = inspect.cleandoc(doc)
    attach.__module__ = cls.__module__
    attach.__qualname__ = "attach"
    attach.__annotations__ = {**{p.name: p.annotation for p in sig.parameters.values()}, "return": cls}
    attach.__signature__ = sig  # type: ignore[attr-defined]
    return attach
