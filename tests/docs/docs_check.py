#!/usr/bin/env python3
"""Checks the user-facing Markdown (every tracked *.md: README.md, docs/, docs/adapters/, python/README.md)
for damage an edit can do without any build noticing: a paragraph pasted twice (one commit once inserted
the same paragraph between every character of the README, 32 MB), a file grown past any plausible size, a
relative link to a file that is not in the repository or to a heading that is not in its page, a path of
this repository named in prose (`python/README.md`, `io/flat_pickle.cpp:120`, in backticks or bare) that is
not there, a page of docs/ (or python/README.md) that the one index, docs/README.md, does not link, a front
page (the top-level README.md) grown past 200 lines, and a `lossguard <command> --option` shown in the
front page's code blocks that the binary does not have.

usage: docs_check.py REPO_ROOT [--binary LOSSGUARD] [FILE ...]   (files default to the repository's Markdown,
                                                                  and then the index is checked too)
       docs_check.py --self-test              (shows the check rejecting each kind of damage)
The commands are checked against `LOSSGUARD --help` and `LOSSGUARD <command> --help`; without --binary,
$LOSSGUARD_BIN or REPO_ROOT/build/cli/lossguard is used, and when there is none the commands are reported
as not checked (the rest still runs).
Exit 0 when clean; 1 with one line per problem, naming the file and line."""
import os
import pathlib
import re
import shlex
import subprocess
import sys

MAX_BYTES = 200_000  # the largest page is ~45 KB; four times that is an accident, not a document
MIN_PARAGRAPH = 120  # shorter repeats (table rows, "See above.") are normal
MAX_FRONT_LINES = 200  # the front page: what lossguard is, the two commands, one example per use; the rest is docs/


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


def shown_commands(text):
    """(line number, [tokens after `lossguard`]) of each lossguard command in the code blocks of a Markdown
    text. A block with `$ ` prompts is a session: only its prompt lines are commands, the rest is output.
    Python blocks are code, not commands. Lines ending in a backslash continue; a command ends at a pipe,
    `&&`, `||`, `;`, a redirection or a comment."""
    blocks, block, lang, fenced = [], [], "", False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            if fenced:
                blocks.append((lang, block))
            else:
                lang, block = line.lstrip()[3:].strip().lower(), []
            fenced = not fenced
        elif fenced:
            block.append((n, line))
    out = []
    for lang, lines in blocks:
        if lang in ("python", "py", "pycon", "json", "toml", "yaml"):
            continue
        session = any(line.lstrip().startswith("$ ") for _, line in lines)
        logical, start = "", None
        for n, line in lines:
            if not logical:
                if session and not line.lstrip().startswith("$ "):
                    continue
                start = n
            logical += line.rstrip()
            if logical.endswith("\\"):
                logical = logical[:-1] + " "
                continue
            cmd, logical = logical, ""
            words = shell_words(cmd)
            at = [i for i, w in enumerate(words) if w == "lossguard" or w.endswith("/lossguard")]
            if not at:
                continue
            args = []
            for w in words[at[0] + 1:]:
                if re.fullmatch(r"[();<>|&]+", w):
                    break  # the end of the command: a pipe, &&, ;, a redirection
                args.append(w)
            if args:
                out.append((start, args))
    return out


