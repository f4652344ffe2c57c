"""The decision that has to hold on evaluation text: check the search's choice, fall back to safer points."""

from __future__ import annotations

from kvcal.profile.calibrate import decide
from kvcal.profile.search import Point

TARGET = {"top1": 0.97, "ppl_ratio": 1.02, "z": 1.5}


def _point(label, bytes_ratio, feasible=True):
    return Point(stage="precision", label=label, settings={"high": label}, bytes_ratio=bytes_ratio, top1=0.99,
                 kl=0.0, ppl_ratio=1.0, tiers={}, feasible=feasible, seconds=0.0, predictions=512)


def _fid(top1):
    return {"top1": top1, "ppl_ratio": 1.0, "kl": 0.0, "predictions": 512, "memory": {"ratio_to_fp16": 0.5}}


def test_a_miss_moves_to_the_next_safer_point():
    path = [_point("K8V4", 0.44), _point("K8V4g32", 0.45), _point("K8V8", 0.56), _point("K4V2", 0.3, False),
            _point("K8V4g32", 0.45)]                     # measured twice: checked once
    quality = {"K8V4": 0.965, "K8V4g32": 0.968, "K8V8": 0.99}
    checked = []

    def check(p):
        checked.append(p.label)
        return _fid(quality[p.label])

    point, fid, checks = decide(path[0], path, check, TARGET, max_checks=3)
    assert checked == ["K8V4", "K8V4g32", "K8V8"] and point.label == "K8V8" and fid["top1"] == 0.99
    assert [c["met"] for c in checks] == [False, False, True]


def test_sensitivity_probes_are_never_fallbacks():
    """The bits stage's one-layer probes rank steps; they are measurements, not candidates."""
    probe = _point("K8V4 layer 3", 0.45)
    probe.stage = "sensitivity"
    path = [_point("K8V4", 0.44), probe, _point("K8V8", 0.56)]
    checked = []
    point, _, _ = decide(path[0], path, lambda p: checked.append(p.label) or _fid(0.99 if p.label == "K8V8" else 0.9),
                         TARGET, max_checks=3)
    assert checked == ["K8V4", "K8V8"] and point.label == "K8V8"


def test_nothing_passes_keeps_the_best_checked():
    path = [_point("K8V4", 0.44), _point("K8V4g32", 0.45), _point("K8V8", 0.56)]
    quality = {"K8V4": 0.95, "K8V4g32": 0.96, "K8V8": 0.955}
    point, fid, checks = decide(path[0], path, lambda p: _fid(quality[p.label]), TARGET, max_checks=2)
    assert len(checks) == 2 and not any(c["met"] for c in checks)
    assert point.label == "K8V4g32"                      # the better of the two checked; K8V8 was beyond max_checks


def test_context_beyond_the_model_is_a_one_line_error(tiny_dir, text_file, tmp_path):
    from typer.testing import CliRunner

    from kvcal.cli import app

    out = tmp_path / "c.kvcal.safetensors"
    r = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_dir), "--out", str(out), "--dataset",
                                 str(text_file), "--context", "100000", "--quiet"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "`--context 100000` is beyond the model's 512 positions; pass at most 512" in r.stderr
    assert not out.exists()
