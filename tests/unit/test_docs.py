"""The documentation stays true: README.md and docs/*.md link only to files and headings that exist,
name only repository paths that exist, name only ``python -m`` commands that answer ``--help``, keep
every table's rows as wide as its header, name only ``--flags`` that the training script or a named
command takes, and the README stays a front door (under 250 lines).

Tables that a tool prints are held equal to the tool elsewhere (docs/contributing.md lists them)."""

import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "multimodal_dev")
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
README_MAX_LINES = 250
# first segments of the paths the pages name: the repository's own folders, and the example's
# (the pages write `data/collate.py` for examples/multimodal_dev/data/collate.py)
ROOT_FOLDERS = ("examples", "tools", "tests", "megatron", "docs")
EXAMPLE_FOLDERS = (
    "data",
    "models",
    "training",
    "checkpoint",
    "planner",
    "vision_ranks",
    "benchmarks",
    "megatron_changes",
)
PLACEHOLDER = re.compile(r"[A-Z]{3,}|\*|\.\.\.|[{}<>$]")  # NAME, DATE-DEVICE, iter_N/..., wildcards


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _prose(path: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                lines.append((number, line.rstrip("\n")))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not - or _), spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    anchors, repeats = set(), {}
    for _, line in _prose(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = _slug(match.group(1))
            repeats[slug] = repeats.get(slug, -1) + 1  # a repeated heading gets -1, -2, ...
            anchors.add(f"{slug}-{repeats[slug]}" if repeats[slug] else slug)
    return anchors


def _text(path: str) -> str:
    """The page with fenced blocks kept (commands are named there too)."""
    with open(path) as f:
        return f.read()


def test_pages_exist():
    names = {os.path.basename(p) for p in PAGES}
    assert {"README.md", "megatron_changes.md", "contributing.md"} <= names


def test_the_readme_is_a_front_door():
    with open(PAGES[0]) as f:
        lines = f.read().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move the detail to a page of docs/"


def test_relative_links_and_their_headings_exist():
    missing = []
    for page in PAGES:
        for number, line in _prose(page):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+://|mailto:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                path = os.path.normpath(os.path.join(os.path.dirname(page), file_part)) if file_part else page
                where = f"{_rel(page)}:{number}: {target}"
                if not os.path.exists(path):
                    missing.append(f"{where} (no such file)")
                elif anchor and path.endswith(".md") and anchor not in _anchors(path):
                    missing.append(f"{where} (no such heading in {_rel(path)})")
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def _named_paths(page: str):
    for number, line in _prose(page):
        for span in re.findall(r"`([^`\s]+)`", line):
            path = span.rstrip(".,;:")
            first = path.split("/", 1)[0]
            if "/" not in path or "://" in path or PLACEHOLDER.search(path):
                continue
            if first in ROOT_FOLDERS or first in EXAMPLE_FOLDERS:
                yield number, path


def test_named_repository_paths_exist():
    missing = []
    for page in PAGES:
        for number, path in _named_paths(page):
            # tools/ is the repository's own (tools/make_wheelhouse.py): the example's tools are named by
            # their command, python -m examples.multimodal_dev.tools.NAME
            bases = (ROOT,) if path.startswith("tools/") else (ROOT, EXAMPLE)
            if not any(os.path.exists(os.path.join(base, path)) for base in bases):
                missing.append(f"{_rel(page)}:{number}: `{path}`")
    assert not missing, "paths that do not exist (from the repository root or examples/multimodal_dev/):\n" + "\n".join(
        missing
    )


def test_the_path_check_sees_the_short_forms():
    """The check above reads both spellings, and would catch a wrong one."""
    named = {path for page in PAGES for _, path in _named_paths(page)}
    assert "examples/multimodal_dev/launcher/launch.py" in named and "data/jsonl.py" in named
    assert not any(os.path.exists(os.path.join(base, "data/collate_missing.py")) for base in (ROOT, EXAMPLE))


def _commands() -> dict[str, str]:
    """The repository's modules the pages run as ``python -m MODULE`` -> where first named."""
    found = {}
    for page in PAGES:
        for match in re.finditer(r"python -m\s+([A-Za-z_][\w.]*)", _text(page)):
            module = match.group(1).rstrip(".")
            if module.split(".")[0] not in ROOT_FOLDERS or PLACEHOLDER.search(module):
                continue  # not a command of this repository (pytest, pip), or a placeholder (NAME)
            line = _text(page).count("\n", 0, match.start()) + 1
            found.setdefault(module, f"{_rel(page)}:{line}")
    return found


# Runs each module as ``python -m MODULE --help`` would, in one interpreter (imports are shared, so
# the whole check takes seconds): {module: exit status, or the error}.
_HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
results = {}
for module in json.loads(sys.argv[1]):
    sys.argv = [module, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        results[module] = 0
    except SystemExit as stop:
        results[module] = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else str(stop.code))
    except BaseException as err:
        results[module] = f"{type(err).__name__}: {err}"
    if results[module] == 0 and "usage" not in out.getvalue().lower():
        results[module] = "exit 0 without a usage line"
print("\nRESULTS " + json.dumps(results))
"""


def _run_in_one_interpreter(runner: str, commands, marker: str) -> dict:
    """What ``runner`` (one of the scripts above) prints after ``marker`` for ``commands``, run in one
    fresh interpreter with the repository on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    run = subprocess.run(
        [sys.executable, "-c", runner, json.dumps(sorted(commands))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert marker in run.stdout, run.stderr[-3000:]
    return json.loads(run.stdout.rsplit(marker, 1)[1])


def test_python_m_commands_answer_help():
    commands = _commands()
    assert "examples.multimodal_dev.tools.plan_layout" in commands
    results = _run_in_one_interpreter(_HELP_RUNNER, commands, "RESULTS ")
    bad = [f"{commands[m]}: python -m {m} --help: {status}" for m, status in results.items() if status != 0]
    assert not bad, "commands that do not answer --help:\n" + "\n".join(bad)


def _tables(page: str):
    """(line number of the header, header, [(line number, row)]) of each Markdown table."""
    block: list[tuple[int, str]] = []
    for number, line in [*_prose(page), (0, "")]:
        if line.startswith("|"):
            block.append((number, line))
            continue
        if len(block) >= 2:
            yield block[0][0], block[0][1], block[1:]
        block = []


def _cells(row: str) -> int:
    return len(re.split(r"(?<!\\)\|", row.strip().strip("|")))


def test_table_rows_have_the_headers_columns():
    uneven, tables = [], 0
    for page in PAGES:
        for number, header, rows in _tables(page):
            tables += 1
            want = _cells(header)
            uneven += [
                f"{_rel(page)}:{n}: {_cells(row)} cells, header (line {number}) has {want}"
                for n, row in rows
                if _cells(row) != want
            ]
    assert tables >= 20
    assert not uneven, "table rows of another width:\n" + "\n".join(uneven)


# Flags of the outside tools the pages show (pip, torchrun, ruff, sbatch and srun), which no command here defines.
OUTSIDE_FLAGS = {
    *("--find-links", "--no-index", "--platform", "--format", "--fix"),
    *("--standalone", "--nproc-per-node", "--rdzv-conf"),
    *("--nodes", "--kill-on-bad-exit"),
}

# Builds each command's argument parser as a run would and records every option it (and its
# subcommands) takes, stopping at the parse: {command: [flags]}.
_FLAGS_RUNNER = r"""
import argparse, contextlib, io, json, runpy, sys

class Collected(BaseException):
    pass

def options(parser):
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from options(sub)

def collect(self, *args, **kwargs):
    raise Collected(sorted(options(self)))

argparse.ArgumentParser.parse_known_args = collect
found = {}
for command in json.loads(sys.argv[1]):
    sys.argv = [command]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if command.endswith(".py"):
                runpy.run_path(command, run_name="__main__")
            else:
                runpy.run_module(command, run_name="__main__", alter_sys=True)
        found[command] = "no argument parser"
    except Collected as flags:
        found[command] = flags.args[0]
    except BaseException as err:
        found[command] = f"{type(err).__name__}: {err}"
print("\nFLAGS " + json.dumps(found))
"""


def _scripts() -> set[str]:
    """The repository's scripts the pages name by path: ``python tools/x.py`` and benchmarks."""
    found = set()
    for page in PAGES:
        text = _text(page)
        found |= set(re.findall(r"python3?\s+((?:tools|tests)/[\w/]+\.py)", text))
        found |= {f"examples/multimodal_dev/{b}" for b in re.findall(r"(benchmarks/bench_\w+\.py)", text)}
    return {path for path in found if os.path.exists(os.path.join(ROOT, path))}


def _named_flags():
    for page in PAGES:
        for number, line in enumerate(_text(page).splitlines(), 1):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", line):
                yield f"{_rel(page)}:{number}", flag


def test_named_flags_exist():
    """Every ``--flag`` a page names is taken by the training script (megatron's parser with this
    project's flags), by a command or script the pages name, or by an outside tool they show."""
    from examples.multimodal_dev.arguments import add_multimodal_args
    from examples.multimodal_dev.models.common.config_from_args import megatron_parser

    commands = {*_commands(), *_scripts()}
    assert "examples.multimodal_dev.tools.convert_checkpoint" in commands and "tools/make_wheelhouse.py" in commands
    taken = _run_in_one_interpreter(_FLAGS_RUNNER, commands, "FLAGS ")
    known = set(megatron_parser(add_multimodal_args)._option_string_actions) | OUTSIDE_FLAGS
    for flags in taken.values():
        known |= set(flags) if isinstance(flags, list) else set()
    assert "--hf-path" in known and "--gpu-extras" in known  # subcommands' and scripts' flags are read
    unknown = [f"{where}: {flag}" for where, flag in _named_flags() if flag not in known]
    unread = {c: why for c, why in taken.items() if not isinstance(why, list)}
    assert not unknown, f"flags that nothing takes (commands without a parser: {unread}):\n" + "\n".join(unknown)
