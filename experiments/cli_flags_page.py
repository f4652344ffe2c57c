"""docs/cli-flags.md: every flag of every `kvcal` command, read from the typer/click command objects (never from
terminal output), so the page says what `--help` says.

    python experiments/cli_flags_page.py            # rewrite docs/cli-flags.md
    python experiments/cli_flags_page.py --check    # exit 1 if the page is out of date

tests/test_docs_cli_flags.py calls `render_page()` and compares it with the file on disk.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli-flags.md"
SCRIPT = "python experiments/cli_flags_page.py"
NONE = "—"

INTRO = """\
# Every `kvcal` flag

Every option of every command, as its `--help` shows it: the flag names, the value it takes, its default and what it
does. `python experiments/cli_flags_page.py` generates this page from the command objects, and
`tests/test_docs_cli_flags.py` checks it against `--help`: when a flag is added, removed or reworded the test fails
until the script is rerun. How the commands fit together: the [README](../README.md) and [cli.md](cli.md).
"""


@dataclass(frozen=True)
class Row:
    """One option (or argument) as `--help` prints it: `flags` the names (`-m, --model`), `value` what follows them
    (`MODEL`; an argument's type), `text` the description, `notes` its bracketed note (`default: auto`)."""
    flags: str
    value: str
    text: str
    notes: str
    is_argument: bool
    is_bool_flag: bool
    descriptive_default: bool

    @property
    def shown(self) -> str:
        """The name column of `--help` (an argument shows its metavar alone; the page adds its type)."""
        return self.flags if self.is_argument else f"{self.flags} {self.value}".strip()

    @property
    def described(self) -> str:
        return f"{self.text}  [{self.notes}]" if self.notes else self.text


def root_command():
    """The click group behind `kvcal`, and its context."""
    import typer

    from kvcal.cli import app

    group = typer.main.get_command(app)
    return group, group.context_class(group, info_name="kvcal")


def commands() -> list[tuple[str, object, object]]:
    """(name, command, context) for each command, in the order `kvcal --help` lists them."""
    group, ctx = root_command()
    out = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is not None and not cmd.hidden:
            out.append((name, cmd, cmd.context_class(cmd, info_name=name, parent=ctx)))
    return out


def _join(opts: list[str]) -> str:
    """click's `join_options`: short names (`-m`) before long ones (`--model`), each group in declared order."""
    return ", ".join(sorted(opts, key=lambda o: len(o) - len(o.lstrip("-/"))))


def rows(cmd, ctx) -> list[Row]:
    """Each parameter `--help` shows, named and described exactly as kvcal's help layout (`kvcal.cli._help`) does."""
    from kvcal.cli._help import describe, names

    out = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        is_argument = param.param_type_name == "argument"
        shown = names(record[0])
        if is_argument:
            flags = shown.split()[0]
        else:
            flags = _join(param.opts)
            if param.secondary_opts:
                flags += " / " + _join(param.secondary_opts)
        if shown != flags and not shown.startswith(flags + " "):
            raise ValueError(f"`kvcal {ctx.info_name}`: help names `{shown}`, not `{flags} ...`; update {SCRIPT}")
        value = shown[len(flags):].strip()
        text, notes = describe(record[1]), ""
        head, sep, tail = text.rpartition("  [")
        if sep and tail.endswith("]"):
            text, notes = head, tail[:-1]
        out.append(Row(flags=flags, value=value, text=" ".join(text.split()), notes=notes, is_argument=is_argument,
                       is_bool_flag=bool(getattr(param, "is_flag", False)) and param.default is False,
                       descriptive_default=isinstance(getattr(param, "show_default", None), str)))
    return out


def _cell(text: str) -> str:
    """Plain text in a table cell: `|` would end the cell, `<model>` would read as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _code(text: str) -> str:
    return f"`{text.replace('|', chr(92) + '|')}`"


def default_cell(row: Row) -> str:
    """The bracketed note of the help (`default: X`, `required`, `required unless --offload`), or `off` for a flag
    that is off unless given, or a dash."""
    parts = []
    notes = row.notes
    required = notes == "required" or notes.endswith("; required")
    if required:
        notes = notes[: -len("required")].rstrip("; ")
    if notes.startswith("default: "):
        value = notes[len("default: "):]
        parts.append(_cell(value) if row.descriptive_default and " " in value else _code(value))
    elif notes:
        parts.append(_cell(notes))
    if required:
        parts.append("required")
    if not parts and row.is_bool_flag:
        parts.append("off")
    return "; ".join(parts) or NONE


def table(row_list: list[Row]) -> list[str]:
    lines = ["| flag | value | default | what it does |", "| --- | --- | --- | --- |"]
    for row in row_list:
        flag = " / ".join(
            ", ".join(_code(name) for name in side.split(", ")) for side in row.flags.split(" / "))
        if row.is_argument:
            flag += " (argument)"
        value = _code(row.value) if row.value else NONE
        lines.append(f"| {flag} | {value} | {default_cell(row)} | {_cell(row.text)} |")
    return lines


def _usage(cmd, ctx) -> str:
    pieces = [re.sub(r"^\{(.*)\}$", r"\1", p) for p in cmd.collect_usage_pieces(ctx)]
    return " ".join([ctx.command_path, *pieces])


def render_page() -> str:
    """The whole page, as docs/cli-flags.md holds it."""
    lines = [INTRO.rstrip("\n")]
    for name, cmd, ctx in commands():
        first = re.split(r"\n\s*\n", (cmd.help or "").strip())[0]
        lines += ["", f"## kvcal {name}", "", f"`{_usage(cmd, ctx)}`", ""]
        if first:
            lines += [" ".join(first.split()), ""]
        lines += table(rows(cmd, ctx))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page on disk is out of date; write nothing")
    args = ap.parse_args()
    page = render_page()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run {SCRIPT}", file=sys.stderr)
            sys.exit(1)
        return
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
