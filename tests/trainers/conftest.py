"""Each trainer's tests run in that trainer's virtual environment (scripts/setup-trainers.sh): test_verl.py
skips itself without verl; test_hf_trainer.py is not collected where the installed transformers is not the
one lossguard_capture.hf supports (venv-verl pins the transformers verl 0.9.1 requires, <5.11)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

collect_ignore = []
try:
    from importlib.metadata import PackageNotFoundError, version

    import lossguard_capture.hf as _hf
    if not _hf.SPEC.supports(version("transformers")):     # the adapter's own gate: its range and refusals
        collect_ignore.append("test_hf_trainer.py")
except (ImportError, PackageNotFoundError):
    pass                                            # test_hf_trainer.py skips itself without transformers



@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Under ctest (LOSSGUARD_TRAINERS_REQUIRED=1) a test file that skips itself — its trainer's package
    missing, or not the pinned version — fails: a skipped adapter test must never read as a pass."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("LOSSGUARD_TRAINERS_REQUIRED") == "1":
        report.outcome = "failed"
        report.longrepr = f"skipped where the trainer's real package must run: {report.longrepr}"
