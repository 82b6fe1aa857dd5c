r"""Hostile Flight Recorder dump sets for `lossguard postmortem`: each shape is a directory of dumps
(one per rank, the rank the number the file name ends in) that a correct reader must refuse (exit 2
naming the file) or handle in bounded time and memory. The pickles are written here byte by byte
(protocol 2 opcodes, struct only): nothing of lossguard's and nothing of Python's pickler, so a
shape is exactly the bytes described, memo references included.

  python3 hostile_dumps.py OUT            every shape, OUT/<shape>/...
  python3 hostile_dumps.py --seeds OUT    the small ones flattened, as fuzz seeds (tests/fuzz)

Shapes (the functions below; each returns the set's directory and the files that carry the hostile
part):
  memo-bomb-lists      an entry's `frames` is 9 nested levels of lists of 10 memo refs to one list
                       (10^9 leaves when walked as a tree): malformed (frames are dicts), refused
  memo-bomb-dicts      `frames` is 10 refs to one frame dict whose 10 extra keys refer to one frame
                       dict ... 9 levels: every frame well-formed, 10^9 frame dicts as a tree
  memo-cycle-lists     `frames` is a list that holds itself: refused
  memo-cycle-dicts     a frame dict that holds itself under an extra key
  seq-gap-2p40         collective_seq_id 1 on rank 0, 2^40 on rank 1, one group
  seq-gap-int64max     1 and 9223372036854775807
  seq-gap-2p62         1 and 2^62
  seq-gap-int64-span   -2^63 on rank 0 and 2^63-1 on rank 1 (their difference overflows int64)
  seq-gap-2p64         1 and 2^64 (beyond int64)
  seq-gap-one-rank     each rank holds 1 and 2^62, as consecutive records
  sparse-1g-zeros      a rank's dump is 1 GiB of zeros (sparse: no disk)
  sparse-1g-pickle     1 GiB starting as a pickle (0x80 0x02 '}') then zeros
  claimed-world-16m    pg_config's default group "0" is "[16777215]" while ranks 0, 1 call on it
  claimed-world-ellipsis   "[0, 1, ..., 16777215]" (a count given in few bytes: the only way; pickle
                       has no repetition opcode a plain-data reader accepts)
  claimed-world-2p40   "[0, 1, 1099511627775]"
  claimed-world-bigint ranks a list [0, 1, 2^64]
  claimed-world-16m-members   "[0, 1, 16777215]": 0 and 1 are members, 16777213 ranks left no dump
  escapes              frame names, filenames, group name and description holding \x1b[2J,
                       \x1b]0;title\x07, "\nDIVERGENCE: rank 0 ..." and \r, in a set with one real
                       divergence (rank 0 issued all_reduce #2 on the group, rank 1 never did);
                       the group is in pg_config with ranks "[0, 1]"
  escapes-profiling-name   profiling_name holding escapes and a forged line after a ':'
  escapes-op           an op name holding escapes and a forged line (no ':' after it)
  escapes-file-name    a truncated dump whose file name holds escapes and a forged line: refused
  invalid-utf8         a frame name that is not UTF-8 (BINUNICODE bytes ff fe)
  escapes-json         the escapes shape as JSON dumps (rank_<r>.json)
  json-deep            a JSON dump whose entry's frames nest 500,000 lists (1 MB): refused
  entries-memo-200k    both ranks: 200,000 entries, all one memo'd entry dict (~400 KB each)
"""

import json
import os
import struct
import sys

# A frame and an entry as torch 2.15's recorder writes them (version "2.10").
FRAME = {"name": "train_step", "filename": "/job/train.py", "line": 42}
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def entry(seq=1, group=("0", "default_pg"), frames=None, record_id=0,
          profiling_name="gloo:all_reduce"):
    return {
        "record_id": record_id,
        "pg_id": 0,
        "process_group": tuple(group),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": 1,
        "profiling_name": profiling_name,
        "time_created_ns": 1796452194297986934,
        "input_sizes": [[1]],
        "input_dtypes": ["Float"],
        "output_sizes": [[1]],
        "output_dtypes": ["Float"],
        "state": "scheduled",
        "retired": True,
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [dict(FRAME)] if frames is None else frames,
    }


def dump(entries, ranks="[0, 1]"):
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
        "comm_lib_version": "",
        "entries": entries,
    }


# ---------------------------------------------------------------------------------------------
# A protocol-2 pickle writer over plain values and the hostile nodes below. It memoizes only where
# a node asks (BINPUT/BINGET with fresh keys), so every shared reference is one written on purpose.

