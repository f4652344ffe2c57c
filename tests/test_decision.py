"""The decision that has to hold on evaluation text: check the search's choice, bisect over safer points."""

from __future__ import annotations

from kvcal.profile.calibrate import decide, frontier
from kvcal.profile.search import Point

TARGET = {"top1": 0.97, "ppl_ratio": 1.02, "z": 1.5}


def _point(label, bytes_ratio, feasible=True):
    return Point(stage="precision", label=label, settings={"high": label}, bytes_ratio=bytes_ratio, top1=0.99,
                 kl=0.0, ppl_ratio=1.0, tiers={}, feasible=feasible, seconds=0.0, predictions=512)


def _fid(top1):
    return {"top1": top1, "ppl_ratio": 1.0, "kl": 0.0, "predictions": 512, "memory": {"ratio_to_fp16": 0.5},
            "top1_windows": [top1] * 4}


def _decide(path, quality, max_checks):
    """decide() on path[0] with each label's top-1 on evaluation text from `quality`; also the labels checked."""
    checked = []

    def check(p):
        checked.append(p.label)
        return _fid(quality[p.label])

    return (*decide(path[0], path, check, TARGET, max_checks=max_checks), checked)


def test_the_candidates_are_the_feasible_dearer_points_each_settings_once():
    path = [_point("K4V4", 0.30), _point("K8V4", 0.44), _point("K8V4g32", 0.45), _point("K4V2", 0.25, feasible=False),
            _point("K8V4 again", 0.44), _point("K2V2", 0.20), _point("K8V8", 0.56)]
    path[4].settings = dict(path[1].settings)              # measured twice: one candidate
    assert [p.label for p in frontier(path[0], path)] == ["K4V4", "K8V4", "K8V4g32", "K8V8"]


def test_a_miss_bisects_to_the_cheapest_safer_point_that_meets():
    """Nine candidates; quality on evaluation text meets from the sixth on: chosen, then mids 4 (miss), 6 (meets),
    5 (meets): the sixth is kept, in four checks."""
    path = [_point(f"p{i}", 0.30 + 0.01 * i) for i in range(9)]
    quality = {f"p{i}": 0.99 if i >= 5 else 0.95 for i in range(9)}
    point, fid, checks, checked = _decide(path, quality, max_checks=5)
    assert checked == ["p0", "p4", "p6", "p5"] and point.label == "p5" and fid["top1"] == 0.99
    assert [c["met"] for c in checks] == [False, False, True, True]
    assert [c["met_at_bounds"] for c in checks] == [False, False, True, True]   # 0.99 over 512 clears the bound too


def test_a_chosen_point_that_meets_is_kept_with_one_check():
    path = [_point("K8V4", 0.44), _point("K8V8", 0.56)]
    point, _, checks, checked = _decide(path, {"K8V4": 0.99, "K8V8": 0.99}, max_checks=5)
    assert checked == ["K8V4"] and point.label == "K8V4" and checks[0]["met"]


def test_the_budget_of_checks_bounds_the_bisection():
    path = [_point(f"p{i}", 0.30 + 0.01 * i) for i in range(9)]
    quality = {f"p{i}": 0.99 if i == 8 else 0.95 for i in range(9)}
    point, _, checks, checked = _decide(path, quality, max_checks=3)
    assert checked == ["p0", "p4", "p6"] and not any(c["met"] for c in checks)


def test_nothing_passes_keeps_the_best_checked():
    path = [_point("K8V4", 0.44), _point("K8V4g32", 0.45), _point("K8V8", 0.56)]
    quality = {"K8V4": 0.95, "K8V4g32": 0.96, "K8V8": 0.955}
    point, fid, checks, checked = _decide(path, quality, max_checks=2)
    assert checked == ["K8V4", "K8V4g32"] and not any(c["met"] for c in checks)
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
