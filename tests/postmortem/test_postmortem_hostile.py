"""`lossguard postmortem` on HOSTILE dump sets (hostile_dumps.py): memo bombs and cycles, collective
sequence numbers far apart, a 1 GiB file, a pg_config that claims a world of millions, terminal
escapes in names, invalid UTF-8, JSON nested 500,000 deep, 200,000 entries of one memo'd dict. Each
set must be refused (exit 2 naming the file) or handled, within a wall-clock limit and an
address-space limit: never a hang, never killed for memory, never a forged line or a raw escape on
the terminal.

The expected exit codes are what a correct tool must answer for each shape (docs/postmortem.md:
3 the ranks diverged; 0 every member of every group present and matched, the world known; 4 nothing
verified; 2 unreadable or inconsistent dumps, the file named), not what some build answers today.

  LOSSGUARD_BIN=build/cli/lossguard python -m pytest -q tests/postmortem/test_postmortem_hostile.py

LOSSGUARD_HOSTILE_TIMEOUT_S (default 20) and LOSSGUARD_HOSTILE_AS_MB (default 2048; 0 turns the
address-space limit off, as a sanitizer build needs) set the bounds.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hostile_dumps as H  # noqa: E402

BIN = os.environ.get("LOSSGUARD_BIN", os.path.join(HERE, "..", "..", "build", "cli", "lossguard"))
TIMEOUT_S = float(os.environ.get("LOSSGUARD_HOSTILE_TIMEOUT_S", "20"))
AS_MB = int(os.environ.get("LOSSGUARD_HOSTILE_AS_MB", "2048"))
OUTPUT_LIMIT = 64 << 20  # bytes a run may write to a file (RLIMIT_FSIZE): a report, not GBs
BAD_BYTES = {b"\x1b": "ESC", b"\r": "CR", b"\x07": "BEL"}

# shape -> (exit codes a correct tool may give, why). Exit 2 must also name one of the shape's
# hostile files in stderr.
EXPECT = {
    # frames must be a list of dicts: nested lists are malformed, however many leaves they expand to
    "memo-bomb-lists": ({2}, "lists of lists as frames: refused, without walking 10^9 leaves"),
    # every frame is a well-formed dict (extra keys ignored): read in bounded time, or refused as a
    # bomb; the two ranks issued the same call on the default group pg_config lists as [0, 1]
    "memo-bomb-dicts": ({0, 2}, "10^9 frame dicts as a tree: read as shared, or refused"),
    "memo-cycle-lists": ({2}, "a frames list holding itself: malformed"),
    "memo-cycle-dicts": ({0, 2}, "a frame holding itself under an extra key"),
    # rank 1's first record (record_id 0: nothing dropped) is call 2^40, so it never issued call 1,
    # which rank 0 did: a divergence, or dumps refused as inconsistent. Never a table per number.
    "seq-gap-2p40": ({2, 3}, "collective_seq_id 1 vs 2^40"),
    "seq-gap-int64max": ({2, 3}, "collective_seq_id 1 vs INT64_MAX"),
    "seq-gap-2p62": ({2, 3}, "collective_seq_id 1 vs 2^62"),
    "seq-gap-int64-span": ({2, 3}, "collective_seq_id INT64_MIN vs INT64_MAX"),
    "seq-gap-2p64": ({2}, "collective_seq_id 2^64: no recorder writes it"),
    # the same two calls on both ranks: matched, refused for the gap, or not verified; no divergence
    "seq-gap-one-rank": ({0, 2, 4}, "calls 1 and 2^62 on each rank"),
    "sparse-1g-zeros": ({2}, "a 1 GiB file of zeros is not a dump"),
    "sparse-1g-pickle": ({2}, "1 GiB starting as a pickle, then zeros"),
    # a world of millions claimed by two tiny dumps is never green: refused, or not verified
    # (ranks left no dump), or a divergence
    "claimed-world-16m": ({2, 3, 4}, "default group [16777215], called by ranks 0 and 1"),
    "claimed-world-ellipsis": ({2, 3, 4}, "ranks '[0, 1, ..., 16777215]'"),
    "claimed-world-2p40": ({2, 3, 4}, "ranks '[0, 1, 1099511627775]'"),
    "claimed-world-bigint": ({2, 3, 4}, "ranks [0, 1, 2^64]"),
    "claimed-world-16m-members": ({2, 3, 4}, "ranks '[0, 1, 16777215]': 16777213 left no dump"),
    # valid dumps with one real divergence: reported, whatever the names hold
    "escapes": ({3}, "rank 0 issued all_reduce #2 on the escaped group; rank 1 never did"),
    "escapes-profiling-name": ({2, 3}, "profiling_name with escapes and a forged line"),
    "escapes-op": ({2, 3}, "an op name with escapes and a forged line"),
    "escapes-file-name": ({2}, "a truncated dump whose file name holds escapes"),
    "invalid-utf8": ({2, 3}, "frame names that are not UTF-8"),
    "escapes-json": ({3}, "the escapes set as JSON dumps"),
    # frames must be a list of dicts: 500,000 nested lists are malformed (and no recursion survives
    # them on a thread's stack)
    "json-deep": ({2}, "an entry's frames nesting 500,000 JSON lists"),
    # one group, the same call 200,000 times on both ranks: matched, refused (one call number
    # recorded 200,000 times), or not verified; no divergence between the ranks
    "entries-memo-200k": ({0, 2, 4}, "200,000 references to one entry dict per rank"),
}
TEXT_SHAPES = ["escapes", "escapes-json", "escapes-profiling-name", "escapes-op",
               "escapes-file-name", "invalid-utf8"]


def test_every_shape_has_an_expectation():
    assert set(EXPECT) == set(H.SHAPES)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return H.write_all(str(tmp_path_factory.mktemp("hostile")))


def _limits():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_LIMIT, OUTPUT_LIMIT))
    if AS_MB > 0:
        resource.setrlimit(resource.RLIMIT_AS, (AS_MB << 20, AS_MB << 20))


def postmortem(tmp_path, *args):
    """Runs `lossguard postmortem ARGS` under the bounds; returns (rc, stdout, stderr) as bytes, or
    fails the test on a timeout or a death by signal."""
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    # glibc reserves 64 MiB of address space per thread arena: bound the arenas so that the limit
    # measures memory used, not the core count.
    env = dict(os.environ, MALLOC_ARENA_MAX="2")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        start = time.monotonic()
        p = subprocess.Popen([BIN, "postmortem", *map(str, args)], stdout=out, stderr=err,
                             stdin=subprocess.DEVNULL, env=env, preexec_fn=_limits)
        try:
            rc = p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
        took = time.monotonic() - start
    stdout, stderr = out_path.read_bytes(), err_path.read_bytes()
    tail = stderr[-2000:].decode("utf-8", "backslashreplace")
    if rc is None:
        pytest.fail(f"postmortem {args}: still running after {TIMEOUT_S:.0f} s (killed)\n{tail}")
    if rc < 0:
        sig = signal.Signals(-rc).name
        why = {"SIGXFSZ": f"it wrote more than {OUTPUT_LIMIT >> 20} MiB of output"}.get(
            sig, f"a crash, or out of memory under the {AS_MB} MiB address-space limit")
        pytest.fail(f"postmortem {args}: killed by {sig} after {took:.1f} s ({why})\n{tail}")
    return rc, stdout, stderr


def check_terminal_safe(stdout, stderr, rc):
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        for b, what in BAD_BYTES.items():
            assert b not in text, f"raw {what} in {name}:\n{text[-2000:]!r}"
    forged = [f.lower() for f in H.forged_lines()]
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        for ln in text.decode("utf-8", "backslashreplace").split("\n"):
            assert not ln.lower().startswith(tuple(forged)), f"a forged line in {name}: {ln!r}"
    # the real headline only, in the text report
    lines = stdout.decode("utf-8", "backslashreplace").split("\n")
    headlines = [ln for ln in lines if ln.startswith("DIVERGENCE")]
    assert len(headlines) <= (1 if rc == 3 else 0), headlines


def check(shape, rc, stdout, stderr, hostile):
    allowed, why = EXPECT[shape]
    err = stderr.decode("utf-8", "backslashreplace")
    assert rc in allowed, (f"{shape} ({why}): exit {rc}, expected one of {sorted(allowed)}\n"
                           f"{err[-2000:]}")
    if rc == 2:
        # the file named; an escaped name is found by its printable tail
        names = [h.rsplit("\n", 1)[-1].rsplit("\r", 1)[-1] for h in hostile]
        assert any(n in err for n in names), f"{shape}: exit 2 names none of {hostile}:\n{err}"
    check_terminal_safe(stdout, stderr, rc)


@pytest.mark.parametrize("shape", list(EXPECT))
def test_hostile_set_json(shape, shapes, tmp_path):
    d, hostile = shapes[shape]
    rc, stdout, stderr = postmortem(tmp_path, d, "--json", "-")
    check(shape, rc, stdout, stderr, hostile)
    if rc != 2:
        doc = json.loads(stdout.decode("utf-8"), strict=True)  # strict: no raw control characters
        assert isinstance(doc, dict)
        if shape in ("escapes", "escapes-json"):
            text = json.dumps(doc)
            for m in H.ESC_MARKERS:
                assert m in text, f"{m} missing from the JSON"


@pytest.mark.parametrize("shape", TEXT_SHAPES)
def test_hostile_set_text(shape, shapes, tmp_path):
    d, hostile = shapes[shape]
    rc, stdout, stderr = postmortem(tmp_path, d)
    check(shape, rc, stdout, stderr, hostile)
    if shape in ("escapes", "escapes-json"):
        text = stdout.decode("utf-8")
        # the divergence's group and the culprit's frames are shown, escaped
        for m in ["ESCNAME", "ESCFRAME1", "ESCFILE1"]:
            assert m in text, f"{m} not shown:\n{text}"


def test_the_bounds_let_a_plain_set_through(tmp_path):
    """The same bounds on a plain two-rank set (one all-reduce on the default group pg_config lists
    as [0, 1]): the limits leave room for the tool itself."""
    d = tmp_path / "plain"
    H._write(str(d), {f"fr_trace_rank_{r}": H.pickle_bytes(H.dump([H.entry()])) for r in (0, 1)})
    rc, stdout, stderr = postmortem(tmp_path, d, "--json", "-")
    assert rc == 0, stderr.decode("utf-8", "backslashreplace")
    json.loads(stdout.decode("utf-8"), strict=True)