class Bytes:
    """A str whose BINUNICODE payload is these raw bytes (not necessarily UTF-8)."""

    def __init__(self, raw):
        self.raw = raw


class MemoBomb:
    """`levels` nested containers of `fan` references each to one container of the level below.
    kind "lists": [L8, L8, ...] with L8 = [L7, ...], ..., L0 = "leaf" (fan^levels leaves).
    kind "dicts": a list of `fan` refs to a frame dict D(levels-1); D(k) is FRAME's fields plus
    keys c0..c(fan-1) all referring to D(k-1); D(0) is FRAME (fan^levels frame dicts as a tree)."""

    def __init__(self, kind, levels=9, fan=10):
        self.kind, self.levels, self.fan = kind, levels, fan


class Cycle:
    """kind "lists": a list that holds itself. kind "dicts": a list of one frame dict that holds
    itself under the key "self"."""

    def __init__(self, kind):
        self.kind = kind


class Repeated:
    """A list of `n` references to one memo'd `value` (written once, then BINGET)."""

    def __init__(self, value, n):
        self.value, self.n = value, n


BATCH = 1000  # items per APPENDS / SETITEMS, as Python's pickler batches them


class Writer:
    def __init__(self):
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.next_memo = 0

    def put(self):
        k = self.next_memo
        self.next_memo += 1
        self.out += struct.pack("<BB", 0x71, k) if k < 256 else b"r" + struct.pack("<I", k)
        return k

    def get(self, k):
        self.out += struct.pack("<BB", 0x68, k) if k < 256 else b"j" + struct.pack("<I", k)

    def str_(self, raw):
        self.out += b"X" + struct.pack("<I", len(raw)) + raw

    def int_(self, v):
        if 0 <= v < 256:
            self.out += struct.pack("<cB", b"K", v)
        elif 0 <= v < 65536:
            self.out += struct.pack("<cH", b"M", v)
        elif -(2**31) <= v < 2**31:
            self.out += struct.pack("<ci", b"J", v)
        else:  # LONG1: minimal little-endian two's complement, as pickle.encode_long
            n = (v.bit_length() >> 3) + 1
            b = v.to_bytes(n, "little", signed=True)
            if v < 0 and n > 1 and b[-1] == 0xFF and b[-2] & 0x80:
                b = b[:-1]
            self.out += struct.pack("<BB", 0x8A, len(b)) + b

    def items(self, seq, close):
        """MARK item... close, in batches (APPENDS 'e' / SETITEMS 'u')."""
        for i in range(0, len(seq), BATCH):
            self.out += b"("
            for x in seq[i:i + BATCH]:
                if close == b"u":
                    self.value(x[0])
                    self.value(x[1])
                else:
                    self.value(x)
            self.out += close

    def value(self, v):
        if v is None:
            self.out += b"N"
        elif v is True or v is False:
            self.out += b"\x88" if v else b"\x89"
        elif isinstance(v, int):
            self.int_(v)
        elif isinstance(v, str):
            self.str_(v.encode("utf-8"))
        elif isinstance(v, Bytes):
            self.str_(v.raw)
        elif isinstance(v, list):
            self.out += b"]"
            self.items(v, b"e")
        elif isinstance(v, tuple):
            if len(v) == 0:
                self.out += b")"
            elif len(v) <= 3:
                for x in v:
                    self.value(x)
                self.out += bytes([0x84 + len(v)])  # TUPLE1..3
            else:
                self.out += b"("
                for x in v:
                    self.value(x)
                self.out += b"t"
        elif isinstance(v, dict):
            self.out += b"}"
            self.items(list(v.items()), b"u")
        elif isinstance(v, MemoBomb):
            self.bomb(v)
        elif isinstance(v, Cycle):
            self.cycle(v)
        elif isinstance(v, Repeated):
            self.out += b"]"
            done = 0
            while done < v.n:
                self.out += b"("
                stop = min(v.n, done + BATCH)
                if done == 0:
                    self.value(v.value)
                    key = self.put()
                    done = 1
                for _ in range(done, stop):
                    self.get(key)
                done = stop
                self.out += b"e"
        else:
            raise TypeError(type(v))

    # As Python's pickler writes a shared container: the empty container, BINPUT, MARK, its items
    # (the first reference to the level below written in full, the others BINGET), APPENDS or
    # SETITEMS. Every container is complete before it is referenced again.
    def bomb(self, b):
        if b.kind == "lists":
            def level(k):
                if k == 0:
                    self.str_(b"leaf")
                    return self.put()
                self.out += b"]"
                key = self.put()
                self.out += b"("
                inner = level(k - 1)
                for _ in range(b.fan - 1):
                    self.get(inner)
                self.out += b"e"
                return key
            level(b.levels)
        elif b.kind == "dicts":
            def frame(k):
                self.out += b"}"
                key = self.put()
                self.out += b"("
                for f, x in FRAME.items():
                    self.value(f)
                    self.value(x)
                if k > 0:
                    inner = None
                    for c in range(b.fan):
                        self.value(f"c{c}")
                        if inner is None:
                            inner = frame(k - 1)
                        else:
                            self.get(inner)
                self.out += b"u"
                return key
            self.out += b"]"
            self.out += b"("
            top = frame(b.levels - 1)
            for _ in range(b.fan - 1):
                self.get(top)
            self.out += b"e"
        else:
            raise ValueError(b.kind)

    def cycle(self, c):
        if c.kind == "lists":  # L = [L]
            self.out += b"]"
            key = self.put()
            self.get(key)
            self.out += b"a"  # APPEND
        elif c.kind == "dicts":  # [F], F = {**FRAME, "self": F}
            self.out += b"]"
            self.out += b"("
            self.out += b"}"
            key = self.put()
            self.out += b"("
            for f, x in FRAME.items():
                self.value(f)
                self.value(x)
            self.value("self")
            self.get(key)
            self.out += b"u"
            self.out += b"e"
        else:
            raise ValueError(c.kind)

    def finish(self):
        return bytes(self.out + b".")


