#!/usr/bin/env python3
"""The house rules CI enforces (docs/architecture.md), runnable by anyone:

    scripts/check-house.py [--includes] [--format] [--sizes] [--renderers] [--self-test]   (no flag: all)

--includes  every `#include "DIR/..."` of a project file follows the dependency rules (an arrow = may
            include): cli -> oracle, trainer, io, distributed, kernels, synth, core; oracle -> core;
            synth -> core; trainer -> kernels, core; kernels -> core; io -> core; distributed -> oracle, core; core -> core.
            Inside oracle/, the rooms every other room uses include no room above them: count -> count,
            math; math -> math.
            oracle/ never includes LibTorch, CUDA or NCCL headers; NCCL only in distributed/ (and
            kernels/device_info.cu). Exceptions are listed below with their reason.
--format    every tracked C++/CUDA file is as clang-format (.clang-format) writes it.
--sizes     a subcommand file (cli/cmd_*.cpp) has at most 170 lines; a function body of the product
            (not tests/, bench/) over 80 lines says why in a comment above it that contains "Long:";
            so does a Python function (def, methods and nested ones too; from the def line to its last
            line) of python/lossguard_capture/, in a `#` comment above its def (or its decorators).
--renderers a renderer (cli/*_render.cpp) only reads its command's result: it calls no oracle:: function but
            names and formatters (RENDER_CALLS_ALLOWED: *_name, *_description, format_*, *_phrase, *_json,
            *_text, describe, protocol_parts), nor brings one in unqualified (`using oracle::f;`,
            `using namespace oracle`), asks no verdict or sentence of a result (.failed(...), .fails(...),
            .finished(...), .summary(...), .status(...)) and looks nothing up (std::find, std::lower_bound, ...: a join of the result's
            parts belongs in the result): every verdict, ratio, sentence and join is decided once in the
            library, under the command's options.
--self-test plants a forbidden include (of a module and of a room), a misformatted line, a long C++ and a long Python function, an
            oversized subcommand file and a renderer that computes in a copy and checks each is caught.
Exit 0 when clean, 1 listing every violation as FILE:LINE: what.
"""
import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODULES = ("core", "oracle", "trainer", "kernels", "io", "distributed", "synth", "cli")
ALLOWED = {
    "core": {"core"},
    "oracle": {"oracle", "core"},
    "trainer": {"trainer", "kernels", "core"},
    "kernels": {"kernels", "core"},
    "io": {"io", "core"},
    "distributed": {"distributed", "oracle", "core"},
    "synth": {"synth", "core"},
    "cli": {"cli", "oracle", "trainer", "io", "distributed", "kernels", "synth", "core"},
}
# Rooms inside a module (docs/architecture.md: "a room uses count/ and math/"): the floor rooms every
# other room may use include nothing above them. A room not listed is held to its module's rule only.
ROOM_ALLOWED = {
    "oracle/count": {"oracle/count", "oracle/math"},
    "oracle/math": {"oracle/math"},
}
# (file, included prefix): why the rule bends there.
EXCEPTIONS = {
    ("kernels/device_info.cu", "nccl"): "`--version` reports the NCCL version the build links (private "
                                        "to lossguard_kernels)",
}
FORBIDDEN_SYSTEM = {
    "oracle": ("torch/", "ATen/", "c10/", "cuda", "nccl"),
    "core": ("torch/", "ATen/", "c10/", "cuda_runtime", "nccl"),
    "io": ("cuda", "nccl"),
    "trainer": ("nccl",),
    "kernels": ("nccl",),
    "cli": ("nccl",),
}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def tracked(patterns, root):
    """The project's files matching `patterns`: git's list, or (a tree without .git) a walk that skips
    build folders."""
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=root, capture_output=True, text=True,
                             check=True)
        return [f for f in out.stdout.split() if f]
    except (OSError, subprocess.CalledProcessError):
        suffixes = tuple(p.lstrip("*") for p in patterns)
        found = []
        for d, subdirs, files in os.walk(root):
            subdirs[:] = [s for s in subdirs if not s.startswith((".", "build"))]
            found += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(suffixes)]
        return sorted(found)


