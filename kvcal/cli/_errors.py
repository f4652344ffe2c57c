"""How the CLI fails: every error is one line on stderr and exit code 1, usage errors included; text that comes from
files (bundle metadata, paths) reaches the terminal as plain text, never as markup or escape sequences."""

from __future__ import annotations

import dataclasses
import re
import signal
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.markup import escape
from typer._click import exceptions as click_errors  # typer vendors click; these are what it raises

from kvcal.cli._console import stderr
from kvcal.cli._help import KvcalGroup

# C0 controls other than tab and newline, DEL, and C1 controls (ESC starts ANSI sequences; CSI is \x9b)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`kill`, a closed terminal, a job scheduler), raised in the main thread as Ctrl-C is: the same
    cleanup runs (temporary record files removed, checkpoints kept, no half-written output), where Python's default
    for these signals ends the process on the spot."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []          # the signals `_interrupt` raised, in the order they came


def _interrupt(signum, frame) -> None:
    """Raise the interrupt for `signum`, and keep it: one that lands while Python runs a finalizer (gc's, a weakref
    callback) is printed and dropped there, and `raise_pending` raises it again."""
    _received.append(signum)
    raise _interrupt_for(signum)


def _interrupt_for(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def raise_pending() -> None:
    """Raise the first interrupt this process received, if it has received one: for the long commands to call between
    units of work, so that an interrupt a finalizer swallowed still stops them there."""
    if _received:
        raise _interrupt_for(_received[0])


def checked(show: Callable) -> Callable:
    """`show`, a progress display, raising first an interrupt that a finalizer swallowed (`raise_pending`): the long
    commands call their displays between windows and measurements, where an interrupt can stop them safely."""
    def call(*args):
        raise_pending()
        return show(*args)
    return call


def handle_interrupts() -> None:
    """Ctrl-C, SIGTERM and SIGHUP raise `_interrupt` for the rest of the process, where each still has its default
    (a signal set to be ignored, as `nohup` sets SIGHUP, stays ignored). The command line only: importing kvcal
    leaves signals alone."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    if hasattr(signal, "SIGHUP"):
        defaults[signal.SIGHUP] = signal.SIG_DFL
    for signum, default in defaults.items():
        if signal.getsignal(signum) is default:
            signal.signal(signum, _interrupt)


def interrupted(e: KeyboardInterrupt) -> tuple[str, int]:
    """(what happened, exit code) for an interrupt: 130 for Ctrl-C, 128 + the signal's number for `Terminated`."""
    if isinstance(e, Terminated):
        return "terminated", 128 + e.signum
    return "interrupted", 130


def plain(text: str) -> str:
    """`text` safe to print through rich: control characters shown as \\xNN, markup brackets escaped.

    The one helper for every string a user controls (paths, model names, bundle metadata, messages quoting them) that
    the CLI prints with rich: put `plain(s)` into markup (a table cell, a title, `console.print`), never `s` itself."""
    return escape(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


def terminal_safe(value: Any) -> Any:
    """A copy of `value` (str, dict, list, dataclass such as a Bundle) with every string made `plain`, for display."""
    if isinstance(value, str):
        return plain(value)
    if isinstance(value, dict):
        return {terminal_safe(k): terminal_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(terminal_safe(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: terminal_safe(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    return value


class OneLineErrors(KvcalGroup):
    """The app's click group: usage errors (unknown option, bad value, missing argument) print one line and exit 1,
    as every other kvcal error does, instead of click's framed box and exit code 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError:     # bare `kvcal`: the help was printed; asking for it is no error
            sys.exit(0)
        except click_errors.UsageError as e:
            where = e.ctx.command_path if e.ctx else "kvcal"
            message = e.format_message()
            param = getattr(e, "param", None)
            if isinstance(e, click_errors.MissingParameter) and param is not None:
                names = [o for o in getattr(param, "opts", []) if o.startswith("-")]
                message = f"missing {'option `' + names[0] + '`' if names else 'argument ' + param.name.upper()}"
            _print_error(f"{message} (see `{where} --help`)")
            sys.exit(1)
        except click_errors.ClickException as e:
            _print_error(e.format_message())
            sys.exit(1)
        except typer.Abort:
            _print_error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _print_error(message: str) -> None:
    line = " ".join(message.split())
    stderr.print(f"[bold red]error:[/] {plain(line)}", highlight=False, soft_wrap=True)
