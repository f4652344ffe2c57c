"""`--help` as plain text that fits the terminal (at most `MAX_WIDTH` columns) and never breaks a word.

Typer's rich help gives the option names four columns and squeezes the descriptions into what is left: at 80
columns, choices and defaults were cut inside words (`hf-l owrank-v`) or cut off with an ellipsis. This layout is
click's (names, then the description, wrapped), with three differences: lines wrap only at spaces (never at a hyphen
or inside a word), a bracketed note such as `[default: hf-lowrank-v]` stays on one line, and types read as words
(`--seed INTEGER`, `--format [vllm-fp8|manifest|hf-lowrank-v]`; flags show no type).

The commands get it through `cls=CheckedCommand` (kvcal.cli._options: a KvcalCommand that also checks numbers), the
app through `cls=KvcalGroup`; parsing and errors are untouched here.
"""

from __future__ import annotations

import re
import shutil
import textwrap

import typer.core

MAX_WIDTH = 100         # wider help lines are hard to read, and the project promises 100 columns
MIN_WIDTH = 60          # below this, wrapping to the terminal helps nobody: let the terminal wrap
NAME_COLUMN = 30        # option names longer than this put their description on the next line
INDENT = 2
GAP = 2
NBSP = "\u00a0"

_TYPE_WORDS = {"str": "TEXT", "path": "PATH", "int": "INTEGER", "float": "FLOAT", "bool": ""}


def help_width() -> int:
    """Columns the help may use: the terminal's (or `COLUMNS`), capped at `MAX_WIDTH`."""
    return max(MIN_WIDTH, min(shutil.get_terminal_size((MAX_WIDTH, 24)).columns, MAX_WIDTH))


def wrap(text: str, width: int) -> list[str]:
    """Lines of at most `width` columns, broken only at spaces; a `[...]` note is never split. A single word longer
    than `width` keeps its own, longer line rather than being cut."""
    glued = re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace(" ", NBSP), text)
    lines = textwrap.wrap(glued, width=max(width, 1), break_long_words=False, break_on_hyphens=False)
    return [line.replace(NBSP, " ") for line in lines] or [""]


def _type_word(match: re.Match) -> str:
    inner = match.group(1)
    if "|" in inner:
        return f"[{inner}]"
    return _TYPE_WORDS.get(inner, inner.upper())


def names(record_name: str) -> str:
    """Typer's `-m, --model <str>` -> `-m, --model TEXT`; `<a|b>` -> `[a|b]`; `<bool>` dropped."""
    return re.sub(r"\s*<([^<>]*)>", lambda m: (" " + w) if (w := _type_word(m)) else "", record_name).strip()


def describe(record_help: str) -> str:
    """Typer writes a `show_default` text in parentheses (`[default: (./<model>.kvcal.safetensors)]`): drop them."""
    return re.sub(r"\[default: \((.*?)\)\]", r"[default: \1]", record_help)


def definition_list(rows: list[tuple[str, str]], width: int) -> list[str]:
    """click's `write_dl`, with `wrap` for the descriptions."""
    name_width = min(max((len(n) for n, _ in rows), default=0), NAME_COLUMN)
    text_col = INDENT + name_width + GAP
    out: list[str] = []
    for name, text in rows:
        lines = wrap(text, width - text_col) if text else [""]
        if len(name) <= name_width:
            out.append(f"{' ' * INDENT}{name.ljust(name_width)}{' ' * GAP}{lines[0]}".rstrip())
            rest = lines[1:]
        else:
            out.append(f"{' ' * INDENT}{name}")
            rest = lines if text else []
        out += [f"{' ' * text_col}{line}".rstrip() for line in rest]
    return out


def _paragraphs(text: str, width: int) -> list[str]:
    out: list[str] = []
    for para in re.split(r"\n\s*\n", textwrap.dedent(text or "").strip()):
        if out:
            out.append("")
        out += [f"{' ' * INDENT}{line}" for line in wrap(" ".join(para.split()), width - INDENT)]
    return out


def _usage(command, ctx) -> str:
    """`kvcal export [OPTIONS] BUNDLE` (Typer writes arguments as `{BUNDLE}`)."""
    pieces = [re.sub(r"^\{(.*)\}$", r"\1", p) for p in command.collect_usage_pieces(ctx)]
    return " ".join([ctx.command_path, *pieces])


def render_command(command, ctx) -> str:
    """The whole help of one command: usage, description, arguments, options."""
    width = help_width()
    usage = _usage(command, ctx)
    lines = wrap(f"Usage: {usage}", width) + [""]
    lines += _paragraphs(command.help, width)
    args, opts = [], []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        if param.param_type_name == "argument":        # `BUNDLE`, not `BUNDLE PATH`: the metavar names it
            args.append((record[0].split()[0], describe(record[1])))
        else:
            opts.append((names(record[0]), describe(record[1])))
    for title, rows in (("Arguments", args), ("Options", opts)):
        if rows:
            lines += ["", f"{title}:", *definition_list(rows, width)]
    return "\n".join(lines) + "\n"


def render_group(group, ctx) -> str:
    """The app's help: usage, description, options, then each command with its first paragraph."""
    width = help_width()
    usage = _usage(group, ctx)
    lines = wrap(f"Usage: {usage}", width) + [""]
    lines += _paragraphs(group.help, width)
    opts = [(names(r[0]), r[1]) for p in group.get_params(ctx) if (r := p.get_help_record(ctx))]
    if opts:
        lines += ["", "Options:", *definition_list(opts, width)]
    cmds = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is not None and not cmd.hidden:
            first = re.split(r"\n\s*\n", textwrap.dedent(cmd.help or "").strip())[0]
            cmds.append((name, " ".join(first.split())))
    if cmds:
        lines += ["", "Commands:", *definition_list(cmds, width)]
    return "\n".join(lines) + "\n"


class KvcalCommand(typer.core.TyperCommand):
    def format_help(self, ctx, formatter) -> None:
        formatter.write(render_command(self, ctx))


class KvcalGroup(typer.core.TyperGroup):
    def format_help(self, ctx, formatter) -> None:
        formatter.write(render_group(self, ctx))
