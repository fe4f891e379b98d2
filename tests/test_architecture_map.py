"""Keeps docs/architecture.md §6.1 (the tree of the code as built) true to src/conveyor.

The tree is the first fenced block after the `### 6.1` heading. Its grammar:
- an entry line is `<indent><names>` then two or more spaces and a description (or nothing);
- the indent is two spaces per directory level (0 for `src/conveyor/` itself, at most MAX_ENTRY_INDENT);
- `<names>` is one name, or several files separated by ", " (`run.py, sweep.py, study.py`);
- a name ending in `/` is a directory, and the lines indented under it are its contents;
- a line indented DESCRIPTION_INDENT or more continues the description above it.
Any other line fails the test, so a typo cannot hide an entry.

The checks: every source file (.py other than __init__.py, .c, .h) under src/conveyor is named by its
path in the tree, every file and directory the tree names exists, and every directory holding a
source file has its own line (one line per package and sub-package).
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "conveyor"
DOC = ROOT / "docs" / "architecture.md"
TREE_HEADING = "### 6.1"
TREE_ROOT = "src/conveyor/"
SOURCE_SUFFIXES = (".py", ".c", ".h")
MAX_ENTRY_INDENT = 12
DESCRIPTION_INDENT = 20
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*/?"
_ENTRY = re.compile(rf"^(?P<names>{_NAME}(?:, {_NAME})*)(?:  +\S.*)?$")


class TreeError(ValueError):
    """A line of the tree that the grammar above does not accept."""


def tree_block(markdown: str) -> list[str]:
    """The lines of the first fenced block after the §6.1 heading."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(TREE_HEADING)), None)
    if start is None:
        raise TreeError(f"no heading starting with {TREE_HEADING!r}")
    fences = [i for i in range(start + 1, len(lines)) if lines[i].startswith("```")]
    if len(fences) < 2:
        raise TreeError(f"no fenced block after {TREE_HEADING!r}")
    return lines[fences[0] + 1: fences[1]]


def parse_tree(lines: list[str]) -> tuple[set[str], set[str]]:
    """(files, directories) the tree names, as paths relative to its root (directories end in '/')."""
    if not lines or lines[0].rstrip() != TREE_ROOT:
        raise TreeError(f"the tree must start with the line {TREE_ROOT!r}")
    files: set[str] = set()
    dirs: set[str] = set()
    parents: list[str] = []  # parents[d] = the directory at depth d + 1 currently open
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent >= DESCRIPTION_INDENT:
            continue
        match = _ENTRY.match(line[indent:])
        if indent % 2 or indent == 0 or indent > MAX_ENTRY_INDENT or match is None:
            raise TreeError(f"tree line {number} is neither an entry nor a continuation: {line!r}")
        depth = indent // 2
        if depth - 1 > len(parents):
            raise TreeError(f"tree line {number} is indented under no directory: {line!r}")
        del parents[depth - 1:]
        prefix = "".join(parents)
        names = match["names"].split(", ")
        for name in names:
            if name.endswith("/"):
                if len(names) > 1:
                    raise TreeError(f"tree line {number}: a directory must have a line of its own: {line!r}")
                dirs.add(prefix + name)
                parents.append(name)
            else:
                files.add(prefix + name)
    return files, dirs


def source_files() -> set[str]:
    """Every source file under src/conveyor the map must name, relative to it."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*")
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and path.name != "__init__.py"
            and "__pycache__" not in path.parts}


def _map() -> tuple[set[str], set[str]]:
    return parse_tree(tree_block(DOC.read_text(encoding="utf-8")))


def test_every_source_file_is_on_the_map() -> None:
    files, _ = _map()
    missing = sorted(source_files() - files)
    assert not missing, ("docs/architecture.md §6.1 leaves out these files (add one line each, under "
                         f"their directory): {missing}")


def test_the_map_names_only_files_that_exist() -> None:
    files, dirs = _map()
    gone = sorted(f for f in files if not (PACKAGE / f).is_file())
    gone += sorted(d for d in dirs if not (PACKAGE / d).is_dir())
    assert not gone, f"docs/architecture.md §6.1 names what src/conveyor does not hold: {gone}"


def test_every_package_has_its_line() -> None:
    _, dirs = _map()
    needed = {str(pathlib.PurePosixPath(f).parent) + "/" for f in source_files()} - {"./"}
    missing = sorted(needed - dirs)
    assert not missing, f"docs/architecture.md §6.1 has no line for these directories: {missing}"


# ---- the parser itself, on a synthetic tree ------------------------------------------------------

SYNTHETIC = """\
src/conveyor/
  cli.py                   the dispatcher
  core/                    the scheduler
    scheduler.py           one step
                           and its update (a continuation: not an entry)
  bench/                   the benchmark
    units.py               numbers
    cli/                   subcommands
      run.py, sweep.py     one each
    measure/               stage 3
      metrics.py           client metrics
  server/
    metrics.py             the same basename in another package
"""


def test_parser_reads_nesting_lists_and_continuations() -> None:
    files, dirs = parse_tree(SYNTHETIC.splitlines())
    assert files == {"cli.py", "core/scheduler.py", "bench/units.py", "bench/cli/run.py", "bench/cli/sweep.py",
                     "bench/measure/metrics.py", "server/metrics.py"}
    assert dirs == {"core/", "bench/", "bench/cli/", "bench/measure/", "server/"}


@pytest.mark.parametrize("bad_line", [
    "   odd.py                 odd indent",
    "    orphan/deep.py        a slash inside a name",
    "  two.py three.py         one space between names",
    "  a/, b.py                a directory in a list",
])
def test_parser_refuses_what_it_cannot_read(bad_line: str) -> None:
    with pytest.raises(TreeError):
        parse_tree([*SYNTHETIC.splitlines(), bad_line])


def test_parser_refuses_an_entry_under_no_directory() -> None:
    with pytest.raises(TreeError):
        parse_tree(["src/conveyor/", "  cli.py", "      deep.py    three levels under a file"])


def test_a_missing_and_an_extra_file_are_both_seen() -> None:
    files, _ = parse_tree(SYNTHETIC.splitlines())
    on_disk = {"cli.py", "core/scheduler.py", "core/block_pool.py"}
    assert on_disk - files == {"core/block_pool.py"}
    assert "bench/units.py" in files - on_disk
