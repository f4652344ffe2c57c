"""kvcal: offline calibration and a compact runtime for KV-cache compression of decoder-only LLMs.

The offline half (`kvcal.profile`, the `kvcal` CLI) measures a model and writes one safetensors bundle; the online half
(`kvcal.runtime`) reads that bundle and serves a compressed KV cache. See README.md and docs/DESIGN.md.

Importing kvcal changes nothing in the host process (environment, logging, torch settings); only the `kvcal` command
sets its own offline mode (`kvcal.cli.main`).
"""

from kvcal.runtime.bundle import Bundle, BundleError, BundleMismatchError, load_bundle, save_bundle
from kvcal.runtime.version import __version__

__all__ = [
    "__version__",
    "Bundle",
    "BundleError",
    "BundleMismatchError",
    "load_bundle",
    "save_bundle",
]