def check_includes(root, files=None):
    problems = []
    for f in files or tracked(["*.h", "*.cpp", "*.cu", "*.cuh"], root):
        top = f.split("/", 1)[0]
        if top not in MODULES:
            continue
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                kind, path = m.groups()
                if kind == '"' and "/" in path:
                    dep = path.split("/", 1)[0]
                    room = "/".join(f.split("/", 2)[:2])
                    dep_room = "/".join(path.split("/", 2)[:2])
                    if room in ROOM_ALLOWED and dep == top and path.count("/") >= 2 \
                            and dep_room not in ROOM_ALLOWED[room] and (f, dep_room) not in EXCEPTIONS:
                        problems.append(f"{f}:{n}: {room}/ may not include {path} ({room} -> "
                                        f"{', '.join(sorted(ROOM_ALLOWED[room]))})")
                        continue
                    if dep in ALLOWED[top] or (f, dep) in EXCEPTIONS:
                        continue
                    if dep in MODULES or dep in ("tests", "bench"):
                        problems.append(f"{f}:{n}: {top}/ may not include {path} ({top} -> "
                                        f"{', '.join(sorted(ALLOWED[top]))})")
                elif kind == "<":
                    for bad in FORBIDDEN_SYSTEM.get(top, ()):
                        if (f, bad) in EXCEPTIONS:
                            continue
                        if path.startswith(bad) or path.split("/")[-1].startswith(bad):
                            problems.append(f"{f}:{n}: {top}/ may not include <{path}>")
    return problems


def check_format(root, files=None):
    exe = shutil.which("clang-format") or shutil.which("clang-format-14")
    if exe is None:
        return ["clang-format not found (scripts/setup.sh installs it)"]
    problems = []
    for f in files or tracked(["*.h", "*.cpp", "*.cu", "*.cuh"], root):
        r = subprocess.run([exe, "--dry-run", "--Werror", f], cwd=root, capture_output=True, text=True)
        if r.returncode != 0:
            first = next((l for l in r.stderr.splitlines() if "warning" in l or "error" in l), r.stderr.strip())
            problems.append(f"{first}  (fix: clang-format -i {f})")
    return problems


MAX_COMMAND_LINES = 170
MAX_FUNCTION_LINES = 80


def _strip_code(src):
    """The source with comments, strings and character literals blanked (line breaks kept)."""
    keep_lines = lambda m: "\n" * m.group(0).count("\n")
    src = re.sub(r'R"\((.*?)\)"', lambda m: '""' + keep_lines(m), src, flags=re.S)
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"/\*.*?\*/", keep_lines, src, flags=re.S)
    src = re.sub(r'"(\\.|[^"\\\n])*"', '""', src)
    return re.sub(r"'(\\.|[^'\\\n])'", "''", src)


def function_bodies(text):
    """(first line, last line) of every function body at namespace or class level, 1-based."""
    src = _strip_code(text)
    stack, bodies, line, last = [], [], 1, 0
    for i, ch in enumerate(src):
        if ch == "\n":
            line += 1
        elif ch == "{":
            head = src[last:i]
            kind = "block"
            if all(k in ("ns", "type") for k, _ in stack):
                if re.search(r"\bnamespace\b", head) or re.search(r'extern\s*""\s*$', head.strip()):
                    kind = "ns"
                elif re.search(r"\b(struct|class|enum|union)\b[^()]*$", head):
                    kind = "type"
                elif "(" in head and not head.strip().endswith("="):
                    kind = "fn"
            stack.append((kind, line))
            last = i + 1
        elif ch == "}":
            if stack:
                kind, start = stack.pop()
                if kind == "fn":
                    bodies.append((start, line))
            last = i + 1
        elif ch == ";":
            last = i + 1
    return bodies


def _reason_above(lines, brace_line):
    """Whether the comment block above the signature ending on `brace_line` contains "Long:"."""
    k = brace_line - 2  # 0-based index of the line above the brace's line
    while k >= 0 and lines[k].strip() and not lines[k].strip().startswith("//") \
            and not lines[k].rstrip().endswith((";", "}")):
        k -= 1  # the signature's earlier lines
    while k >= 0 and lines[k].strip().startswith("//"):
        if "Long:" in lines[k]:
            return True
        k -= 1
    return False


PY_PRODUCT = "python/lossguard_capture/"