def pickle_bytes(value):
    w = Writer()
    w.value(value)
    return w.finish()


# ---------------------------------------------------------------------------------------------
# The shapes. Each writes its set under `root/<name>` and returns (directory, hostile basenames).

def _write(d, files):
    os.makedirs(d, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    return d


def _rank(r):
    return f"fr_trace_rank_{r}"


def _pair(root, name, hostile0, rank1=None):
    """Rank 0's hostile dump beside rank 1's plain one (the same call)."""
    d = _write(os.path.join(root, name), {
        _rank(0): pickle_bytes(hostile0),
        _rank(1): pickle_bytes(rank1 if rank1 is not None else dump([entry()])),
    })
    return d, [_rank(0)]


def memo_bomb_lists(root):
    return _pair(root, "memo-bomb-lists", dump([entry(frames=MemoBomb("lists"))]))


def memo_bomb_dicts(root):
    return _pair(root, "memo-bomb-dicts", dump([entry(frames=MemoBomb("dicts"))]))


def memo_cycle_lists(root):
    return _pair(root, "memo-cycle-lists", dump([entry(frames=Cycle("lists"))]))


def memo_cycle_dicts(root):
    return _pair(root, "memo-cycle-dicts", dump([entry(frames=Cycle("dicts"))]))


def _seq_gap(root, name, seq0, seq1):
    d = _write(os.path.join(root, name), {
        _rank(0): pickle_bytes(dump([entry(seq=seq0)])),
        _rank(1): pickle_bytes(dump([entry(seq=seq1)])),
    })
    return d, [_rank(0), _rank(1)]


def seq_gap_2p40(root):
    return _seq_gap(root, "seq-gap-2p40", 1, 2**40)


def seq_gap_int64max(root):
    return _seq_gap(root, "seq-gap-int64max", 1, INT64_MAX)


def seq_gap_2p62(root):
    return _seq_gap(root, "seq-gap-2p62", 1, 2**62)


def seq_gap_int64_span(root):
    return _seq_gap(root, "seq-gap-int64-span", INT64_MIN, INT64_MAX)


def seq_gap_2p64(root):
    return _seq_gap(root, "seq-gap-2p64", 1, 2**64)


def seq_gap_one_rank(root):
    both = pickle_bytes(dump([entry(seq=1, record_id=0), entry(seq=2**62, record_id=1)]))
    d = _write(os.path.join(root, "seq-gap-one-rank"), {_rank(0): both, _rank(1): both})
    return d, [_rank(0), _rank(1)]


GIB = 1 << 30


def _sparse(root, name, head):
    d = _write(os.path.join(root, name), {_rank(0): pickle_bytes(dump([entry()]))})
    with open(os.path.join(d, _rank(1)), "wb") as f:
        f.write(head)
        f.truncate(GIB)  # a hole: no disk
    return d, [_rank(1)]


def sparse_1g_zeros(root):
    return _sparse(root, "sparse-1g-zeros", b"")


def sparse_1g_pickle(root):
    return _sparse(root, "sparse-1g-pickle", b"\x80\x02}")


def _claimed(root, name, ranks):
    both = pickle_bytes(dump([entry()], ranks=ranks))
    d = _write(os.path.join(root, name), {_rank(0): both, _rank(1): both})
    return d, [_rank(0), _rank(1)]


def claimed_world_16m(root):
    return _claimed(root, "claimed-world-16m", "[16777215]")


def claimed_world_ellipsis(root):
    return _claimed(root, "claimed-world-ellipsis", "[0, 1, ..., 16777215]")


def claimed_world_2p40(root):
    return _claimed(root, "claimed-world-2p40", "[0, 1, 1099511627775]")


def claimed_world_bigint(root):
    return _claimed(root, "claimed-world-bigint", [0, 1, 2**64])


def claimed_world_16m_members(root):
    return _claimed(root, "claimed-world-16m-members", "[0, 1, 16777215]")


# The text of the escapes shape. Every forged line is one a terminal would show as postmortem's own.
ESC_GROUP = ("\x1b[2J\x1b]0;pwned-title\x07grp-ESCNAME\r",
             "desc-ESCDESC\nDIVERGENCE: rank 7 forged in the group's description\x1b[31m")
ESC_FRAMES_1 = [
    {"name": "step-ESCFRAME1\x1b[2J\x1b[H", "filename": "/job/\x1b]0;title\x07train-ESCFILE1.py",
     "line": 10},
    {"name": "main-ESCFRAME2\nDIVERGENCE: rank 0 issued all_reduce #9 on 0; rank 1 never did "
             "(forged)",
     "filename": "/job/run-ESCFILE2.py\rDIVERGENCE: rank 1 forged after a CR", "line": 20},
]
ESC_FRAMES_2 = [
    {"name": "wait-ESCFRAME3\r\x1b[K", "filename": "/job/\x1b[1A\x1b[2Kwait-ESCFILE3.py\n"
     "DIVERGENCE: forged in a filename", "line": 30},
]
ESC_MARKERS = ["ESCNAME", "ESCDESC", "ESCFRAME1", "ESCFRAME2", "ESCFILE1", "ESCFILE2"]


def _escapes_docs():
    g = ESC_GROUP

    def d(entries):  # the group listed in pg_config (as NCCL's dumps do): its members are known
        x = dump(entries)
        x["pg_config"][g[0]] = {"name": g[0], "desc": g[1], "ranks": "[0, 1]"}
        return x

    return (d([entry(seq=1, group=g, frames=ESC_FRAMES_1, record_id=0),
               entry(seq=2, group=g, frames=ESC_FRAMES_2, record_id=1)]),
            d([entry(seq=1, group=g, frames=ESC_FRAMES_1, record_id=0)]))


def escapes(root):
    r0, r1 = _escapes_docs()
    d = _write(os.path.join(root, "escapes"),
               {_rank(0): pickle_bytes(r0), _rank(1): pickle_bytes(r1)})
    return d, [_rank(0), _rank(1)]


ESC_PROFILING_NAME = "gloo\x1b[2J\x1b]0;title\x07:all_reduce\r\nDIVERGENCE: rank 0 forged"
# No ':' after the op and a space before the forged text: '<backend>:<op> <meta>' splits it into an
# op holding the escapes, which a reader may take as an op it does not know.
ESC_OP = "gloo:all_reduce\x1b[2J\x1b]0;title\x07\r\nDIVERGENCE forged-op line"
ESC_FILE_NAME = "fr\x1b[2J\x1b]0;title\x07\r\nDIVERGENCE: forged_trace_rank_1"


def forged_lines():
    """The lines the escapes shapes forge (the text after a CR or LF that begins with DIVERGENCE): a
    terminal must never show one at the start of a line."""
    texts = [*ESC_GROUP, ESC_PROFILING_NAME, ESC_OP, ESC_FILE_NAME]
    texts += [f[k] for f in ESC_FRAMES_1 + ESC_FRAMES_2 for k in ("name", "filename")]
    out = set()
    for t in texts:
        for piece in t.replace("\r", "\n").split("\n")[1:]:
            if piece.startswith("DIVERGENCE"):  # up to the next control character
                out.add(piece[:next((k for k, c in enumerate(piece) if c < " "), len(piece))])
    return sorted(out)


def escapes_profiling_name(root):
    return _pair(root, "escapes-profiling-name", dump([entry(profiling_name=ESC_PROFILING_NAME)]))


def escapes_op(root):
    return _pair(root, "escapes-op", dump([entry(profiling_name=ESC_OP)]))


def escapes_file_name(root):
    good = pickle_bytes(dump([entry()]))
    d = _write(os.path.join(root, "escapes-file-name"), {
        _rank(0): good,
        ESC_FILE_NAME: good[: len(good) // 3],  # truncated: refused, and named
    })
    return d, [ESC_FILE_NAME]


def invalid_utf8(root):
    g = ("0", "default_pg")
    frames = [{"name": Bytes(b"bad-\xff\xfe-name"), "filename": Bytes(b"/job/\xc3(.py"),
               "line": 1}]
    r0 = dump([entry(seq=1, group=g, record_id=0),
               entry(seq=2, group=g, frames=frames, record_id=1)])
    r1 = dump([entry(seq=1, group=g, frames=frames, record_id=0)])
    d = _write(os.path.join(root, "invalid-utf8"),
               {_rank(0): pickle_bytes(r0), _rank(1): pickle_bytes(r1)})
    return d, [_rank(0), _rank(1)]


def escapes_json(root):
    """The escapes shape as the JSON of _dump_fr_trace_json (its strings' control characters
    written \\u001b, \\r, \\n by json.dumps)."""
    docs = {f"rank_{r}.json": json.dumps(x).encode() for r, x in enumerate(_escapes_docs())}
    return _write(os.path.join(root, "escapes-json"), docs), sorted(docs)


def _json_deep(root, name, depth):
    """rank 0: JSON whose entry's `frames` nests `depth` lists (2 bytes a level); rank 1 plain."""
    head = json.dumps(dump([entry(frames=[])]))
    assert head.count('"frames": []') == 1
    body = head.replace('"frames": []', '"frames": ' + "[" * depth + "]" * depth)
    d = _write(os.path.join(root, name), {
        "rank_0.json": body.encode(),
        "rank_1.json": json.dumps(dump([entry()])).encode(),
    })
    return d, ["rank_0.json"]


def json_deep(root):
    return _json_deep(root, "json-deep", 500_000)


def json_deep_30k(root):  # the fuzz seed's size
    return _json_deep(root, "json-deep-30k", 30_000)


def _entries_memo(root, name, n):
    both = pickle_bytes(dump(Repeated(entry(), n)))
    d = _write(os.path.join(root, name), {_rank(0): both, _rank(1): both})
    return d, [_rank(0), _rank(1)]


def entries_memo_200k(root):
    return _entries_memo(root, "entries-memo-200k", 200_000)


def entries_memo_20k(root):  # the fuzz seed's size (libFuzzer's -max_len is 65536)
    return _entries_memo(root, "entries-memo-20k", 20_000)


SHAPES = {
    f.__name__.replace("_", "-"): f
    for f in [memo_bomb_lists, memo_bomb_dicts, memo_cycle_lists, memo_cycle_dicts,
              seq_gap_2p40, seq_gap_int64max, seq_gap_2p62, seq_gap_int64_span, seq_gap_2p64,
              seq_gap_one_rank, sparse_1g_zeros, sparse_1g_pickle,
              claimed_world_16m, claimed_world_ellipsis, claimed_world_2p40, claimed_world_bigint,
              claimed_world_16m_members, escapes, escapes_profiling_name, escapes_op,
              escapes_file_name,
              invalid_utf8, escapes_json, json_deep, entries_memo_200k]
}
# Fuzz seeds: the shapes of few bytes (not the sparse GiB, not the 400 KB entry lists, which
# libFuzzer's -max_len would cut), plus the 20k-entry list that fits.
SEED_SHAPES = [n for n in SHAPES if n.split("-")[0] not in ("sparse", "entries", "json")] + [
    "entries-memo-20k", "json-deep-30k"]
MAX_SEED_BYTES = 65536


def write_all(root):
    return {name: f(root) for name, f in SHAPES.items()}


def write_seeds(out):
    """Every small shape's files, flattened to out/hostile-<shape>-<file> (names made safe)."""
    import tempfile
    os.makedirs(out, exist_ok=True)
    written, seen = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for name in SEED_SHAPES:
            f = SHAPES.get(name) or globals()[name.replace("-", "_")]
            d, _ = f(tmp)
            for base in sorted(os.listdir(d)):
                p = os.path.join(d, base)
                if os.path.getsize(p) > MAX_SEED_BYTES:
                    raise SystemExit(f"{name}/{base!r}: {os.path.getsize(p)} bytes: too big a seed")
                with open(p, "rb") as src:
                    data = src.read()
                if data in seen:
                    continue
                seen.add(data)
                safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)
                dst = os.path.join(out, f"hostile-{name}-{safe}")
                with open(dst, "wb") as w:
                    w.write(data)
                written.append(dst)
    return written


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--seeds"] and len(args) == 2:
        write_seeds(args[1])
    elif len(args) == 1:
        for name, (d, hostile) in write_all(args[0]).items():
            print(name, d, *map(ascii, hostile))
    else:
        raise SystemExit(__doc__)