def shell_words(line):
    """A shell line's words, comments dropped, operators (`|`, `&&`, `;`, `>`) as words of their own."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote: good enough to find the options
        return line.split("#")[0].split()


def help_options(help_text):
    """The long options a CLI11 help text lists (`  --name ...` or `  -h,--help`), and its subcommands."""
    options = set(re.findall(r"^  (?:-\w,)?(--[A-Za-z0-9][\w-]*)", help_text, re.M))
    subcommands, in_sub = set(), False
    for line in help_text.split("\n"):
        if re.match(r"^\S.*:$", line) or not line.strip():
            in_sub = line.startswith("Subcommands:")
            continue
        m = re.match(r"^  ([a-z][\w-]*)\b", line)
        if in_sub and m:
            subcommands.add(m.group(1))
    return options, subcommands


def check_commands(rel, text, binary):
    """Each `lossguard <command> [--option ...]` in the code blocks: the command exists and so does every
    option, as `binary <command> --help` lists them."""
    problems, helps = [], {}

    def help_of(*words):
        if words not in helps:
            run = subprocess.run([str(binary), *words, "--help"], capture_output=True, text=True, timeout=60)
            helps[words] = help_options(run.stdout) if run.returncode == 0 else None
        return helps[words]

    top = help_of()
    if top is None:
        return [f"{rel}: `{binary} --help` failed: the commands shown cannot be checked"]
    for line, args in shown_commands(text):
        command = args[0]
        if command.startswith("<"):
            continue  # a placeholder: `lossguard <command> --help`
        if command.startswith("-"):
            known, where = top[0], "lossguard"
            rest = args
        elif command not in top[1]:
            problems.append(f"{rel}:{line}: `lossguard {command}`: no such command (commands: "
                            f"{', '.join(sorted(top[1]))})")
            continue
        else:
            sub = help_of(command)
            if sub is None:
                problems.append(f"{rel}:{line}: `lossguard {command} --help` failed")
                continue
            known, where, rest = sub[0], f"lossguard {command}", args[1:]
        for word in rest:
            m = re.match(r"^(--[A-Za-z0-9][\w-]*)", word)
            if m and m.group(1) not in known:
                problems.append(f"{rel}:{line}: `{where}` has no option {m.group(1)} ({where} --help)")
    return problems


def find_binary(root, given):
    """The binary the commands are checked against: the one given (or None when it is not executable),
    else $LOSSGUARD_BIN, else the default build's."""
    for cand in ([given] if given else [os.environ.get("LOSSGUARD_BIN"), root / "build" / "cli" / "lossguard"]):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return pathlib.Path(cand)
    return None


def repo_layout(root):
    """{top-level folder: the file extensions it holds} of the repository (git's files, else the tree's)."""
    try:
        names = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    layout = {}
    for name in names:
        parts = name.split("/")
        if len(parts) > 1:
            layout.setdefault(parts[0], set()).add(pathlib.PurePath(name).suffix)
    return layout


BARE_PATH = re.compile(r"(?<![\w/.~-])([A-Za-z_][\w.+-]*/[\w./+-]*\.[A-Za-z]\w*)(?::\d+(?:[-,]\d+)*)?")


def named_paths(text):
    """(line, path) of each path the prose names: an inline code span that is a path (`dir/file.ext`,
    optionally `:LINE` or `:A-B`), or a bare `dir/file.ext` outside code spans and link targets (the link
    targets are checked as links). Fenced and indented code is commands and output, not checked here."""
    out, fenced = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("*", "-", "|")):
            continue
        for span in re.findall(r"`([^`\s]+)`", line):
            m = re.fullmatch(r"([A-Za-z_][\w.+-]*/[\w./+-]*?)(?::\d+(?:[-,]\d+)*)?", span)
            if m:
                out.append((n, m.group(1).rstrip("/")))
        prose = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", " ", line))
        out += [(n, m.group(1)) for m in BARE_PATH.finditer(prose)]
    return out


def slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    """The anchors of a Markdown text's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    out, fenced = set(), False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            name, k = slug(m.group(1)), 1
            while name in out:
                name, k = f"{slug(m.group(1))}-{k}", k + 1
            out.add(name)
    return out


def check_index(root, index="docs/README.md"):
    """The one index: every page under docs/ (templates aside) and python/README.md is linked from it."""
    index_path = root / index
    if not index_path.exists():
        return []
    linked = {(index_path.parent / t).resolve()
              for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", index_path.read_text(encoding="utf-8"))}
    pages = [p for p in sorted((root / "docs").rglob("*.md")) if ".template." not in p.name and p != index_path]
    pages += [p for p in [root / "python" / "README.md"] if p.exists()]
    return [f"{index}: does not link {p.relative_to(root)} (the one index links every page)"
            for p in pages if p.resolve() not in linked]


def markdown_files(root):
    """Every Markdown file of the repository (git's list, new files not ignored included; else the tree's,
    build folders aside), the front page first."""
    try:
        names = subprocess.run(["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard",
                                "*.md"], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*.md")
                 if not any(part.startswith((".", "build")) for part in p.relative_to(root).parts)]
    files = sorted(root / n for n in names if (root / n).is_file())
    return sorted(files, key=lambda p: p != root / "README.md")


def check_paths(rel, text, root, layout):
    """A named path whose first folder is one of this repository's, with an extension that folder holds (a
    `.py` under `trainer/` is verl's, not ours) and no placeholder (`cmd_NAME.cpp`), must exist."""
    problems = []
    for n, p in named_paths(text):
        top = p.split("/")[0]
        if top not in layout or re.search(r"[A-Z]{3,}", p) or pathlib.PurePath(p).suffix not in layout[top]:
            continue
        if not (root / p).exists():
            problems.append(f"{rel}:{n}: names {p}, which is not in the repository")
    return problems


def check(root, path, binary=None, layout=None):
    """Problems of one Markdown file. The front page (REPO_ROOT/README.md) also gets its length and, with a
    binary, its commands checked."""
    problems = []
    data = path.read_bytes()
    rel = path.relative_to(root)
    if len(data) > MAX_BYTES:
        problems.append(f"{rel}: {len(data):,} bytes, over the {MAX_BYTES:,} a document of this repository can be")
    text = data.decode("utf-8", errors="replace")
    front = path == root / "README.md"
    if front:
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines > MAX_FRONT_LINES:
            problems.append(f"{rel}: {lines} lines, over the {MAX_FRONT_LINES} of the front page "
                            "(move the detail into docs/ and link it)")
        if binary is not None:
            problems += check_commands(rel, text, binary)
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
        for target, frag in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", line):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            dest = path.parent / target if target else path
            if not dest.exists():
                problems.append(f"{rel}:{n}: link to {target}, which is not in the repository")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{rel}:{n}: link to {target or rel.name}#{frag}, a heading that page does "
                                "not have")
    problems += check_paths(rel, text, root, layout if layout is not None else repo_layout(root))
    return problems


FAKE_HELP = {  # what the self-test's stand-in binary prints, in CLI11's layout
    "": "Usage: lossguard [OPTIONS] [SUBCOMMAND]\n\nOptions:\n  -h,--help   Print this help\n"
        "  --version   Print the version\n\nSubcommands:\n  count       Token counts\n"
        "  replay      Replay the skip decision\n\nExit codes: 0 pass\n  notacommand here\n",
    "count": "Usage: lossguard count [OPTIONS] dumps...\n\nOptions:\n  -h,--help   Print\n"
             "  --cp INT=[1,2,4,8] ...\n                 CP sizes, e.g. --cpp is not an option\n"
             "  --json FILE|-   JSON report\n\nExamples:\n  lossguard count x --policy legacy\n",
    "replay": "Usage: lossguard replay [OPTIONS] dumps...\n\nOptions:\n  -h,--help   Print\n"
              "  --tp INT=1   TP\n  --backend TEXT=sim   sim, gloo or nccl\n",
}