def python_functions(text):
    """(name, first line, def line, last line) of every function of a Python source (methods and nested
    functions too), 1-based; the first line is its first decorator's, else the def's."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append((node.name, first, node.lineno, node.end_lineno))
    return sorted(found, key=lambda fn: fn[2])


def _py_reason_above(lines, first_line):
    """Whether the `#` comment block directly above line `first_line` (1-based) contains "Long:"."""
    k = first_line - 2
    while k >= 0 and lines[k].strip().startswith("#"):
        if "Long:" in lines[k]:
            return True
        k -= 1
    return False


def check_python_sizes(root, files=None):
    problems = []
    for f in files or tracked(["*.py"], root):
        if not (f.startswith(PY_PRODUCT) and f.endswith(".py")):
            continue
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            text = fh.read()
        lines = text.split("\n")
        for name, first, start, end in python_functions(text):
            length = end - start + 1
            if length > MAX_FUNCTION_LINES and not _py_reason_above(lines, first):
                problems.append(f"{f}:{start}: a function of {length} lines ({name}): split it along its seams, "
                                f"or say why not in a `#` comment above it containing \"Long:\"")
    return problems


def check_sizes(root, files=None):
    problems = []
    for f in files or tracked(["*.h", "*.cpp", "*.cu", "*.cuh"], root):
        if f.split("/", 1)[0] not in MODULES:
            continue
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            text = fh.read()
        lines = text.split("\n")
        n = len(lines) - (1 if text.endswith("\n") else 0)
        if re.match(r"cli/cmd_[a-z_]+\.cpp$", f) and n > MAX_COMMAND_LINES:
            problems.append(f"{f}: {n} lines: a subcommand file wires and renders in at most "
                            f"{MAX_COMMAND_LINES} (move rendering to cli/*_render.cpp, verdicts to oracle/)")
        for start, end in function_bodies(text):
            length = end - start + 1
            if length > MAX_FUNCTION_LINES and not _reason_above(lines, start):
                problems.append(f"{f}:{start}: a function of {length} lines: split it along its "
                                f"seams, or say why not in a comment above it containing \"Long:\"")
    return problems + check_python_sizes(root, files)


# What a renderer may call in oracle:: — names and formatters of what the result already holds.
RENDER_CALLS_ALLOWED = re.compile(
    r"^(\w+_name|\w+_description|format_\w+|\w+_phrase|\w+_json|\w+_text|describe|protocol_parts)$")
RENDER_CALL = re.compile(r"\boracle::([a-z_][a-z0-9_]*)\s*\(")
# `using oracle::f;` makes f(...) a call the rule above cannot see: held to the same list.
RENDER_USING = re.compile(r"\busing\s+(?:::)?(?:lossguard::)?oracle::([a-z_][a-z0-9_]*)\s*;")
RENDER_USING_NS = re.compile(r"\busing\s+namespace\s+(?:::)?(?:lossguard::)?oracle\b")
RENDER_VERDICT = re.compile(r"(?:\.|->)\s*(failed|fails|finished|summary|status)\s*\(")
RENDER_LOOKUP = re.compile(r"\bstd::(find|find_if|find_if_not|lower_bound|upper_bound|equal_range|binary_search|"
                           r"search)\s*\(")


def check_renderers(root, files=None):
    problems = []
    for f in files or tracked(["cli/*_render.cpp"], root):
        if not re.match(r"cli/\w+_render\.cpp$", f):
            continue
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            code = _strip_code(fh.read())
        for n, line in enumerate(code.split("\n"), 1):
            for m in RENDER_CALL.finditer(line):
                if not RENDER_CALLS_ALLOWED.match(m.group(1)):
                    problems.append(f"{f}:{n}: a renderer calls oracle::{m.group(1)}(): compute it in the library, "
                                    f"into the command's result, and read the field here")
            for m in RENDER_USING.finditer(line):
                if not RENDER_CALLS_ALLOWED.match(m.group(1)):
                    problems.append(f"{f}:{n}: a renderer brings in oracle::{m.group(1)} to call unqualified: compute "
                                    f"it in the library, into the command's result, and read the field here")
            if RENDER_USING_NS.search(line):
                problems.append(f"{f}:{n}: a renderer uses namespace oracle: name each oracle:: call, so that "
                                f"only names and formatters are called")
            for m in RENDER_VERDICT.finditer(line):
                problems.append(f"{f}:{n}: a renderer asks a verdict (.{m.group(1)}(...)): the library decides it "
                                f"(or writes the sentence) once under the options; read the result's field")
            for m in RENDER_LOOKUP.finditer(line):
                problems.append(f"{f}:{n}: a renderer looks something up (std::{m.group(1)}): join the result's "
                                f"parts in the library and read the field here")
    return problems


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "oracle"))
        bad = os.path.join(tmp, "oracle", "planted.cpp")
        with open(bad, "w") as fh:
            fh.write('#include "trainer/candidate.h"\n#include <torch/torch.h>\n\nint  f( ){return 1;}\n')
        shutil.copy(os.path.join(ROOT, ".clang-format"), tmp)
        os.makedirs(os.path.join(tmp, "cli"))
        body = "".join(f"  x += {k};\n" for k in range(85))
        with open(os.path.join(tmp, "oracle", "long.cpp"), "w") as fh:
            fh.write(f"int long_one(int x) {{\n{body}  return x;\n}}\n\n"
                     f"// Long: a planted reason.\nint long_two(int x)\n    const {{\n{body}  return x;\n}}\n")
        with open(os.path.join(tmp, "cli", "cmd_planted.cpp"), "w") as fh:
            fh.write("// planted\n" * 171)
        os.makedirs(os.path.join(tmp, PY_PRODUCT))
        py_body = "".join(f"        x += {k}\n" for k in range(85))
        with open(os.path.join(tmp, PY_PRODUCT, "long.py"), "w") as fh:   # caught: the method; not: the rest
            fh.write(f"class C:\n    @staticmethod\n    def long_one(x):\n{py_body}        return x\n\n"
                     f"    # Long: a planted reason.\n    @staticmethod\n    def long_two(x):\n{py_body}"
                     f"        return x\n\n\ndef short(x):\n    return x\n")
        with open(os.path.join(tmp, "cli", "planted_render.cpp"), "w") as fh:
            fh.write("// oracle::shard_ratios(x) in a comment is fine\nvoid r(const S& s) {\n"
                     "  out << oracle::protocol_name(p) << oracle::format_index_list(l);\n"
                     "  auto v = oracle::shard_ratios(s.batch);\n  bool f = s.failed(strict);\n}\n"
                     "using oracle::ranks_phrase;\nusing oracle::Divergence;\nusing oracle::shard_ratios;\n"
                     "using namespace lossguard::oracle;\n"
                     "bool g(const D& d, const C& c) { return d.finished(c) && std::lower_bound(b, e, 3) != e; }\n"
                     "bool h(const D* d) { return d->fails(); }\n"
                     "std::string k(const W& w) { return w.dg.summary(); }\n")
        os.makedirs(os.path.join(tmp, "oracle", "count"))
        with open(os.path.join(tmp, "oracle", "count", "planted.cpp"), "w") as fh:
            fh.write('#include "oracle/math/row_math.h"\n#include "oracle/weights/weights.h"\n')
        render = check_renderers(tmp, ["cli/planted_render.cpp"])
        inc = check_includes(tmp, ["oracle/planted.cpp", "oracle/count/planted.cpp"])
        fmt = check_format(tmp, ["oracle/planted.cpp"])
        size = check_sizes(tmp, ["oracle/long.cpp", "cli/cmd_planted.cpp", PY_PRODUCT + "long.py"])
        ok = (len(inc) == 3 and "may not include trainer/candidate.h" in inc[0] and "torch" in inc[1]
              and "oracle/count/planted.cpp:2: oracle/count/ may not include oracle/weights/weights.h" in inc[2]
              and len(fmt) == 1 and "planted.cpp" in fmt[0]
              and len(size) == 3 and "long.cpp:1: a function of 88 lines" in size[0]
              and "cmd_planted.cpp: 171 lines" in size[1]
              and f"{PY_PRODUCT}long.py:3: a function of 87 lines (long_one)" in size[2]
              and len(render) == 8 and "planted_render.cpp:4: a renderer calls oracle::shard_ratios()" in render[0]
              and "planted_render.cpp:5: a renderer asks a verdict (.failed" in render[1]
              and "planted_render.cpp:9: a renderer brings in oracle::shard_ratios" in render[2]
              and "planted_render.cpp:10: a renderer uses namespace oracle" in render[3]
              and "planted_render.cpp:11: a renderer asks a verdict (.finished" in render[4]
              and "planted_render.cpp:11: a renderer looks something up (std::lower_bound)" in render[5]
              and "planted_render.cpp:12: a renderer asks a verdict (.fails" in render[6]
              and "planted_render.cpp:13: a renderer asks a verdict (.summary" in render[7])
        print("check-house self-test:", "the planted include, format, size and renderer errors are caught"
              if ok else f"MISSED: {inc} {fmt} {size} {render}")
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--includes", action="store_true")
    ap.add_argument("--format", action="store_true")
    ap.add_argument("--sizes", action="store_true")
    ap.add_argument("--renderers", action="store_true")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    both = not (a.includes or a.format or a.sizes or a.renderers)
    problems = []
    if a.includes or both:
        problems += check_includes(ROOT)
    if a.format or both:
        problems += check_format(ROOT)
    if a.sizes or both:
        problems += check_sizes(ROOT)
    if a.renderers or both:
        problems += check_renderers(ROOT)
    for p in problems:
        print(p)
    print(f"check-house: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
