"""Issue 15: bad inputs and faults, one case per item. A CLI case asserts the exit code, exactly one line on stderr with
no traceback, and that every file which existed before the run is byte-identical after it (sha256 before/after), with
no new files unless the case writes an output on purpose."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import make_model, random_bundle, random_text, read_only_folder, save_model
from typer.testing import CliRunner

from kvcal.cli import app
from kvcal.runtime.bundle import (
    BundleError,
    BundleMismatchError,
    _metadata_hash,
    content_hash,
    load_bundle,
    save_bundle,
)

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--random-tokens", "64", "--text-tokens", "64", "--seq-len", "64", "--dtype", "float32", "-q"]


# ---------------------------------------------------------------------------------------------- helpers


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (dot-files included), by path."""
    out = {}
    for root in roots:
        paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for p in paths:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def rewrite(src: Path, dst: Path, *, meta=None, tensors=None, rehash: bool = True) -> Path:
    """Copy a bundle with edited metadata / tensors. rehash=True recomputes both hashes, as a deliberate forger would;
    rehash=False leaves them, as a hand edit would."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        m = dict(f.metadata())
        ts = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if meta:
        meta(m)
    if tensors:
        tensors(ts)
    if rehash:
        m["tensors.sha256"] = content_hash(ts)
        m["metadata.sha256"] = _metadata_hash(m)
    save_file(ts, str(dst), metadata=m)
    return dst


def edit_model(**changes):
    def edit(m):
        model = json.loads(m["model"])
        model.update(changes)
        m["model"] = json.dumps(model)
    return edit


@dataclass
class Case:
    """A CLI run: `args`; `watch` folders/files whose existing files must stay byte-identical; the expected exit
    code and a phrase the stderr line must contain (for exit 1) or the stdout must contain (exit 0)."""

    args: list[str]
    watch: list[Path]
    code: int = 1
    says: str = ""
    not_says: tuple[str, ...] = ()
    new_files_ok: bool = False
    env: dict = field(default_factory=dict)


def run_case(case: Case, monkeypatch) -> object:
    before = snapshot(*case.watch)
    r = runner.invoke(app, case.args)
    after = snapshot(*case.watch)
    assert r.exit_code == case.code, (r.exit_code, r.output)
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    if case.code == 1:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert case.says in lines[0], lines[0]
        for phrase in case.not_says:
            assert phrase not in lines[0], lines[0]
    else:
        assert case.says in r.stdout, r.stdout
    for path, digest in before.items():
        assert after.get(path) == digest, f"{path} was changed or deleted"
    if not case.new_files_ok:
        assert set(after) == set(before), f"new files: {sorted(set(after) - set(before))}"
    return r


def no_model_load(monkeypatch):
    """Make any model load fail loudly: proves a check ran before the weights were read."""
    import kvcal.profile.calibrate as cal

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(cal, "load_model", refuse)


@pytest.fixture(scope="module")
def env(tiny_dir, text_file, tmp_path_factory):
    """A tiny model folder (with a .git folder and a dot-file, as a cloned model has), a dataset and a bundle."""
    import shutil

    root = tmp_path_factory.mktemp("bad-inputs")
    model = root / "model"
    shutil.copytree(tiny_dir, model)
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (model / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    bundle = root / "tiny.kvcal.safetensors"
    r = runner.invoke(app, ["calibrate", "--model", str(model), "--out", str(bundle), "--dataset", str(text_file),
                            "--no-search", *SMALL])
    assert r.exit_code == 0, r.output
    return {"model": model, "data": text_file, "bundle": bundle, "root": root}


# ---------------------------------------------------------------------------------------------- cases, by item


def item1_out_is_the_models_weights(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(env["model"] / "model.safetensors"),
                 "--dataset", str(env["data"]), *SMALL], [env["model"], env["data"]], says="input of this run")


def item1_out_is_the_dataset(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(env["data"]), "--dataset", str(env["data"]),
                 *SMALL], [env["model"], env["data"]], says="input of this run")


def item1_out_is_another_file(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(notes), "--dataset", str(env["data"]),
                 *SMALL], [tmp_path], says="not a kvcal bundle")


def item1_existing_bundle_needs_overwrite(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    out = tmp_path / "b.kvcal.safetensors"
    out.write_bytes(env["bundle"].read_bytes())
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(out), "--dataset", str(env["data"]),
                 "--no-search", *SMALL], [tmp_path], says="pass `--overwrite`")


def item2_checkpoint_folder_not_made_by_kvcal(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    out = tmp_path / "b.kvcal.safetensors"
    ckpt = tmp_path / "b.kvcal.safetensors.ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "thesis.tex").write_text("years of work")
    (ckpt / "sub" / "data.csv").write_text("1,2,3")
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(out), "--dataset", str(env["data"]),
                 "--no-search", *SMALL], [tmp_path], says="not a kvcal checkpoint folder")


def item3_export_over_the_models_folder(env, tmp_path, monkeypatch):
    return Case(["export", str(env["bundle"]), "--format", "vllm-fp8", "--model", str(env["model"]),
                 "--with-weights", "--overwrite", "--out", str(env["model"])], [env["model"], env["bundle"]],
                says="is `")


def item3_export_inside_the_models_folder(env, tmp_path, monkeypatch):
    return Case(["export", str(env["bundle"]), "--format", "vllm-fp8", "--model", str(env["model"]),
                 "--with-weights", "--overwrite", "--out", str(env["model"] / "fp8")], [env["model"], env["bundle"]],
                says="lies inside")


def item3_export_over_the_working_directory(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work.txt").write_text("mine")
    return Case(["export", str(env["bundle"]), "--format", "manifest", "--overwrite", "--out", "."],
                [tmp_path, env["bundle"]], says="is the working directory")


def item3_export_over_a_folder_holding_the_model(env, tmp_path, monkeypatch):
    return Case(["export", str(env["bundle"]), "--format", "manifest", "--model", str(env["model"]), "--overwrite",
                 "--out", str(env["root"])], [env["model"], env["bundle"]], says="contains")


def item4_out_is_a_folder(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "keep.txt").write_text("keep")
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(tmp_path / "results"), "--dataset",
                 str(env["data"]), *SMALL], [tmp_path], says="is a folder")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def item5_stale_temp_of_a_dead_writer_is_removed(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                              # an output inside the working directory is fine
    out = tmp_path / "scales"
    stale = tmp_path / f".scales.tmp-{_dead_pid()}"
    stale.mkdir()
    (stale / "half.json").write_text("{")
    live = tmp_path / f".scales.tmp-{os.getpid()}x"        # not a kvcal temp name: left alone
    live.write_text("user file")
    r = Case(["export", str(env["bundle"]), "--format", "manifest", "--out", str(out)], [live, env["bundle"]],
             code=0, new_files_ok=True)
    run_case(r, monkeypatch)
    assert not stale.exists() and live.read_text() == "user file" and (out / "manifest.json").is_file()
    # the bundle writer does the same for `.NAME.tmp-PID` files
    b = load_bundle(env["bundle"])
    target = tmp_path / "b.kvcal.safetensors"
    stale_file = tmp_path / f".b.kvcal.safetensors.tmp-{_dead_pid()}"
    stale_file.write_bytes(b"\0" * 100)
    live_file = tmp_path / f".b.kvcal.safetensors.tmp-{os.getppid()}"     # a live process: not removed
    live_file.write_bytes(b"\0" * 10)
    save_bundle(b, target)
    assert not stale_file.exists() and live_file.exists() and load_bundle(target).shape == b.shape


def item6_forged_fingerprint_refused_by_shape(env, tmp_path, monkeypatch):
    lm_model, tok = make_model("llama", num_hidden_layers=3, num_key_value_heads=4)
    forged = random_bundle(lm_model, tok)
    from kvcal.models import fingerprint, read_config

    real_fp = fingerprint(read_config(env["model"]))
    forged.model.fingerprint = real_fp                   # another model's bundle, fingerprint edited to match
    path = save_bundle(forged, tmp_path / "forged.kvcal.safetensors")
    # the runtime refuses it too, before any einsum
    model, _ = make_model("llama")
    from kvcal.runtime.hf import KvcalCache

    with pytest.raises(BundleMismatchError, match="layers, KV heads, head dim"):
        KvcalCache.from_bundle(load_bundle(path), model)
    r = Case(["export", str(path), "--format", "vllm-fp8", "--model", str(env["model"]), "--out",
              str(tmp_path / "fp8")], [tmp_path, env["model"]], says="(layers, KV heads, head dim)")
    run_case(r, monkeypatch)
    r = Case(["export", str(path), "--format", "hf-lowrank-v", "--model", str(env["model"]), "--out",
              str(tmp_path / "lr")], [tmp_path, env["model"]], says="(layers, KV heads, head dim)")
    run_case(r, monkeypatch)
    r = Case(["export", str(path), "--format", "manifest", "--model", str(env["model"]), "--out",
              str(tmp_path / "man")], [tmp_path, env["model"]], says="(layers, KV heads, head dim)")
    run_case(r, monkeypatch)
    return Case(["inspect", str(path), "--model", str(env["model"])], [tmp_path, env["model"]],
                says="(layers, KV heads, head dim)")


def item6_edited_policy_refused(env, tmp_path, monkeypatch):
    def k2v2(m):
        m["policy"] = json.dumps({"high": "K2V2", "low": "K2V2", "window": 64})
    path = rewrite(env["bundle"], tmp_path / "policy.kvcal.safetensors", meta=k2v2, rehash=False)
    return Case(["inspect", str(path)], [tmp_path], says="metadata.sha256")


def item6_old_bundles_still_load(env, tmp_path, monkeypatch):
    """Bundles written before `metadata.sha256` existed (old v1 files) load and serve as before; the shipped artefact
    loads and its settings build a runtime config."""
    from kvcal.runtime.config import CompressionConfig

    shipped = ROOT / "artifacts" / "smollm2-135m.kvcal.safetensors"
    b = load_bundle(shipped)
    assert b.shape == (30, 3, 64) and CompressionConfig.from_dict(b.settings).to_dict() == b.settings
    old = rewrite(env["bundle"], tmp_path / "old.kvcal.safetensors", meta=lambda m: m.pop("metadata.sha256"),
                  rehash=False)
    a, o = load_bundle(env["bundle"]), load_bundle(old)
    assert torch.equal(a.qk_rotation, o.qk_rotation) and a.settings == o.settings
    model, tok = make_model("llama")
    from kvcal.runtime.hf import KvcalCache

    ids = tok(["the a of and to in is it that was"], return_tensors="pt").input_ids
    outs = []
    for bundle in (a, o):
        with torch.no_grad():
            outs.append(model(ids, cache=KvcalCache.from_bundle(bundle, model)).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    return Case(["inspect", str(shipped)], [shipped], code=0, says="smollm2-135m")


def item7_negative_absmax(env, tmp_path, monkeypatch):
    def neg(ts):
        ts["k.absmax"][0, 0] = -1.0
    path = rewrite(env["bundle"], tmp_path / "neg.kvcal.safetensors", tensors=neg)
    return Case(["export", str(path), "--format", "vllm-fp8", "--model", str(env["model"]), "--out",
                 str(tmp_path / "fp8")], [tmp_path], says="`k.absmax` has a value outside")


def item7_recovery_out_of_range(env, tmp_path, monkeypatch):
    def seven(ts):
        ts["fastgen.recovery"][0, 0, 0] = 7.0
    path = rewrite(env["bundle"], tmp_path / "rec.kvcal.safetensors", tensors=seven)
    return Case(["inspect", str(path)], [tmp_path], says="`fastgen.recovery` has a value outside")


def item8_sizes_checked_before_tensors_are_read(env, tmp_path, monkeypatch):
    """A large bundle for a bigger model is refused for a small model from its header alone: no tensor is read."""
    import safetensors

    big_model, tok = make_model("llama", num_hidden_layers=12, head_dim=64)
    path = save_bundle(random_bundle(big_model, tok), tmp_path / "big.kvcal.safetensors")
    real = safetensors.safe_open
    reads = []

    class Counting:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(name)
            return self.f.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    r = run_case(Case(["inspect", str(path), "--model", str(env["model"])], [tmp_path], says="layers, KV heads"),
                 monkeypatch)
    assert reads == [] and r.exit_code == 1
    # a header that promises more bytes than the file holds is refused without reading the data
    data = path.read_bytes()
    cut = tmp_path / "cut.kvcal.safetensors"
    cut.write_bytes(data[:len(data) // 3])
    return Case(["inspect", str(cut)], [tmp_path], says="truncated")


def item9_terminal_escapes_in_metadata(env, tmp_path, monkeypatch):
    name = "\x1b[2J[bold]EVIL[/bold]\x07\x9b1m"
    path = rewrite(env["bundle"], tmp_path / "ansi.kvcal.safetensors", meta=edit_model(name=name))
    r = run_case(Case(["inspect", str(path)], [tmp_path], code=0, says="EVIL"), monkeypatch)
    assert "\x1b" not in r.stdout and "\x9b" not in r.stdout and "\x07" not in r.stdout
    assert "[bold]EVIL[/bold]" in r.stdout                 # markup shown as text, not interpreted
    # the same name in an error message (bundle for another model) is plain too
    other = save_model(tmp_path / "other", "qwen2")
    return Case(["inspect", str(path), "--model", str(other)], [tmp_path], says="[bold]EVIL[/bold]",
                not_says=("\x1b", "\x07"))


def item10_layer_types_are_integers(env, tmp_path, monkeypatch):
    path = rewrite(env["bundle"], tmp_path / "lt.kvcal.safetensors", meta=edit_model(layer_types=[0, 1]))
    return Case(["inspect", str(path)], [tmp_path], says="layer_types")


def item10_calibration_is_a_list(env, tmp_path, monkeypatch):
    path = rewrite(env["bundle"], tmp_path / "cl.kvcal.safetensors",
                   meta=lambda m: m.update(calibration=json.dumps([1, 2])))
    return Case(["inspect", str(path)], [tmp_path], says="`calibration` is a JSON list")


def item10_truncated_model_weights(env, tmp_path, monkeypatch):
    model = save_model(tmp_path / "cut", "llama")
    w = model / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return Case(["calibrate", "--model", str(model), "--out", str(tmp_path / "b.kvcal.safetensors"), "--dataset",
                 str(env["data"]), "--no-search", *SMALL], [tmp_path], says="truncated")


def item10_pickle_weights(env, tmp_path, monkeypatch):
    model = save_model(tmp_path / "pkl", "llama")
    m, _ = make_model("llama")
    torch.save(m.state_dict(), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    return Case(["calibrate", "--model", str(model), "--out", str(tmp_path / "b.kvcal.safetensors"), "--dataset",
                 str(env["data"]), "--no-search", *SMALL], [tmp_path], says="pickle")


def item11_malformed_policy_json(env, tmp_path, monkeypatch):
    path = rewrite(env["bundle"], tmp_path / "pj.kvcal.safetensors", meta=lambda m: m.update(policy="{high: K8"))
    return Case(["inspect", str(path)], [tmp_path], says="metadata `policy` is not valid JSON")


def item12_json_stdout_stays_json_with_warnings(env, tmp_path, monkeypatch):
    """A warning during `calibrate --json` (an unreadable checkpoint) goes to stderr; stdout parses as JSON."""
    out = tmp_path / "b.kvcal.safetensors"
    ckpt = tmp_path / "b.kvcal.safetensors.ckpt"
    ckpt.mkdir()
    (ckpt / "random-tokens.safetensors").write_bytes(b"garbage")
    (ckpt / "kvcal-checkpoint.json").write_text(json.dumps({"files": ["random-tokens.safetensors"]}))
    cmd = [sys.executable, "-m", "kvcal", "calibrate", "--model", str(env["model"]), "--out", str(out), "--dataset",
           str(env["data"]), "--no-search", "--json", *SMALL]
    before = snapshot(env["model"], env["data"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bundle"] == str(out)
    assert "ignoring unreadable checkpoint" in done.stderr and "Traceback" not in done.stderr
    assert snapshot(env["model"], env["data"]) == before and not ckpt.exists()


def item13_jsonl_without_text_field(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"body": "hello"}) + "\n")
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(tmp_path / "b.kvcal.safetensors"),
                 "--dataset", str(data), *SMALL], [tmp_path], says='{"text": "..."}', not_says=("--text-field",))


def item14_binary_jsonl(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    data = tmp_path / "d.jsonl"
    data.write_bytes(bytes(range(256)) * 4)
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(tmp_path / "b.kvcal.safetensors"),
                 "--dataset", str(data), *SMALL], [tmp_path], says=str(data))


def item14_null_text(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": random_text(50)}) + "\n" + json.dumps({"text": None}) + "\n")
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(tmp_path / "b.kvcal.safetensors"),
                 "--dataset", str(data), *SMALL], [tmp_path], says="line 2: `text` is null")


def item14_dataset_too_short_names_a_real_option(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": random_text(20, seed=i)}) for i in range(5)))
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(tmp_path / "b.kvcal.safetensors"),
                 "--dataset", str(data), "--no-search", *SMALL, "--text-tokens", "4096"], [tmp_path],
                says="lower `--text-tokens`")


def item15_max_position_beyond_the_model(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(tmp_path / "b.kvcal.safetensors"),
                 "--dataset", str(env["data"]), "--no-search", *SMALL, "--max-position", "100000000"], [tmp_path],
                says="beyond the model's 512 positions")


def item15_negative_max_position(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(["calibrate", "--model", str(env["model"]), "--out", str(tmp_path / "b.kvcal.safetensors"),
                 "--dataset", str(env["data"]), "--no-search", *SMALL, "--max-position", "-5"], [tmp_path],
                says="`--max-position -5`", not_says=("--random-tokens",))


def item16_usage_error_is_one_line_exit_1(env, tmp_path, monkeypatch):
    r = run_case(Case(["calibrate", "--no-such-option"], [tmp_path], says="No such option"), monkeypatch)
    assert "╭" not in r.output
    return Case(["export", str(env["bundle"])], [tmp_path, env["bundle"]], says="missing option `--format`")


def item17_release_after_inference_mode_generate(env, tmp_path, monkeypatch):
    model, tok = make_model("llama")
    from kvcal.runtime.hf import KvcalCache

    # raw_tokens=0: 13 tokens would stay in the raw phase, which holds no pages to free
    cache = KvcalCache.from_bundle(random_bundle(model, tok), model, raw_tokens=0)
    ids = tok(["the a of and to in is it"], return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.release() > 0


def item18_cache_reusable_after_release(env, tmp_path, monkeypatch):
    model, tok = make_model("llama")
    from kvcal.runtime.hf import KvcalCache

    bundle = random_bundle(model, tok)
    ids = tok(["the a of and to in is it that was for on"], return_tensors="pt").input_ids
    cache = KvcalCache.from_bundle(bundle, model)
    with torch.no_grad():
        first = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
        assert cache.memory()["fp16_bytes"] > 0
        cache.release()
        assert cache.memory()["fp16_bytes"] == 0 and cache.get_seq_length() == 0
        again = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
        fresh = model.generate(ids, cache=KvcalCache.from_bundle(bundle, model), max_new_tokens=6,
                               do_sample=False)
    assert torch.equal(again, fresh) and torch.equal(first, fresh)


# ---------------------------------------------------------------------------------------------- issue 34, by item
# Round two (issue 34): cases named `r2itemN_...`, N the item of that issue. A case returns a `Case` for a CLI run or
# None when it checks by itself (the runtime items).


def _no_load_anywhere(monkeypatch):
    """`no_model_load` for every command: bench and export load through `kvcal.models.load_model`."""
    import kvcal.models

    no_model_load(monkeypatch)

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(kvcal.models, "load_model", refuse)


def _calibrate(env, out, *extra):
    return ["calibrate", "--model", str(env["model"]), "--out", str(out), "--dataset", str(env["data"]), *SMALL, *extra]


def _bench(env, out, *extra):
    return ["bench", "--model", str(env["model"]), "--bundle", str(env["bundle"]), "--out", str(out), "--quick",
            "--dataset", str(env["data"]), *extra]


def r2item1_report_json_linked_to_the_models_weights(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    out = tmp_path / "b.kvcal.safetensors"
    out.write_bytes(env["bundle"].read_bytes())
    (tmp_path / "b.kvcal.report.json").symlink_to(env["model"] / "model.safetensors")
    return Case(_calibrate(env, out, "--overwrite"), [tmp_path, env["model"]], says="is a symbolic link")


def r2item1_report_md_linked_to_a_users_file(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    notes = tmp_path / "notes.md"
    notes.write_text("my notes")
    (tmp_path / "b.kvcal.report.md").symlink_to(notes)
    return Case(_calibrate(env, tmp_path / "b.kvcal.safetensors", "--overwrite"), [tmp_path],
                says="b.kvcal.report.md` (where the run writes its report) is a symbolic link")


def r2item1_bundle_path_is_a_link(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    real = tmp_path / "real.kvcal.safetensors"
    real.write_bytes(env["bundle"].read_bytes())
    (tmp_path / "b.kvcal.safetensors").symlink_to(real)
    return Case(_calibrate(env, tmp_path / "b.kvcal.safetensors", "--no-search", "--overwrite"), [tmp_path],
                says="is a symbolic link")


def r2item2_bench_out_holds_the_users_reports(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    (tmp_path / "bench.md").write_text("# my own notes")
    (tmp_path / "bench.json").write_text("{}")
    return Case(_bench(env, tmp_path), [tmp_path, env["bundle"]], says="pass `--overwrite`")


def r2item2_bench_out_with_other_files_is_refused_even_with_overwrite(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    (tmp_path / "bench.md").write_text("# an earlier bench")
    (tmp_path / "thesis.tex").write_text("years of work")
    return Case(_bench(env, tmp_path, "--overwrite"), [tmp_path, env["bundle"]],
                says="holds files kvcal did not write (`thesis.tex`)")


def r2item2_offload_would_overwrite_offload_md(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    (tmp_path / "offload.md").write_text("mine")
    return Case(["bench", "--offload", "--quick", "--model", str(env["model"]), "--out", str(tmp_path)], [tmp_path],
                says="already holds `offload.md`")


def r2item2_bench_out_is_an_existing_file(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    return Case(_bench(env, notes), [tmp_path, env["bundle"]], says="is a file")


def r2item2_bench_report_linked_to_a_users_file(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    notes = tmp_path / "notes.md"
    notes.write_text("mine")
    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.md").symlink_to(notes)
    return Case(_bench(env, out, "--overwrite"), [tmp_path], says="is a symbolic link")


def r2item2_overwrite_replaces_only_the_reports_of_this_run(env, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))           # the profiler's cache, outside `--out`
    out = tmp_path / "out"
    out.mkdir()
    (out / "offload.md").write_text("an earlier run")
    (out / "bench.md").write_text("an earlier bench")
    args = ["bench", "--offload", "--quick", "--model", str(env["model"]), "--out", str(out), "-q"]
    run_case(Case(args, [out], says="already holds `offload.md`"), monkeypatch)
    run_case(Case([*args, "--overwrite"], [out / "bench.md"], code=0, says="report:"), monkeypatch)
    assert "an earlier run" not in (out / "offload.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["bench.md", "offload.json", "offload.md"]


def r2item3_two_calibrations_race_on_one_out(env, tmp_path, monkeypatch):
    """Two real processes, held at their final write until both are there (KVCAL_TEST_WRITE_BARRIER): one bundle is
    written, the other run fails with one line."""
    out = tmp_path / "b.kvcal.safetensors"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    cmd = [sys.executable, "-m", "kvcal", *_calibrate(env, out, "--no-search", "--threads", "1")]
    run_env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300", "OMP_NUM_THREADS": "1",
               "KVCAL_TEST_WRITE_BARRIER": f"{barrier}:2"}
    before = snapshot(env["model"], env["data"])
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    done = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(code != 0 for code in codes) == [False, True], (codes, done)
    err = done[codes.index(next(c for c in codes if c != 0))][1]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "already exists" in lines[0], err
    assert len(list(barrier.iterdir())) == 2               # both reached the final write: a race, not a refusal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.kvcal.safetensors", "barrier"]
    assert load_bundle(out).shape and snapshot(env["model"], env["data"]) == before
    # without the barrier: a run started over a finished one is refused before the model loads
    no_model_load(monkeypatch)
    return Case(_calibrate(env, out, "--no-search"), [tmp_path], says="pass `--overwrite`")


def r2item6_export_overwrite_keeps_the_users_files(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    out = tmp_path / "export"
    (out / "sub").mkdir(parents=True)
    (out / "thesis.tex").write_text("years of work")
    (out / "sub" / "data.csv").write_text("1,2,3")
    return Case(["export", str(env["bundle"]), "--format", "vllm-fp8", "--model", str(env["model"]), "--overwrite",
                 "--out", str(out)], [tmp_path, env["bundle"]], says="was not written by kvcal")


def r2item6_export_overwrite_removes_only_what_the_earlier_export_listed(env, tmp_path, monkeypatch):
    out = tmp_path / "m"
    args = ["export", str(env["bundle"]), "--format", "manifest", "--out", str(out)]
    run_case(Case(args, [env["bundle"]], code=0, says="manifest"), monkeypatch)
    (out / "notes.txt").write_text("added by the user")
    run_case(Case([*args, "--overwrite"], [tmp_path, env["bundle"]], says="`notes.txt`, which kvcal did not write"),
             monkeypatch)
    (out / "notes.txt").unlink()
    run_case(Case([*args, "--overwrite"], [env["bundle"]], code=0, says="manifest"), monkeypatch)
    assert sorted(p.name for p in out.iterdir()) == [".kvcal-export.json", "kvcal_bases.safetensors", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def r2item11_folder_named_like_a_bundle(env, tmp_path, monkeypatch):
    """inspect, bench and export name the problem (a folder, not a bundle file), suggest no unrelated file, and the
    `--out` they advise is one calibrate accepts; calibrate's own `--out` of that folder says the same."""
    import re
    import shutil

    from kvcal.safe_paths import check_bundle_out

    _no_load_anywhere(monkeypatch)
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "x.kvcal.safetensors"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((env["model"] / "model.safetensors").read_bytes())
    for args in (["inspect", str(folder)], ["bench", "--bundle", str(folder), "--model", str(env["model"])],
                 ["export", str(folder), "--format", "manifest", "--out", str(tmp_path / "m")]):
        r = run_case(Case(args, [tmp_path], says="is a folder, not a bundle file", not_says=("model.safetensors`",)),
                     monkeypatch)
        advised = re.findall(r"--out (\S+?)`", r.stderr)
        assert advised, r.stderr
        check_bundle_out(Path(advised[0]), inputs=[env["model"]])       # the advice works
    with pytest.raises(BundleError, match="is a folder, not a bundle file"):               # the Python API too
        load_bundle(folder)
    shutil.copyfile(env["bundle"], folder / "tiny.kvcal.safetensors")   # a real bundle inside is the suggestion
    run_case(Case(["inspect", str(folder)], [tmp_path], says="pass a bundle inside it: `x.kvcal.safetensors/tiny"),
             monkeypatch)
    return Case(_calibrate(env, folder), [tmp_path], says="is a folder, not a bundle file; pass a file path")


