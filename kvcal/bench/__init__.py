"""`kvcal bench`: kvcal against the baselines a user would otherwise adopt, on their model and their text.

    from kvcal.bench import BenchSettings, run_bench, write_report
    report = run_bench(lm, bundle, BenchSettings.preset(quick=True))     # lm = kvcal.models.load_model(...)
    write_report(report, "bench-out")       # bench.json, bench.md, pareto.png, decode_time.png

Modules: `methods` (what is compared and how each cache is built), `caches` (dense, eviction and transformers'
QuantizedCache baselines, each with `memory()`), `lowrank` (Palu-style pre-RoPE low rank), `measure` (one method's
quality, passkey and speed), `run` (the protocol over all methods), `report` (JSON schema, summary, Markdown, plots).
"""

from kvcal.bench.report import SCHEMA_VERSION, validate, write_report
from kvcal.bench.run import run_bench
from kvcal.bench.settings import BenchSettings

__all__ = [
    "SCHEMA_VERSION",
    "BenchSettings",
    "run_bench",
    "validate",
    "write_report",
]
