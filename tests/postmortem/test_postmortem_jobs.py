"""`lossguard postmortem` on REAL Flight Recorder dumps: torchrun jobs over Gloo (fr_job.py) that hang
the ways SPEC §7's participation protocols do, each rank dumping from its own error or timeout path.
The expected divergence of each job is worked out here by hand from Megatron's layout
(rank = tp + TP*(cp + CP*(dp + DP*pp))) and the bug planted; the protocol named must be the one
planted. Bad dump sets made from the real dumps exit 2 naming the file.

  LOSSGUARD_BIN=build/cli/lossguard python -m pytest -q tests/postmortem
"""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("LOSSGUARD_BIN", os.path.join(HERE, "..", "..", "build", "cli", "lossguard"))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Runs each scenario once; returns scenario -> dump directory."""
    out = {}

    def run(scenario):
        if scenario not in out:
            d = tmp_path_factory.mktemp(scenario)
            env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000", OMP_NUM_THREADS="1",
                       TORCH_FR_DUMP_TEMP_FILE=str(d / "fr_trace_rank_"))
            p = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "4",
                                os.path.join(HERE, "fr_job.py"), "--scenario", scenario,
                                "--out", str(d), "--timeout", "4"],
                               env=env, capture_output=True, text=True, timeout=300)
            dumps = sorted(f for f in os.listdir(d) if f.startswith("fr_trace_rank_"))
            assert dumps == [f"fr_trace_rank_{r}" for r in range(4)], p.stdout + p.stderr
            out[scenario] = d
        return out[scenario]

    return run


def postmortem(*args):
    p = subprocess.run([BIN, "postmortem", *map(str, args), "--json", "-"], capture_output=True,
                       text=True, timeout=120)
    doc = json.loads(p.stdout) if p.stdout.strip().startswith("{") else None
    return p.returncode, doc, p.stderr


def group_desc(doc, name):
    return next(g for g in doc["groups"] if g["name"] == name)["desc"]


def test_seed_deadlock_pp1_broadcast(jobs):
    # DP4, PP1: the flag is broadcast with src = PP-1 = 0 over one-rank pipeline groups; ranks 1-3
    # raise ("rank 0 is not part of group"), rank 0 steps and waits in the next step's barrier.
    rc, doc, err = postmortem(jobs("seed-pp1-broadcast"))
    assert rc == 3, err
    res = doc
    d = res["divergences"][0]
    assert d["kind"] == "missing_call"
    assert d["group_desc"] == "default_pg" and d["call"]["op"] == "barrier"
    assert (d["issued"], d["not_issued"]) == ([0], [1, 2, 3])
    assert res["ranks"]["culprit"] == [1, 2, 3] and res["ranks"]["waiting"] == [0]
    for c in res["culprits"]:  # they died after the token count's all-reduce, which completed
        assert c["last_call"]["call"]["op"] == "all_reduce"
        assert c["last_call"]["issued_by_every_member"]
        assert c["last_call"]["timeout_ms"] == 4000  # the job's --timeout 4, on its subgroups
        assert group_desc(doc, c["last_call"]["group"]) == "DATA_PARALLEL_GROUP_WITH_CP"
        assert any(f["filename"].endswith("fr_job.py") for f in c["last_call"]["frames"])
    m = res["protocol_matches"][0]
    assert m["protocol"] == "pr285-always-broadcast"
    assert m["topology"]["pp"] == 1 and m["topology"]["tp"] == 1
    assert all(x["protocol"] != "pr285" for x in res["protocol_matches"])


def test_the_json_dumps_give_the_same_report(jobs):
    d = jobs("seed-pp1-broadcast")
    rc, doc, err = postmortem(d / "json")
    assert rc == 3, err
    assert {i["format"] for i in doc["inputs"]} == {"flight-recorder-json"}
    dv = doc["divergences"][0]
    assert (dv["issued"], dv["not_issued"]) == ([0], [1, 2, 3])
    assert doc["protocol_matches"][0]["protocol"] == "pr285-always-broadcast"


def test_group_local_src_at_pp2(jobs):
    # TP2 PP2: pipeline groups [0, 2], [1, 3]; src = PP-1 = 1 is not in [0, 2], so ranks 0 and 2
    # raise; ranks 1 and 3 broadcast on [1, 3] and wait in the optimizer's all-reduce over the
    # model-parallel group 0-3. Gloo's dumps list neither that group's members (only 1 and 3 call
    # it) nor the world: given the world, they are completed from Megatron's layout. At PP 2 the
    # seed's always-broadcast form issues the same calls, so both fit and neither is named.
    rc, doc, err = postmortem(jobs("src-local-pp2"), "--world", 4)
    assert rc == 3, err
    res = doc
    d = res["divergences"][0]
    assert d["group_desc"] == "MODEL_PARALLEL_GROUP"
    assert (d["issued"], d["not_issued"]) == ([1, 3], [0, 2])
    assert res["root"]["kind"] == "idle_rank" and res["root"]["culprits"] == [0, 2]
    mp = next(g for g in res["groups"] if g["name"] == d["group"])
    assert mp["members"] == "0-3" and mp["members_source"] == "layout"
    assert {m["protocol"] for m in res["protocol_matches"]} == {"pr285-src-local",
                                                                 "pr285-always-broadcast"}
    assert not res["named"]
    m = next(m for m in res["protocol_matches"] if m["protocol"] == "pr285-src-local")
    assert (m["topology"]["tp"], m["topology"]["pp"]) == (2, 2)
    # Without the world, the group's members are unknown, and Gloo retired the call that timed
    # out on rank 3: nothing shows who is short, so nothing is verified — never a pass.
    rc, doc, err = postmortem(jobs("src-local-pp2"))
    assert rc == 4, err
    assert doc["world_known"] is False and "--world" in doc["unverified_reason"]


def test_decision_from_a_rank_local_count(jobs):
    # DP4: rank 2's micro-batch holds no effective token and it skips its backward on its own
    # count, so its token count meets the others' gradient bucket in one all-reduce.
    rc, doc, err = postmortem(jobs("local-count"))
    assert rc == 3, err
    d = doc["divergences"][0]
    assert d["kind"] == "mismatch" and d["group_desc"] == "DATA_PARALLEL_GROUP_WITH_CP"
    assert [v["ranks"] for v in d["variants"]] == [[0, 1, 3], [2]]
    assert [v["call"]["input_dtypes"] for v in d["variants"]] == [["Double"], ["Long"]]
    assert doc["protocol_matches"][0]["protocol"] == "microbatch-skip-local"


def test_a_rank_that_skips_the_optimizer(jobs):
    # TP2 DP2: model-parallel groups [0, 1], [2, 3]; DP+CP groups [0, 2], [1, 3]. Rank 1's NaN
    # reaches rank 3 through the gradient all-reduce; both skip optimizer.step() on their own
    # check, so 0 and 2 wait in the grad-norm all-reduce while 1 and 3 wait in the barrier.
    rc, doc, err = postmortem(jobs("skip-optimizer"))
    assert rc == 3, err
    res = doc
    shapes = {(group_desc(doc, d["group"]), tuple(d["issued"]), tuple(d["not_issued"]))
              for d in res["divergences"]}
    assert shapes == {("MODEL_PARALLEL_GROUP", (0,), (1,)), ("MODEL_PARALLEL_GROUP", (2,), (3,)),
                      ("default_pg", (1, 3), (0, 2))}
    assert res["protocol_matches"][0]["protocol"] == "nan-skip-local"


def test_a_clean_job_has_no_divergence(jobs):
    # Gloo's dumps state neither the world nor the subgroups' members: given the layout, every
    # group is known and every member present, so it passes; without it, nothing is verified.
    rc, doc, err = postmortem(jobs("clean"), "--tp", 2, "--pp", 2)
    assert rc == 0, err
    res = doc
    assert res["divergences"] == [] and res["ranks"]["complete"] == [0, 1, 2, 3]
    assert res["total_calls"] > 0 and res["world_source"] == "layout"
    assert all(g["members_source"] != "calls" for g in res["groups"])
    rc, doc, err = postmortem(jobs("clean"))
    assert rc == 4, err
    assert "--world" in doc["unverified_reason"]


def test_bad_dump_sets_exit_2_naming_the_file(jobs, tmp_path):
    src = jobs("clean")
    real = [src / f"fr_trace_rank_{r}" for r in range(4)]

    def fresh(name):
        d = tmp_path / name
        d.mkdir()
        for f in real:
            shutil.copy(f, d / f.name)
        return d

    # truncated
    d = fresh("truncated")
    data = (d / "fr_trace_rank_2").read_bytes()
    (d / "fr_trace_rank_2").write_bytes(data[: len(data) // 3])
    rc, _, err = postmortem(d)
    assert rc == 2 and "fr_trace_rank_2" in err, err
    # hostile: a pickle whose loading would run a shell command
    d = fresh("hostile")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (d / "fr_trace_rank_3").write_bytes(pickle.dumps(Evil(), protocol=2))
    rc, _, err = postmortem(d)
    assert rc == 2 and "fr_trace_rank_3" in err and "os" in err, err
    assert not marker.exists()
    # mixed versions: one dump re-written as an older torch would have
    d = fresh("mixed")
    with open(real[1], "rb") as f:
        dump = pickle.load(f)  # our own job's dump
    dump["version"] = "2.9"
    (d / "fr_trace_rank_1").write_bytes(pickle.dumps(dump, protocol=2))
    rc, _, err = postmortem(d)
    assert rc == 2 and "fr_trace_rank_1 (version 2.9)" in err, err
    # two files for one rank
    d = fresh("duplicated")
    shutil.copy(real[1], d / "copy_of_rank_1")
    rc, _, err = postmortem(d)
    assert rc == 2 and "copy_of_rank_1" in err and "fr_trace_rank_1" in err, err
    # a missing rank is reported, not guessed, and the job is not passed
    d = fresh("missing")
    os.remove(d / "fr_trace_rank_1")
    rc, doc, err = postmortem(d, "--world", 4)
    assert rc == 4, err
    assert doc["ranks"]["missing"] == [1]
    assert doc["ranks"]["complete"] == [0, 2, 3]
    assert "rank 1" in doc["unverified_reason"]
    # the top rank's dump deleted, the world not given: never green either
    d = fresh("top_missing")
    os.remove(d / "fr_trace_rank_3")
    rc, doc, err = postmortem(d)
    assert rc == 4, err
