#!/usr/bin/env python3
"""Checks the user-facing Markdown (README.md, docs/*.md, python/README.md) for damage an edit can do
without any build noticing: a paragraph pasted twice (one commit once inserted the same paragraph
between every character of the README, 32 MB), a file grown past any plausible size, and a relative
link to a file that is not in the repository.

usage: docs_check.py REPO_ROOT [FILE ...]   (files default to the repository's Markdown)
       docs_check.py --self-test              (shows the check rejecting each kind of damage)
Exit 0 when clean; 1 with one line per problem, naming the file and line."""
import pathlib
import re
import sys

MAX_BYTES = 200_000  # the README is ~48 KB; four times that is an accident, not a document
MIN_PARAGRAPH = 120  # shorter repeats (table rows, "See above.") are normal


def paragraphs(text):
    """(first line number, paragraph text) of each blank-line-separated block outside code fences."""
    out, block, start, fenced = [], [], 0, False
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line.strip() == "" or line.startswith("|"):
            if block:
                out.append((start, " ".join(block)))
            block = []
            continue
        if not block:
            start = n
        block.append(line.strip())
    if block:
        out.append((start, " ".join(block)))
    return out


def check(root, path):
    problems = []
    data = path.read_bytes()
    rel = path.relative_to(root)
    if len(data) > MAX_BYTES:
        problems.append(f"{rel}: {len(data):,} bytes, over the {MAX_BYTES:,} a document of this repository can be")
    text = data.decode("utf-8", errors="replace")
    seen = {}
    for line, para in paragraphs(text):
        if len(para) < MIN_PARAGRAPH:
            continue
        if para in seen:
            problems.append(f"{rel}:{line}: the paragraph of line {seen[para]} again: {para[:70]}...")
            if len(problems) > 20:
                break
        else:
            seen[para] = line
    for n, line in enumerate(text.split("\n"), 1):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            if not (path.parent / target).exists():
                problems.append(f"{rel}:{n}: link to {target}, which is not in the repository")
    return problems


def self_test():
    import tempfile
    para = "A paragraph long enough to count: " + "the effective weight of each token's loss " * 3
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        (root / "here.md").write_text("x")
        good = root / "good.md"
        good.write_text(f"# Title\n\n{para}\n\n[ok](here.md) [web](https://x.org/a) [anchor](#t)\n")
        assert check(root, good) == [], check(root, good)
        bad = root / "bad.md"
        bad.write_text(f"{para}\n\nshort\n\n{para}\n\n[gone](missing.md)\n")
        got = check(root, bad)
        assert len(got) == 2 and got[0].startswith("bad.md:5: the paragraph of line 1 again"), got
        assert got[1] == "bad.md:7: link to missing.md, which is not in the repository", got
        big = root / "big.md"
        big.write_text("word " * (MAX_BYTES // 5 + 1))
        got = check(root, big)
        assert len(got) == 1 and "over the 200,000" in got[0], got
    print("docs_check self-test: duplicate paragraph, missing link and size each rejected")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = pathlib.Path(sys.argv[1]).resolve()
    files = [pathlib.Path(f).resolve() for f in sys.argv[2:]] or (
        [root / "README.md", root / "python" / "README.md"] + sorted((root / "docs").glob("*.md")))
    problems = [p for f in files for p in check(root, f)]
    for p in problems:
        print(p)
    print(f"docs_check: {len(files)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
