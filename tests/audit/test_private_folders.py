"""Captures in per-rank private folders reach the auditing rank over the job's own process group (issue #53:
a multi-node job whose output folder is node-local). Four real processes (Gloo, DP 2 x CP 2), each holding only
its own capture of a correct step (written by the recorder, tests/audit/test_audit_gate.py's write_step), call
lossguard_capture.audit.share_captures as every adapter's audit does; rank 0's folder then holds all four and
`lossguard audit` passes it — before the sharing it is exit 2, ranks missing. On a shared folder nothing but the
names is sent.

    LOSSGUARD_BIN=build/cli/lossguard ~/.cache/lossguard/venv/bin/python -m pytest -q tests/audit/test_private_folders.py
"""
import json
import os
import shutil
import sys
import time
from datetime import timedelta

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
import lossguard_capture as lc  # noqa: E402
from lossguard_cli import audit  # noqa: E402
from test_audit_gate import STATIC, write_step  # noqa: E402

WORLD = 4


def _worker(rank, world, init, good, root, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    name = f"step000000-rank{rank:05d}.safetensors"
    # 1. private folders: rank r holds only its own file
    mine = os.path.join(root, f"node{rank}", "step000000")
    os.makedirs(mine)
    shutil.copy(os.path.join(good, name), mine)
    dist.barrier()
    before = audit(mine)[0] if rank == 0 else None
    got = lc.audit.share_captures("private", os.path.join(mine, name), mine, timeout=60)
    # 2. one shared folder: every file is there already, nothing is sent
    shared = lc.audit.share_captures("shared", os.path.join(good, name), good, timeout=60)
    # 3. a rank that arrives after rank 0 stopped waiting (2 s) is answered at once, never held for the
    #    timeout by a question rank 0 did not ask (it used to wait the whole timeout, and a slow store reply
    #    made any rank look absent: its agree() then came a timeout late)
    store = lc.audit._default_store()
    if rank == WORLD - 1:          # arrives only once rank 0 has given up on it and returned
        store.wait(["test/late-done"], timedelta(seconds=60))
    t0 = time.monotonic()
    late = lc.audit.share_captures("late", os.path.join(mine, name), os.path.join(root, "late"), timeout=2)
    held = time.monotonic() - t0
    if rank == 0:
        store.set("test/late-done", "1")
    with open(os.path.join(out, f"share-{rank}.json"), "w") as f:
        json.dump({"before": before, "received": [os.path.basename(p) for p in got],
                   "shared": shared, "files": sorted(os.listdir(mine)), "late": len(late), "held": held}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_captures_in_private_folders_are_audited_on_rank_0(tmp_path):
    good = tmp_path / "good"
    write_step(str(good), 2, 2, STATIC)
    assert audit(good)[0] == 0
    root, out = tmp_path / "nodes", tmp_path / "out"
    out.mkdir()
    mp.spawn(_worker, args=(WORLD, f"file://{tmp_path}/pg", str(good), str(root), str(out)), nprocs=WORLD,
             join=True)
    r = [json.load(open(out / f"share-{k}.json")) for k in range(WORLD)]
    assert r[0]["before"] == 2                                   # three ranks missing: captures do not fit
    assert r[0]["received"] == [f"step000000-rank{k:05d}.safetensors" for k in range(1, WORLD)]
    assert r[0]["files"] == sorted(f"step000000-rank{k:05d}.safetensors" for k in range(WORLD))
    assert all(x["received"] == [] and x["files"] == [f"step000000-rank{k:05d}.safetensors"]
               for k, x in enumerate(r) if k > 0)
    assert all(x["shared"] == [] for x in r)                    # a shared folder: names only
    assert r[0]["late"] == WORLD - 2 and r[WORLD - 1]["held"] < 1.0, r  # the late rank: not asked, not held
    code, doc, err = audit(root / "node0" / "step000000")
    assert code == 0, (doc, err)
    assert len(doc["steps"][0]["ranks"]) == WORLD and doc["steps"][0]["diagnosis"]["kind"] == "exact"
