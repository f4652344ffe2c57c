"""docs/cli-flags.md says what `--help` says: the page is what `experiments/cli_flags_page.py` generates from the
command objects now, every long flag a command's `--help` prints is on the page under that command, and every
option's name and description on the page is printed by `--help` as is. No model loads: seconds."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcal.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli-flags.md"
FIX = "run `python experiments/cli_flags_page.py` and commit docs/cli-flags.md"
runner = CliRunner()


def _generator():
    spec = importlib.util.spec_from_file_location("cli_flags_page", ROOT / "experiments" / "cli_flags_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


gen = _generator()
COMMANDS = [name for name, _, _ in gen.commands()]


def _help(command: str) -> str:
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    return r.stdout


def _section(page: str, command: str) -> str:
    m = re.search(rf"^## kvcal {command}\n(.*?)(?=^## |\Z)", page, re.M | re.S)
    assert m, f"docs/cli-flags.md has no `## kvcal {command}` section: {FIX}"
    return m.group(1)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_command_is_documented():
    assert set(COMMANDS) == {"calibrate", "inspect", "bench", "export"}
    page = PAGE.read_text()
    for command in COMMANDS:
        _section(page, command)


def test_page_is_up_to_date():
    """A flag added, removed or reworded without regenerating the page fails here."""
    assert PAGE.exists(), f"docs/cli-flags.md is missing: {FIX}"
    assert PAGE.read_text() == gen.render_page(), f"docs/cli-flags.md does not match the CLI: {FIX}"


@pytest.mark.parametrize("command", ["calibrate", "inspect", "bench", "export"])
def test_help_flags_are_on_the_page(command):
    """Every long flag `kvcal <command> --help` prints (option names and flags named in descriptions) is in the
    command's section; each option's own names are in its table's flag column."""
    help_text = _help(command)
    section = _section(PAGE.read_text(), command)
    printed = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", help_text))
    assert printed, help_text
    missing = sorted(f for f in printed if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", section))
    assert not missing, f"`kvcal {command} --help` prints {missing}, not in docs/cli-flags.md: {FIX}"
    options = help_text.split("\nOptions:\n", 1)[1]
    named = set(re.findall(r"^ {2}(?:-\w, )?(--[a-z0-9-]+)(?: / (--[a-z0-9-]+))?", options, re.M))
    flag_column = {line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")}
    for names in named:
        for name in filter(None, names):
            assert any(f"`{name}`" in cell for cell in flag_column), \
                f"`kvcal {command}`: {name} has no row in docs/cli-flags.md: {FIX}"


@pytest.mark.parametrize("command", ["calibrate", "inspect", "bench", "export"])
def test_rows_read_as_help_prints_them(command):
    """Each row's names, value and description (with its bracketed default) are printed by `--help`, word for word
    (the help wraps lines; the page does not)."""
    printed = _flat(_help(command))
    _, cmd, ctx = next(c for c in gen.commands() if c[0] == command)
    for row in gen.rows(cmd, ctx):
        assert _flat(f"{row.shown} {row.described}") in printed, (command, row)
