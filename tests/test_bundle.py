"""Bundle v1: round trip, validation, refusal for another model, atomic writes, calibration checkpoints."""

import json
import os
import struct

import pytest
import torch
from conftest import save_model

from kvcal.models import adapter_for, fingerprint, load_model
from kvcal.profile.calibrate import CalibrationConfig, calibrate
from kvcal.runtime.bundle import SCHEMA_VERSION, BundleError, BundleMismatchError, load_bundle, save_bundle


def _cfg(model_dir, text_file, out, **kw):
    kw = {"search": False, **kw}
    return CalibrationConfig(model=str(model_dir), out=out, random_tokens=256, text_tokens=256, seq_len=64,
                             dataset=str(text_file), dtype="float32", **kw)


@pytest.fixture(scope="module")
def bundle_path(tiny_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "tiny.kvcal.safetensors"
    calibrate(_cfg(tiny_dir, text_file, out, removal_rate=0.1))
    return out


def test_round_trip(bundle_path, tmp_path):
    b = load_bundle(bundle_path)
    assert b.qk_rotation.shape == (2, 2, 16, 16) and b.qk_rotation.dtype == torch.float32
    assert b.qk_rank.dtype == torch.int32 and ((1 <= b.qk_rank) & (b.qk_rank <= 16)).all()
    assert b.calibration["random_tokens"] == 256 and b.calibration["removal_rate"] == 0.1
    assert "ratio" in b.calibration["token_independence"]
    copy = save_bundle(b, tmp_path / "copy.safetensors")
    b2 = load_bundle(copy)
    for name, t in b.tensors().items():
        assert torch.equal(t, b2.tensors()[name]), name
    assert b2.model == b.model and b2.calibration == b.calibration and b2.created == b.created


def test_bundle_for_model_a_refused_for_model_b(bundle_path, tmp_path):
    other = save_model(tmp_path / "other", "llama", num_hidden_layers=3)
    lm = load_model(str(other), dtype="float32")
    with pytest.raises(BundleMismatchError, match="calibrate this model"):
        load_bundle(bundle_path, fingerprint=fingerprint(lm.model.config))
    same_arch = load_model(str(save_model(tmp_path / "same", "llama", seed=1)), dtype="float32")
    load_bundle(bundle_path, fingerprint=fingerprint(same_arch.model.config))   # same architecture: accepted


def test_truncated_file_refused(bundle_path, tmp_path):
    data = bundle_path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 7):
        p = tmp_path / f"cut{cut}.safetensors"
        p.write_bytes(data[:cut])
        with pytest.raises(BundleError) as e:
            load_bundle(p)
        msg = str(e.value)
        assert "\n" not in msg and "kvcal calibrate" in msg


def test_corrupted_bytes_refused(bundle_path, tmp_path):
    data = bytearray(bundle_path.read_bytes())
    data[-50] ^= 0xFF                              # a byte inside the tensor data
    p = tmp_path / "corrupt.safetensors"
    p.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="corrupted"):
        load_bundle(p)


def _rewrite_header(src, dst, edit):
    data = src.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_wrong_schema_and_format_refused(bundle_path, tmp_path):
    p = tmp_path / "schema.safetensors"
    _rewrite_header(bundle_path, p, lambda h: h["__metadata__"].update(schema_version=str(SCHEMA_VERSION + 1)))
    with pytest.raises(BundleError, match="upgrade kvcal"):
        load_bundle(p)
    _rewrite_header(bundle_path, p, lambda h: h["__metadata__"].update(format="other"))
    with pytest.raises(BundleError, match="not a kvcal bundle"):
        load_bundle(p)
    with pytest.raises(BundleError, match="no bundle at"):
        load_bundle(tmp_path / "missing.safetensors")


