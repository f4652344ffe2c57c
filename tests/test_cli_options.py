"""The commands' options reach the library as config objects built by name (`kvcal.cli._options.from_options`): an
option that no config names would be dropped without a word, so each command's options are checked against its
configs here."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from kvcal.cli._options import Output, from_options


def _params(command) -> set[str]:
    return set(inspect.signature(command).parameters)


def _fields(*classes) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.init}


def test_from_options_takes_fields_by_name_and_derived_values_win():
    @dataclass
    class Group:
        a: int = 0
        b: str = ""

    built = from_options(Group, {"a": 1, "b": "raw", "other": True}, b="parsed")
    assert built == Group(a=1, b="parsed")


def test_every_calibrate_option_reaches_a_config():
    from kvcal.cli.calibrate import calibrate
    from kvcal.profile.calibrate import CalibrationConfig

    # --threads is applied before any config is built (kvcal.cli._threads.use_threads)
    assert _params(calibrate) - _fields(CalibrationConfig, Output) == {"threads"}


def test_every_bench_option_reaches_a_config():
    from kvcal.bench import BenchSettings
    from kvcal.cli.bench import BenchFiles, bench

    # --backend becomes BenchSettings.serve; --offload picks the command's branch; --threads comes first
    assert _params(bench) - _fields(BenchFiles, BenchSettings, Output) == {"backend", "offload", "threads"}


def test_every_export_option_reaches_a_config():
    from kvcal.cli.export import ExportOptions, export

    assert _params(export) - _fields(ExportOptions) == {"json_out", "threads"}
