"""The `kvcal` command line: calibrate, inspect, bench, export."""

from __future__ import annotations

import logging
import warnings

import typer

from kvcal.cli._errors import OneLineErrors
from kvcal.cli._help import KvcalCommand

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

    app.command("calibrate", cls=KvcalCommand)(calibrate.calibrate)
    app.command("inspect", cls=KvcalCommand)(inspect.inspect)
    app.command("bench", cls=KvcalCommand)(bench.bench)
    app.command("export", cls=KvcalCommand)(export.export)


_register()


def main() -> None:
    from rich.logging import RichHandler

    from kvcal.cli._options import stderr

    # warnings go to stderr, through the progress bars' console: stdout carries only the result (`--json` must
    # parse), and a warning prints above a live bar instead of through it
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=stderr, show_path=False)])
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    # transformers 5.24 renamed the model's `past_key_values` keyword `cache` and warns on each call with the old one,
    # which kvcal's own calls keep using so that transformers 5.0-5.23 work too (the cap in pyproject.toml is 5.40)
    warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)
    app()
