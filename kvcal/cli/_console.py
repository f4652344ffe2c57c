"""The command's two consoles: stdout carries only the result (`--json` must parse), everything else goes to stderr
(errors, progress bars, warnings). A leaf module, so that option parsing and error printing can share them."""

from __future__ import annotations

from rich.console import Console

stderr = Console(stderr=True)
stdout = Console()