def self_test():
    import tempfile
    para = "A paragraph long enough to count: " + "the effective weight of each token's loss " * 3
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        (root / "here.md").write_text("x")
        good = root / "good.md"
        good.write_text(f"# Title\n\n{para}\n\n[ok](here.md) [web](https://x.org/a) [anchor](#title)\n")
        assert check(root, good) == [], check(root, good)
        bad = root / "bad.md"
        bad.write_text(f"{para}\n\nshort\n\n{para}\n\n[gone](missing.md)\n")
        got = check(root, bad)
        assert len(got) == 2 and got[0].startswith("bad.md:5: the paragraph of line 1 again"), got
        assert got[1] == "bad.md:7: link to missing.md, which is not in the repository", got
        (root / "io").mkdir()
        (root / "io" / "pickle.cpp").write_text("x")
        paths = root / "paths.md"
        paths.write_text("`io/pickle.cpp:12` and `io/pickle.cpp` are here; `io/gone.cpp:3-4` moved away;\n"
                         "`io/setup.py` is another project's (io/ holds no .py); `io/cmd_NAME.cpp` a pattern;\n"
                         "`elsewhere/x.cpp` not our folder.\n```\n`io/gone.cpp` in a fence\n```\n")
        got = check(root, paths)
        assert got == ["paths.md:1: names io/gone.cpp, which is not in the repository"], got
        # Bare paths in prose too; not in link targets (checked as links), code spans or indented code.
        paths.write_text("Named bare: io/pickle.cpp:12 is here, io/moved.cpp:3 is not, nor (io/old.cpp).\n"
                         "[io/pickle.cpp](io/pickle.cpp); elsewhere/x.cpp and io/setup.py are not ours.\n"
                         "    io/indented.cpp is code\n")
        got = check(root, paths)
        assert got == ["paths.md:1: names io/moved.cpp, which is not in the repository",
                       "paths.md:1: names io/old.cpp, which is not in the repository"], got
        # A link's #anchor: a heading of the page it points to (GitHub's slugs), or of this page.
        (root / "page.md").write_text("# A page\n\n## The trainer adapters: one entry\n\n## Tests\n\n"
                                      "```\n# not a heading\n```\n")
        links = root / "links.md"
        links.write_text("## `Capture`: the API\n\n[ok](page.md#the-trainer-adapters-one-entry) [ok](page.md#tests)"
                         " [ok](#capture-the-api)\n[gone](page.md#supported-releases) [gone](#api)"
                         " [fenced](page.md#not-a-heading)\n")
        got = check(root, links)
        assert got == ["links.md:4: link to page.md#supported-releases, a heading that page does not have",
                       "links.md:4: link to links.md#api, a heading that page does not have",
                       "links.md:4: link to page.md#not-a-heading, a heading that page does not have"], got
        # The one index links every page of docs/ (a subfolder's too, templates aside) and python/README.md.
        (root / "docs" / "adapters").mkdir(parents=True)
        (root / "python").mkdir()
        for name in ("docs/a.md", "docs/adapters/hf.md", "docs/g.template.md", "python/README.md"):
            (root / name).write_text("x\n")
        (root / "docs" / "README.md").write_text("[a](a.md) [python](../python/README.md#x)\n")
        got = check_index(root)
        assert got == ["docs/README.md: does not link docs/adapters/hf.md (the one index links every page)"], got
        (root / "docs" / "README.md").write_text("[a](a.md) [hf](adapters/hf.md) [python](../python/README.md)\n")
        assert check_index(root) == [], check_index(root)
        assert root / "docs" / "adapters" / "hf.md" in markdown_files(root), markdown_files(root)
        big = root / "big.md"
        big.write_text("word " * (MAX_BYTES // 5 + 1))
        got = check(root, big)
        assert len(got) == 1 and "over the 200,000" in got[0], got

        # The front page: at most MAX_FRONT_LINES lines (other pages may be longer).
        front = root / "README.md"
        front.write_text("line\n" * MAX_FRONT_LINES)
        assert check(root, front) == [], check(root, front)
        front.write_text("line\n" * (MAX_FRONT_LINES + 1))
        got = check(root, front)
        assert got == [f"README.md: {MAX_FRONT_LINES + 1} lines, over the {MAX_FRONT_LINES} of the front page "
                       "(move the detail into docs/ and link it)"], got
        (root / "long.md").write_text("line\n" * (MAX_FRONT_LINES + 1))
        assert check(root, root / "long.md") == []

        # The front page's commands, against a stand-in binary's --help.
        fake = root / "fake-lossguard"
        fake.write_text(f"#!{sys.executable}\nimport sys\nHELP = {FAKE_HELP!r}\n"
                        "args = [a for a in sys.argv[1:] if a != '--help']\n"
                        "text = HELP.get(' '.join(args))\n"
                        "sys.stdout.write(text or 'unknown command\\n')\nsys.exit(0 if text else 2)\n")
        fake.chmod(0o755)
        fence = "`" * 3
        front.write_text(
            f"# t\n\n{fence}sh\n"
            "lossguard count d.safetensors --cp 1,2 --json out.json | tail -3 --lines   # not --bogus\n"
            "torchrun --standalone --nproc-per-node 4 --no-python build/cli/lossguard replay d \\\n"
            "    --tp 2 --backend gloo 2>&1 --nope\n"
            "lossguard --version && echo lossguard: done\n"
            "lossguard <command> --help\n"
            "make demo   # builds, and runs lossguard on the examples\n"
            f"{fence}\n\n{fence}\n$ lossguard count d --cp 2\nlossguard frobnicate --output-lines-are-not-run\n{fence}\n\n"
            f"{fence}python\nlossguard_capture.hf.attach(trainer, 'captures')\nrun('lossguard nosuch --x')\n{fence}\n"
            "\nProse may say lossguard whatever --it-likes.\n")
        got = check(root, front, binary=fake)
        assert got == [], got
        front.write_text(
            f"# t\n\n{fence}\n"
            "lossguard cuont d\n"                                   # line 4: no such command
            "lossguard count d --cpp 2 --json=x.json\n"             # line 5: --cpp (said only in a description)
            "torchrun --nproc-per-node 2 lossguard replay d \\\n"   # line 6, continued:
            "    --tp 2 --backen gloo\n"                            # --backen
            "lossguard --verbose\n"                                 # line 8: no top-level --verbose
            "lossguard notacommand\n"                               # line 9: not under Subcommands
            f"{fence}\n")
        got = check(root, front, binary=fake)
        want = ["README.md:4: `lossguard cuont`: no such command (commands: count, replay)",
                "README.md:5: `lossguard count` has no option --cpp (lossguard count --help)",
                "README.md:6: `lossguard replay` has no option --backen (lossguard replay --help)",
                "README.md:8: `lossguard` has no option --verbose (lossguard --help)",
                "README.md:9: `lossguard notacommand`: no such command (commands: count, replay)"]
        assert got == want, got
        (root / "broken").write_text("#!/bin/sh\nexit 1\n")
        (root / "broken").chmod(0o755)
        got = check(root, front, binary=root / "broken")
        assert len(got) == 1 and "--help` failed" in got[0], got
    print("docs_check self-test: duplicate paragraph, missing link, a link to a missing heading, a stale named "
          f"path (in backticks or bare), a page the index misses, size, a front page over {MAX_FRONT_LINES} "
          "lines, and an unknown command or option in its code blocks each rejected")
    return 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    given = None
    if "--binary" in argv:
        i = argv.index("--binary")
        if i + 1 >= len(argv):
            print("docs_check: --binary needs the path of the lossguard binary")
            return 2
        given = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if not argv:
        print(__doc__)
        return 2
    root = pathlib.Path(argv[0]).resolve()
    files = [pathlib.Path(f).resolve() for f in argv[1:]] or markdown_files(root)
    binary = find_binary(root, given)
    problems = []
    if given and binary is None:
        problems.append(f"--binary {given}: not an executable file")
    layout = repo_layout(root)
    problems += [p for f in files for p in check(root, f, binary, layout)]
    if not argv[1:]:
        problems += check_index(root)
    for p in problems:
        print(p)
    commands = (f"README commands checked against {binary}" if binary else
                "README commands NOT checked: no lossguard binary (--binary, $LOSSGUARD_BIN or build/cli/lossguard)")
    print(f"docs_check: {len(files)} files, {len(problems)} problems; {commands}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