def r2item12_read_only_folder_calibrate(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only_folder(ro, monkeypatch)
    return Case(_calibrate(env, ro / "b.kvcal.safetensors", "--no-search"), [tmp_path],
                says=f"cannot write in `{ro}` (Permission denied)")


def r2item12_read_only_folder_bench_and_export(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only_folder(ro, monkeypatch)
    run_case(Case(_bench(env, ro / "bench"), [tmp_path, env["bundle"]], says=f"cannot write in `{ro}`"), monkeypatch)
    return Case(["export", str(env["bundle"]), "--format", "vllm-fp8", "--model", str(env["model"]), "--out",
                 str(ro / "fp8")], [tmp_path, env["bundle"]], says=f"cannot write in `{ro}`")


def r2item4_new_batch_size_without_release(env, tmp_path, monkeypatch):
    model, tok = make_model("llama")
    from kvcal.runtime.hf import KvcalCache

    bundle = random_bundle(model, tok)
    tok.padding_side = "left"
    two, three = (tok([random_text(6 + i, seed=i) for i in range(n)], return_tensors="pt", padding=True)
                  for n in (2, 3))
    cache = KvcalCache.from_bundle(bundle, model)
    with torch.no_grad():
        model.generate(**two, cache=cache, max_new_tokens=4, do_sample=False)
        with pytest.raises(ValueError, match=r"call `cache\.release\(\)` before a new batch"):
            model.generate(**three, cache=cache, max_new_tokens=4, do_sample=False)
        cache.release()
        again = model.generate(**three, cache=cache, max_new_tokens=4, do_sample=False)
        fresh = model.generate(**three, cache=KvcalCache.from_bundle(bundle, model), max_new_tokens=4,
                               do_sample=False)
    assert torch.equal(again, fresh)


def r2item5_cache_called_by_another_model(env, tmp_path, monkeypatch):
    model, tok = make_model("llama")
    other, _ = make_model("llama", seed=1)
    from kvcal.runtime.hf import KvcalCache

    cache = KvcalCache.from_bundle(random_bundle(model, tok), model)
    ids = tok(["the a of and to in is it"], return_tensors="pt").input_ids
    with torch.no_grad(), pytest.raises(BundleMismatchError, match="KvcalCache.from_bundle"):
        other.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)      # the README's usage, batch 1
    KvcalCache.from_bundle(random_bundle(other, tok), other)                   # kvcal installed on both
    with torch.no_grad(), pytest.raises(BundleMismatchError, match="another model called it"):
        other.generate(ids, cache=KvcalCache.from_bundle(random_bundle(model, tok), model), max_new_tokens=4,
                       do_sample=False)


def r2item12_prompt_past_positions_warns_once(env, tmp_path, monkeypatch):
    import logging

    from kvcal.runtime.hf import KvcalCache

    model, tok = make_model("llama", max_position_embeddings=24)
    warned = []
    monkeypatch.setattr(logging.getLogger("kvcal.runtime.hf"), "warning", lambda *a: warned.append(a[0] % a[1:]))
    ids = tok([random_text(30)], return_tensors="pt").input_ids
    with torch.no_grad():
        model.generate(ids, cache=KvcalCache.from_bundle(random_bundle(model, tok), model), max_new_tokens=4,
                       do_sample=False)
    assert len(warned) == 1 and "past the model's 24" in warned[0], warned


EVIL = "\x1b[2J[/b]EVIL\x9b1m\x07"          # clears the screen, an unmatched rich tag, a C1 CSI, a bell


def _no_escapes(r) -> None:
    for stream in (r.stdout, r.stderr):
        assert not {"\x1b", "\x9b", "\x07"} & set(stream), repr(stream)


def r2item7_export_shows_metadata_as_text(env, tmp_path, monkeypatch):
    path = rewrite(env["bundle"], tmp_path / "ansi.kvcal.safetensors", meta=edit_model(name=EVIL))
    r = run_case(Case(["export", str(path), "--format", "manifest", "--out", str(tmp_path / "m")], [path], code=0,
                      says="[/b]EVIL\\x9b1m\\x07"), monkeypatch)
    _no_escapes(r)


def r2item7_calibrate_shows_the_model_name_as_text(env, tmp_path, monkeypatch):
    """The model's name (its folder's) in calibrate's summary and its `loading` line (not --quiet): plain text."""
    import shutil

    model = tmp_path / "m\x1b[2J[bold]EVIL\x9b1m\x07"            # a folder name: no `/`, so an opening tag
    shutil.copytree(env["model"], model)
    args = ["calibrate", "--model", str(model), "--out", str(tmp_path / "b.kvcal.safetensors"), "--dataset",
            str(env["data"]), "--no-search", *(a for a in SMALL if a != "-q")]
    r = run_case(Case(args, [tmp_path], code=0, says="m\\x1b[2J[bold]EVIL\\x9b1m\\x07", new_files_ok=True),
                 monkeypatch)
    _no_escapes(r)


def r2item8_calibrate_out_with_markup(env, tmp_path, monkeypatch):
    """An `--out` with `[/b]` (and an escape sequence): the bundle is written and the summary shows the name."""
    monkeypatch.chdir(tmp_path)               # a short relative name: the summary prints it on one line
    out = "x[/b]\x1b[2J.kvcal.safetensors"
    r = run_case(Case(_calibrate(env, out, "--no-search"), [tmp_path, env["model"]], code=0,
                      says="x[/b]\\x1b[2J.kvcal.safetensors", new_files_ok=True), monkeypatch)
    _no_escapes(r)
    assert load_bundle(tmp_path / out).shape


def r2item8_export_out_with_markup(env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_case(Case(["export", str(env["bundle"]), "--format", "manifest", "--out", "e[/b]\x1b[2J"],
                      [tmp_path, env["bundle"]], code=0, says="e[/b]\\x1b[2J", new_files_ok=True), monkeypatch)
    _no_escapes(r)
    assert (tmp_path / "e[/b]\x1b[2J" / "manifest.json").is_file()


def r2item9_target_z_nan(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(_calibrate(env, tmp_path / "b.kvcal.safetensors", "--no-search", "--target-z", "nan"), [tmp_path],
                says="Invalid value for '--target-z': nan is not a finite number; pass a finite number such as 1.5")


def r2item9_inf_in_every_float_option(env, tmp_path, monkeypatch):
    _no_load_anywhere(monkeypatch)
    out = tmp_path / "b.kvcal.safetensors"
    for flag, value in (("--target-ppl-ratio", "inf"), ("--target-top1", "-inf"), ("--key-percentile", "inf")):
        run_case(Case(_calibrate(env, out, "--no-search", flag, value), [tmp_path],
                      says=f"Invalid value for '{flag}': {value} is not a finite number"), monkeypatch)
    run_case(Case(["export", str(env["bundle"]), "--format", "vllm-fp8", "--model", str(env["model"]), "--margin",
                   "nan", "--out", str(tmp_path / "fp8")], [tmp_path, env["bundle"]],
                  says="'--margin': nan is not a finite number; pass a finite number such as 2"), monkeypatch)
    return Case(_calibrate(env, out, "--no-search", "--target-z", "inf"), [tmp_path],
                says="Invalid value for '--target-z': inf is not a finite number")


def r2item9_negative_target_z(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(_calibrate(env, tmp_path / "b.kvcal.safetensors", "--no-search", "--target-z", "-1"), [tmp_path],
                says="`--target-z -1` must be a finite number >= 0")


def _cpu_only_torch(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def r2item10_cuda_device_map_on_cpu_only_torch(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    _cpu_only_torch(monkeypatch)
    return Case(_calibrate(env, tmp_path / "b.kvcal.safetensors", "--no-search", "--device-map", "cuda:3"),
                [tmp_path], says="`--device-map cuda:3`: this torch has no CUDA device")


def r2item10_device_map_nonsense(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(_calibrate(env, tmp_path / "b.kvcal.safetensors", "--no-search", "--device-map", "nonsense"),
                [tmp_path], says="`--device-map nonsense` is neither a placement (auto, ", not_says=("re-copy",))


def r2item10_max_memory_lots(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    _cpu_only_torch(monkeypatch)
    out = tmp_path / "b.kvcal.safetensors"
    # a cap that accelerate would ignore (no placement), and a GPU this machine lacks
    run_case(Case(_calibrate(env, out, "--no-search", "--max-memory", "cpu=2GiB"), [tmp_path],
                  says="add `--device-map auto`"), monkeypatch)
    run_case(Case(_calibrate(env, out, "--no-search", "--device-map", "auto", "--max-memory", "0=1GiB,cpu=2GiB"),
                  [tmp_path], says="`--max-memory 0=1GiB,cpu=2GiB`: this torch has no CUDA device"), monkeypatch)
    return Case(_calibrate(env, out, "--no-search", "--device-map", "auto", "--max-memory", "cpu=lots"), [tmp_path],
                says="`--max-memory cpu=lots`: `lots` is not a size", not_says=("re-copy",))


def r2item12_seq_len_names_the_maximum(env, tmp_path, monkeypatch):
    no_model_load(monkeypatch)
    return Case(_calibrate(env, tmp_path / "b.kvcal.safetensors", "--no-search", "--seq-len", "100000"), [tmp_path],
                says="`--seq-len 100000` is beyond the model's 512 positions (max_position_embeddings in its "
                     "config.json); pass `--seq-len 512` or less")


ROUNDS = {"item": range(1, 19), "r2item": range(1, 13)}       # issue 15's items, then issue 34's
CASES = [f for name, f in sorted(globals().items()) if name.split("_")[0].rstrip("0123456789") in ROUNDS]


@pytest.mark.parametrize("case", CASES, ids=[f.__name__ for f in CASES])
def test_bad_input(case, env, tmp_path, monkeypatch):
    result = case(env, tmp_path, monkeypatch)
    if result is not None:
        run_case(result, monkeypatch)


@pytest.mark.parametrize("prefix", ROUNDS)
def test_every_item_has_a_case(prefix):
    heads = [f.__name__.split("_")[0] for f in CASES]
    items = {int(h.removeprefix(prefix)) for h in heads if h.rstrip("0123456789") == prefix}
    assert items == set(ROUNDS[prefix])


# ---------------------------------------------------------------------------------------------- library-level


def test_checkpoint_clear_deletes_only_what_kvcal_wrote(tmp_path):
    from kvcal.profile.checkpoint import Checkpoint

    ckpt = Checkpoint(tmp_path / "b.ckpt", "key")
    ckpt.save_probes({})
    (ckpt.folder / "mine.txt").write_text("user")
    (ckpt.folder / "sub").mkdir()
    ckpt.clear()
    assert (ckpt.folder / "mine.txt").read_text() == "user" and (ckpt.folder / "sub").is_dir()
    assert not (ckpt.folder / "search.json").exists() and not (ckpt.folder / Checkpoint.MANIFEST).exists()
    with pytest.raises(ValueError, match="not a kvcal checkpoint folder"):
        Checkpoint.check_folder(ckpt.folder)
    # a forged manifest cannot reach outside the folder
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    forged = Checkpoint(tmp_path / "c.ckpt", "key")
    forged.folder.mkdir()
    (forged.folder / Checkpoint.MANIFEST).write_text(json.dumps({"files": ["../outside.txt", str(outside)]}))
    forged.clear()
    assert outside.read_text() == "keep"
    # a folder from before the manifest existed, holding only checkpoint files, is adopted and cleared
    legacy = Checkpoint(tmp_path / "d.ckpt", "key")
    legacy.folder.mkdir()
    (legacy.folder / "random-tokens.safetensors").write_bytes(b"x")
    (legacy.folder / ".search.json.tmp-999999999").write_bytes(b"x")
    Checkpoint.check_folder(legacy.folder)
    legacy.clear()
    assert not legacy.folder.exists()


def test_overwrite_replaces_a_bundle_and_the_run_leaves_no_checkpoint(env, tmp_path):
    out = tmp_path / "b.kvcal.safetensors"
    out.write_bytes(env["bundle"].read_bytes())
    r = runner.invoke(app, ["calibrate", "--model", str(env["model"]), "--out", str(out), "--dataset",
                            str(env["data"]), "--no-search", "--overwrite", "--seed", "3", *SMALL])
    assert r.exit_code == 0, r.output
    assert load_bundle(out).calibration["seed"] == 3 and not (tmp_path / "b.kvcal.safetensors.ckpt").exists()


def test_save_bundle_refuses_to_overwrite_a_non_bundle(env, tmp_path):
    notes = tmp_path / "notes.safetensors"
    notes.write_text("not a bundle")
    with pytest.raises(BundleError, match="not a kvcal bundle"):
        save_bundle(load_bundle(env["bundle"]), notes)
    assert notes.read_text() == "not a bundle"


def test_load_bundle_header_fields(env, tmp_path):
    """Every bundle written now carries a metadata hash that covers the model, calibration and policy blocks."""
    n = struct.unpack("<Q", env["bundle"].read_bytes()[:8])[0]
    meta = json.loads(env["bundle"].read_bytes()[8:8 + n])["__metadata__"]
    assert meta["metadata.sha256"] == _metadata_hash(meta)
    for block in ("model", "calibration", "policy"):
        edited = rewrite(env["bundle"], tmp_path / f"{block}.kvcal.safetensors",
                         meta=lambda m, b=block: m.update({b: m[b].replace("}", ', "x": 1}', 1)}), rehash=False)
        with pytest.raises(BundleError, match="metadata.sha256"):
            load_bundle(edited)