def test_invalid_contents_refused(bundle_path, tmp_path):
    b = load_bundle(bundle_path)
    b.qk_rotation = b.qk_rotation * 1.01                  # no longer orthonormal
    with pytest.raises(BundleError, match="orthonormal"):
        save_bundle(b, tmp_path / "bad.safetensors")
    b = load_bundle(bundle_path)
    b.v_rank = b.v_rank * 0
    with pytest.raises(BundleError, match=r"v.rank` outside \[1, 16\]"):
        save_bundle(b, tmp_path / "bad.safetensors")
    b = load_bundle(bundle_path)
    b.qk_spectrum = b.qk_spectrum[..., :8].contiguous()
    with pytest.raises(BundleError, match="shape"):
        save_bundle(b, tmp_path / "bad.safetensors")
    b = load_bundle(bundle_path)
    b.qk_rank = b.qk_rank.long()
    with pytest.raises(BundleError, match="dtype"):
        save_bundle(b, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def test_interrupted_write_leaves_no_bundle(bundle_path, tmp_path, monkeypatch):
    import safetensors.torch

    b = load_bundle(bundle_path)
    target = tmp_path / "new.safetensors"

    def half_then_die(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_bundle(b, target)
    assert not target.exists()
    assert os.listdir(tmp_path) == []                    # the temporary file is gone too


def test_interrupted_calibration_resumes(tiny_dir, text_file, tmp_path):
    out = tmp_path / "resume.kvcal.safetensors"
    seen = []

    def stop_in_text_pass(name, done, total):
        seen.append((name, done))
        if name == "calibration-text" and done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(_cfg(tiny_dir, text_file, out), progress=stop_in_text_pass)
    assert not out.exists()
    assert (tmp_path / "resume.kvcal.safetensors.ckpt" / "random-tokens.safetensors").is_file()
    resumed = []
    result = calibrate(_cfg(tiny_dir, text_file, out), progress=lambda n, d, t: resumed.append((n, d)))
    assert resumed[0] == ("random-tokens", 4)            # the finished pass is not repeated
    assert resumed[1] == ("calibration-text", 2)         # the text pass restarts after its last finished window
    # it skipped key-range windows the pass would have kept, so those run again: a bar that starts at 0
    assert ("key-ranges", 0) in resumed
    assert not (tmp_path / "resume.kvcal.safetensors.ckpt").exists()
    # and gives the same statistics as an uninterrupted run, which reads its key-range windows from the text pass
    fresh_seen = []
    fresh = calibrate(_cfg(tiny_dir, text_file, tmp_path / "fresh.kvcal.safetensors"),
                      progress=lambda n, d, t: fresh_seen.append((n, d)))
    assert ("key-ranges", 0) not in fresh_seen and fresh_seen[-1][0] == "key-ranges"
    torch.testing.assert_close(result.bundle.qk_rotation, fresh.bundle.qk_rotation)
    torch.testing.assert_close(result.bundle.v_basis, fresh.bundle.v_basis)
    for name in ("k.range_low", "k.range_high", "qk.smoothing"):
        torch.testing.assert_close(result.bundle.extras[name], fresh.bundle.extras[name])


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text"])
def test_other_families_calibrate(model_type, text_file, tmp_path):
    folder = save_model(tmp_path / model_type, model_type)
    res = calibrate(_cfg(folder, text_file, tmp_path / "b.safetensors"))
    a = adapter_for(load_model(str(folder), dtype="float32").model.config)
    assert res.bundle.shape == (a.num_layers, a.num_kv_heads, a.head_dim)
    if model_type == "gemma3_text":
        assert res.bundle.model.layer_types.count("sliding_attention") == 2
        assert a.sliding_window == 16 and a.scaling == 32 ** -0.5


def test_calibrate_with_search_writes_a_ready_bundle_and_report(tiny_dir, text_file, tmp_path):
    """End to end on a tiny model: the quality model's frontier is probed with the runtime, the chosen point is checked
    on evaluation text, every measurement is recorded, and the Markdown/JSON/PNG report is written beside the
    bundle."""
    from kvcal.profile.report import report_paths
    from kvcal.runtime.cache import CompressionConfig

    out = tmp_path / "searched.kvcal.safetensors"
    res = calibrate(_cfg(tiny_dir, text_file, out, search=True, search_windows=2, search_prompt=48, search_steps=6,
                         eval_windows=2, eval_steps=6, window=8, target_top1=0.5, target_ppl_ratio=1.5))
    b = load_bundle(out)
    search = b.calibration["search"]
    assert len(search["path"]) >= 2 and search["chosen"]["settings"] == res.summary["search"]["chosen"]["settings"]
    assert search["held_out"]["predictions"] == 12
    assert search["chosen"]["stage"] == "confirm" and search["chosen"] in search["decision"]["checks"]
    assert sum(p["stage"] == "probe" for p in search["path"]) <= 6
    assert set(b.settings) >= {"high", "window"}
    CompressionConfig.from_dict(b.settings)                       # the recorded policy is readable by the runtime
    paths = report_paths(out)
    assert all(p.is_file() for p in paths.values())
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert "Every measurement" in paths["md"].read_text()
    assert not (tmp_path / "searched.kvcal.safetensors.ckpt").exists()


def test_offloaded_model_gives_the_same_statistics(tiny_dir, text_file, tmp_path):
    """--device-map auto with a memory cap below the model's size offloads layers to disk; the Gram statistics
    stream per layer regardless, so the bundle matches an in-memory calibration."""
    from kvcal.models import load_model

    lm = load_model(str(tiny_dir), dtype="float32", device_map="auto", max_memory={"cpu": "60KB"})
    assert "disk" in set(lm.model.hf_device_map.values())
    offloaded = calibrate(_cfg(tiny_dir, text_file, tmp_path / "off.safetensors"), lm=lm).bundle
    plain = calibrate(_cfg(tiny_dir, text_file, tmp_path / "plain.safetensors")).bundle
    assert offloaded.model == plain.model
    torch.testing.assert_close(offloaded.qk_spectrum, plain.qk_spectrum, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(offloaded.v_spectrum, plain.v_spectrum, rtol=1e-4, atol=1e-6)
