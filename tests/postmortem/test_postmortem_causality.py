"""`lossguard postmortem` finds the ROOT of a hang on real 8-rank Gloo jobs (fr_job8.py: Megatron's
TP2 x PP2 x DP2 layout under torchrun, every group of parallel_state, each rank dumping its Flight
Recorder from its own error or timeout path). Each job's culprit is derived by hand from the fault
planted (the derivations are in fr_job8.py's SCENARIOS and repeated at each test), never read from
lossguard's output; each test first checks the premise on the dumps themselves (pickle).

  rank = tp + TP*(cp + CP*(dp + DP*pp))       stage 0: 0 1 | 2 3     stage 1: 4 5 | 6 7
  TP [0,1] [2,3] [4,5] [6,7]   DP (= DP with CP) [0,2] [1,3] [4,6] [5,7]
  PP [0,4] [1,5] [2,6] [3,7]   MP [0,1,4,5] [2,3,6,7]

Group names are creation numbers ('0' the world). Megatron's order, each data-parallel group followed
by its _GLOO twin: DATA_PARALLEL_GROUP_WITH_CP [0,2] [1,3] [4,6] [5,7] are '1' '3' '5' '7' (twins '2'
'4' '6' '8'), DATA_PARALLEL_GROUP the same ranks '9' '11' '13' '15' (twins '10' '12' '14' '16'), then
MODEL_PARALLEL '17' '18', TENSOR '19'-'22', PIPELINE '23'-'26'. Without group_desc (no twins; pipeline
'1'-'4', tensor '5'-'8', model '9' '10', data with CP '11'-'14', data '15'-'18') DATA_PARALLEL_GROUP
[5,7] is '18' and DP_WITH_CP [5,7] '14'.

  LOSSGUARD_BIN=build/cli/lossguard python -m pytest -q tests/postmortem/test_postmortem_causality.py
"""

import glob
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("LOSSGUARD_BIN", os.path.join(HERE, "..", "..", "build", "cli", "lossguard"))
JOB = os.path.join(HERE, "fr_job8.py")
LAYOUT = ("--tp", 2, "--pp", 2, "--dp", 2)
WORLD8 = ("--world", 8)
ALL8 = list(range(8))


