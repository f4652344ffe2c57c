"""The `kvcal` command line: calibrate, inspect, bench, export."""

from __future__ import annotations

import logging

import typer

from kvcal.cli._errors import OneLineErrors

app = typer.Typer(
    name="kvcal",
    cls=OneLineErrors,
    help="Calibrate KV-cache compression for a Hugging Face model and serve it with a compact runtime.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    from kvcal.cli import bench, calibrate, export, inspect

    app.command("calibrate")(calibrate.calibrate)
    app.command("inspect")(inspect.inspect)
    app.command("bench")(bench.bench)
    app.command("export")(export.export)


_register()


def main() -> None:
    from rich.logging import RichHandler

    from kvcal.cli._options import stderr

    # warnings go to stderr: stdout carries only the result (`--json` must parse)
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=stderr, show_path=False)])
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    app()