def megatron_python():
    """A Python that imports megatron.core (this one, or scripts/setup-trainers.sh's venv)."""
    if importlib.util.find_spec("megatron") is not None:
        return sys.executable
    venv = os.environ.get("LOSSGUARD_MEGATRON_VENV",
                          os.path.expanduser("~/.cache/lossguard/venv-megatron"))
    py = os.path.join(venv, "bin", "python")
    found = glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "megatron", "core",
                                   "parallel_state.py"))
    return py if os.path.exists(py) and found else None


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Runs each scenario once (8 processes, 4 for world-count); returns scenario -> (dir, log)."""
    out = {}

    def run(scenario, nproc=8, python=sys.executable, buffer=2000, no_dump=()):
        if scenario not in out:
            d = tmp_path_factory.mktemp(scenario)
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE=str(buffer),
                       TORCH_FR_DUMP_TEMP_FILE=str(d / "fr_trace_rank_"))
            p = subprocess.run([python, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", str(nproc), JOB, "--scenario", scenario,
                                "--out", str(d), "--timeout", "4"],
                               env=env, capture_output=True, text=True, timeout=240)
            log = p.stdout + p.stderr
            dumps = sorted(int(f.rsplit("_", 1)[1]) for f in os.listdir(d)
                           if f.startswith("fr_trace_rank_"))
            assert dumps == [r for r in range(nproc) if r not in no_dump], log[-4000:]
            assert (p.returncode == 0) == (scenario == "clean"), log[-4000:]
            out[scenario] = (d, log)
        return out[scenario]

    return run


def load(d, rank):
    with open(os.path.join(d, f"fr_trace_rank_{rank}"), "rb") as f:
        return pickle.load(f)  # our own job's dump


def calls(d, rank):
    """(group name, desc, seq, op) of each recorded call of a rank, oldest first."""
    return [(e["process_group"][0], e["process_group"][1], e["collective_seq_id"],
             e["profiling_name"].split(":")[-1]) for e in load(d, rank)["entries"]]


def postmortem(*args):
    assert os.path.exists(BIN), f"{BIN} not built (set LOSSGUARD_BIN)"
    p = subprocess.run([BIN, "postmortem", *map(str, args), "--json", "-"], capture_output=True,
                       text=True, timeout=120)
    doc = json.loads(p.stdout) if p.stdout.strip().startswith("{") else None
    return p.returncode, doc, p.stderr


def postmortem_text(*args):
    p = subprocess.run([BIN, "postmortem", *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    return p.stdout + p.stderr


def names(text, ranks):
    """Does the text name this run of ranks (0-3, 0–3, 0..3, 0, 1, 2, 3)?"""
    lo, hi = ranks[0], ranks[-1]
    forms = [f"{lo}-{hi}", f"{lo}\u2013{hi}", f"{lo}..{hi}", ", ".join(map(str, ranks)),
             ",".join(map(str, ranks))]
    return any(re.search(r"(?<![0-9])" + re.escape(f) + r"(?![0-9])", text) for f in forms)


def frame_names(node):
    """Every frame name anywhere in a JSON document."""
    if isinstance(node, dict):
        if "name" in node and ("filename" in node or "line" in node):
            yield node["name"]
        for v in node.values():
            yield from frame_names(v)
    elif isinstance(node, list):
        for v in node:
            yield from frame_names(v)


def copy_without(src, dst, ranks):
    dst.mkdir()
    for f in os.listdir(src):
        if f.startswith("fr_trace_rank_") and int(f.rsplit("_", 1)[1]) not in ranks:
            shutil.copy(os.path.join(src, f), dst / f)
    return dst


def test_dp_skip_blames_the_rank_that_skipped(jobs):
    # Rank 5 skips its DP gradient all-reduce in step 3. DP [5,7]: 7 waits in DP #3 for 5; 5 went
    # straight on to the token count #3 on DP_WITH_CP [5,7] and waits there for 7. Every other rank
    # waits on 5 or 7 (1 for 5's flag on [1,5], 3 for 7's on [3,7], 0 and 4 in the grad norm on
    # [0,1,4,5], 2 and 6 on [2,3,6,7]). 5 and 7 wait on each other, but only 5 left the step's order
    # (its count #3 came without its gradient #3; 7's calls are the step's, in order): culprit 5.
    d, _ = jobs("dp-skip")
    assert calls(d, 5)[-1] == ("7", "DATA_PARALLEL_GROUP_WITH_CP", 3, "all_reduce")
    assert [c[2] for c in calls(d, 5) if c[0] == "15"] == [1, 2]
    assert calls(d, 7)[-1] == ("15", "DATA_PARALLEL_GROUP", 3, "all_reduce")
    for args in ((), WORLD8, LAYOUT):
        rc, doc, err = postmortem(d, *args)
        assert rc == 3, (args, err)
        root = doc["root"]
        assert root["culprits"] == [5], (args, root)
        assert root["kind"] != "cycle", (args, root)
        assert 5 in doc["ranks"]["culprit"] and doc["ranks"]["missing"] == []
        dv = doc["divergences"][0]
        assert dv["kind"] == "missing_call", (args, dv)
        assert (dv["group"], dv["group_desc"], dv["seq"]) == ("15", "DATA_PARALLEL_GROUP", 3)
        assert dv["call"]["op"] == "all_reduce" and dv["call"]["input_sizes"] == [[256]]
        assert (dv["issued"], dv["not_issued"]) == ([7], [5])


def test_opposite_orders_are_a_cycle(jobs):
    # At the end of step 3, 5 reduces a metric on DATA_PARALLEL_GROUP_GLOO [5,7] ('16', its first
    # call) then on DATA_PARALLEL_GROUP_WITH_CP_GLOO [5,7] ('8', its first); 7 the other way round.
    # Neither group was used before, so neither order is the step's: 5 waits in '16' #1 for 7, 7
    # waits in '8' #1 for 5, and the other six wait in the world barrier #3 for both.
    d, _ = jobs("wait-cycle")
    assert calls(d, 5)[-1] == ("16", "DATA_PARALLEL_GROUP_GLOO", 1, "all_reduce")
    assert calls(d, 7)[-1] == ("8", "DATA_PARALLEL_GROUP_WITH_CP_GLOO", 1, "all_reduce")
    for r in (0, 1, 2, 3, 4, 6):
        assert calls(d, r)[-1] == ("0", "default_pg", 3, "barrier")
    # The twins' other member is in no dump (each was called by one rank only): Megatron's layout
    # gives it, from --world 8 (the one layout of 8 ranks that fits the groups seen) or the layout.
    for args in (WORLD8, LAYOUT):
        rc, doc, err = postmortem(d, *args)
        assert rc == 3, (args, err)
        root = doc["root"]
        assert root["kind"] == "cycle", (args, root)
        assert sorted(root["culprits"]) == [5, 7], (args, root)
        cyc = {c["rank"]: c for c in root["cycle"]}
        assert sorted(cyc) == [5, 7], root["cycle"]
        assert (cyc[5]["group"], cyc[5]["group_desc"], cyc[5]["seq"], cyc[5]["waits_for"]) == \
            ("16", "DATA_PARALLEL_GROUP_GLOO", 1, [7])
        assert (cyc[7]["group"], cyc[7]["group_desc"], cyc[7]["seq"], cyc[7]["waits_for"]) == \
            ("8", "DATA_PARALLEL_GROUP_WITH_CP_GLOO", 1, [5])
    # Without them the twins' members are unknown, but 5 and 7 are still inside a call that never
    # returned (they timed out in it): not idle ranks that "completed everything".
    rc, doc, err = postmortem(d)
    assert rc == 3, err
    assert sorted(doc["root"]["culprits"]) == [5, 7], doc["root"]
    assert doc["root"]["kind"] != "idle_rank", doc["root"]


def test_a_rank_gloo_aborted_before_it_dumped_is_the_root(jobs):
    # Rank 5 all-reduces a 64 x float64 bucket (512 bytes) on DP [5,7] where 7 brings 256 floats
    # (1024 bytes; the same byte count would pass silently). Gloo's ring sends each rank the other's
    # chunks: 5 receives a 256-byte chunk into a 128-byte one and Gloo's transport thread throws
    # (pair.cc: "op.preamble.length <= op.nbytes. 256 vs 128") -> std::terminate -> SIGABRT on rank
    # 5, before it can dump. 7 only receives shorter chunks, which Gloo accepts; it then sees the
    # connection reset, and the others time out, all dumping. The rank without a dump is the one
    # that sent the wrong bucket: 5.
    d, log = jobs("abort-before-dump", no_dump=(5,))
    assert re.search(r"exitcode: -6\) local_rank: 5\b", log), log[-4000:]
    assert "Received data size doesn't match expected size" in log
    assert calls(d, 7)[-1] == ("15", "DATA_PARALLEL_GROUP", 3, "all_reduce")
    for args in (WORLD8, LAYOUT):
        rc, doc, err = postmortem(d, *args)
        assert rc == 3, (args, err)
        assert doc["world"] == 8 and doc["world_known"], args
        assert doc["ranks"]["missing"] == [5], (args, doc["ranks"])
        root = doc["root"]
        assert root["kind"] == "missing_dump", (args, root)
        assert root["culprits"] == [5], (args, root)
        assert any(5 in dv.get("no_dump", []) for dv in doc["divergences"]), args


def test_wrapped_ring_buffers_still_name_the_culprit(jobs):
    # 10 steps, a 16-entry ring buffer (a step is 6 or 7 entries): every rank's oldest calls are
    # gone. Rank 6 skips its DP gradient all-reduce in step 10: DP [4,6] ('13'), 4 waits in #10 for
    # 6, 6 went on to the count #10 on DP_WITH_CP [4,6] ('5') and waits there for 4. As dp-skip:
    # culprit 6.
    d, _ = jobs("wrapped", buffer=16)
    for r in ALL8:
        dump = load(d, r)
        assert len(dump["entries"]) == 16 and dump["entries"][0]["record_id"] > 16, r
    assert calls(d, 6)[-1] == ("5", "DATA_PARALLEL_GROUP_WITH_CP", 10, "all_reduce")
    assert calls(d, 4)[-1] == ("13", "DATA_PARALLEL_GROUP", 10, "all_reduce")
    for args in ((), LAYOUT):
        rc, doc, err = postmortem(d, *args)
        assert rc == 3, (args, err)
        root = doc["root"]
        assert root["culprits"] == [6], (args, root)
        assert root["kind"] != "cycle", (args, root)
        dv = doc["divergences"][0]
        assert (dv["group"], dv["group_desc"], dv["seq"]) == ("13", "DATA_PARALLEL_GROUP", 10)
        assert (dv["issued"], dv["not_issued"]) == ([4], [6])


def test_a_count_over_the_world_is_still_named(jobs):
    # TP1 PP1 DP4: the token count all-reduced over the WORLD ('0', #1; the same members as
    # DP_WITH_CP here), then the flag broadcast with src = PP-1 = 0 over one-rank pipeline groups:
    # 1-3 raise ("rank 0 is not part of group") after completing the count; 0 broadcasts to itself,
    # steps, and waits in the world barrier #2. Divergence: barrier #2 on the world, issued [0],
    # not issued [1,2,3] (idle: nothing recorded after the count). The seed's pr285-always-broadcast.
    d, _ = jobs("world-count", nproc=4)
    assert calls(d, 0)[-1] == ("0", "default_pg", 2, "barrier")
    for r in (1, 2, 3):
        assert calls(d, r)[-1] == ("0", "default_pg", 1, "all_reduce")
    for args in ((), ("--world", 4)):
        rc, doc, err = postmortem(d, *args)
        assert rc == 3, (args, err)
        dv = doc["divergences"][0]
        assert (dv["group"], dv["seq"], dv["call"]["op"]) == ("0", 2, "barrier"), dv
        assert (dv["issued"], dv["not_issued"]) == ([0], [1, 2, 3])
        root = doc["root"]
        assert root["kind"] == "idle_rank" and root["culprits"] == [1, 2, 3], (args, root)
        assert doc["protocol_matches"], (args, doc.get("notes"))
        assert doc["protocol_matches"][0]["protocol"] == "pr285-always-broadcast", args
        assert doc["named"] is True, args


def test_groups_without_desc_with_the_layout(jobs):
    # dp-skip on rank 5 with no group_desc and groups created pipeline, tensor, model, data with
    # CP, data: DATA_PARALLEL_GROUP [5,7] is '18', DP_WITH_CP [5,7] '14'. As dp-skip: culprit 5,
    # divergence: '18' #3, issued [7], not issued [5].
    d, _ = jobs("no-desc")
    assert calls(d, 5)[-1] == ("14", "undefined", 3, "all_reduce")
    assert calls(d, 7)[-1] == ("18", "undefined", 3, "all_reduce")
    rc, doc, err = postmortem(d, *LAYOUT)
    assert rc == 3, err
    root = doc["root"]
    assert root["culprits"] == [5], root
    assert root["kind"] != "cycle", root
    dv = doc["divergences"][0]
    assert (dv["group"], dv["seq"], dv["issued"], dv["not_issued"]) == ("18", 3, [7], [5])


def test_a_call_only_one_stage_makes(jobs):
    # slime's advantage-whitening shape: after step 3's barrier (world #3) the last stage (4-7)
    # all-reduces its advantages' statistics on the WORLD (#4) in whiten_advantages; stage 0
    # (0-3) completed every call and waits for a rollout outside collectives. Divergence: world #4,
    # issued [4,5,6,7], not issued [0,1,2,3]. Either side may be the wrong one (4-7 should not
    # reduce over the world, or 0-3 should have joined): two readings.
    d, _ = jobs("stage-only-call")
    for r in (4, 5, 6, 7):
        assert calls(d, r)[-1] == ("0", "default_pg", 4, "all_reduce")
        assert "whiten_advantages" in [f["name"] for f in load(d, r)["entries"][-1]["frames"]]
    for r in (0, 1, 2, 3):
        assert calls(d, r)[-1] == ("0", "default_pg", 3, "barrier")
    rc, doc, err = postmortem(d)
    assert rc == 3, err
    dv = doc["divergences"][0]
    assert (dv["group"], dv["seq"], dv["call"]["op"]) == ("0", 4, "all_reduce"), dv
    assert (dv["issued"], dv["not_issued"]) == ([4, 5, 6, 7], [0, 1, 2, 3])
    root = doc["root"]
    assert root["kind"] == "idle_rank" and root["culprits"] == [0, 1, 2, 3], root
    assert len(root["readings"]) == 2, root
    assert names(root["summary"], [0, 1, 2, 3]) and names(root["summary"], [4, 5, 6, 7]), root
    shown = "whiten_advantages" in set(frame_names(doc)) or \
        "whiten_advantages" in postmortem_text(d)
    assert shown, "the issuing call's frames (whiten_advantages) are not reported"


def test_clean_and_missing_dumps_never_exit_0_unverified(jobs, tmp_path):
    d, _ = jobs("clean")
    # Gloo's recorder lists no default group: the world is not in the dumps.
    assert all("0" not in load(d, r)["pg_config"] for r in ALL8)
    rc, doc, err = postmortem(d, *WORLD8)
    assert rc == 0, err
    assert doc["divergences"] == [] and doc["ranks"]["complete"] == ALL8
    assert (doc["world"], doc["world_known"], doc["world_source"]) == (8, True, "--world")
    rc, doc, err = postmortem(d, *LAYOUT)
    assert rc == 0, err
    assert (doc["world"], doc["world_source"]) == (8, "layout")
    # nothing says how large the world is: no divergence, but nothing verified
    rc, doc, err = postmortem(d)
    assert rc == 4, err
    assert doc["world_known"] is False and doc["world_source"] is None
    # the top two ranks' dumps gone
    cut = copy_without(d, tmp_path / "clean-6-7", (6, 7))
    rc, doc, err = postmortem(cut)
    assert rc == 4, err
    rc, doc, err = postmortem(cut, *WORLD8)
    assert rc == 4, err
    assert doc["ranks"]["missing"] == [6, 7]
    rc, doc, err = postmortem(cut, *LAYOUT)
    assert rc == 4, err
    assert doc["ranks"]["missing"] == [6, 7]
    # a hung job's top two dumps gone: never "every group matched"
    hung, _ = jobs("dp-skip")
    cut = copy_without(hung, tmp_path / "dp-skip-6-7", (6, 7))
    for args in ((), WORLD8, LAYOUT):
        rc, doc, err = postmortem(cut, *args)
        assert rc in (3, 4), (args, rc, err)


def test_megatron_core_parallel_state(jobs):
    # megatron.core.parallel_state.initialize_model_parallel(tp=2, pp=2) on a gloo world of 8 (its
    # *_GLOO twins, CP, embedding and expert groups too), dp-skip on rank 5 with
    # get_data_parallel_group(): as dp-skip, culprit 5; DATA_PARALLEL_GROUP #3 issued [7], not [5].
    py = megatron_python()
    if py is None:
        pytest.skip("megatron-core is not installed: scripts/setup-trainers.sh megatron "
                    "(~/.cache/lossguard/venv-megatron, or set LOSSGUARD_MEGATRON_VENV)")
    d, _ = jobs("megatron-core", python=py)
    assert calls(d, 5)[-1][1:] == ("DATA_PARALLEL_GROUP_WITH_CP", 3, "all_reduce")
    assert calls(d, 7)[-1][1:] == ("DATA_PARALLEL_GROUP", 3, "all_reduce")
    for args in ((), WORLD8):
        rc, doc, err = postmortem(d, *args)
        assert rc == 3, (args, err)
        root = doc["root"]
        assert root["culprits"] == [5], (args, root)
        assert root["kind"] != "cycle", (args, root)
        dv = doc["divergences"][0]
        assert (dv["group_desc"], dv["seq"]) == ("DATA_PARALLEL_GROUP", 3), dv
        assert (dv["issued"], dv["not_issued"]) == ([7], [5])
