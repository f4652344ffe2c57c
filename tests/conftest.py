"""Shared fixtures: tiny random-init models of each supported family, built from configs (no downloads), saved as
Hugging Face folders with a small word-level tokenizer so the CLI can load them like any user model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

WORDS = ("the a of and to in is it that was for on are as with his they at be this from have or by one had not "
         "but what all were when we there can an your which their said if do will each about how up out them then "
         "she many some so these would other into has more her two like him see time could no make than first been "
         "its who now people my made over did down only way find use may water long little very after words called "
         "just where most know get through back much before go good new write our used me man too any day same right "
         "look think also around another came come work three word must because does part even place well such").split()

TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, sliding_window=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        query_pre_attn_scalar=32, rope_theta=10000.0),
}


def gpu_skip_reason() -> str:
    """Why the CUDA kernels cannot run here ("" where they can): the cuda-python probe, then torch's CUDA."""
    from kvcal.runtime.backends.cuda import cuda_status

    status = cuda_status()
    if not status.available:
        return f"cuda-python backend unavailable: {status.reason}"
    return "" if torch.cuda.is_available() else "torch has no CUDA (CPU build of torch)"


needs_gpu = pytest.mark.skipif(bool(gpu_skip_reason()), reason=gpu_skip_reason() or "GPU available")


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def make_model(model_type: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=2,
                               **{**TINY[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return model, tok


def save_model(folder, model_type: str = "llama", seed: int = 0, **overrides):
    model, tok = make_model(model_type, seed, **overrides)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def random_text(n_words: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(WORDS), (n_words,), generator=g)
    return " ".join(WORDS[i] for i in idx)


def smollm2_or_skip():
    """The packaged smollm2-135m in float32 (a LoadedModel), or a skip naming why it cannot load."""
    from kvcal.models import load_model

    try:
        return load_model("smollm2-135m", dtype="float32")
    except ValueError as e:
        pytest.skip(f"smollm2-135m unavailable: {e}")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama-family model folder (2 layers, 4 query / 2 KV heads, head dim 16)."""
    return save_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A .jsonl dataset of word-salad documents for the tiny models."""
    import json

    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": random_text(300, seed=i)}) for i in range(40)))
    return path


@pytest.fixture(scope="session")
def nvrtc_cache(tmp_path_factory):
    """One NVRTC build-cache folder for every CUDA test, so NVRTC unpacks its bundled headers (26 MB) once; the test
    skips where NVRTC is missing."""
    from kvcal.runtime.backends.cuda import nvrtc_version

    try:
        nvrtc_version()
    except RuntimeError as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    return tmp_path_factory.mktemp("kvcal-cuda-cache")


def random_bundle(model, tok, rank_k=None, rank_v=None, seed=0):
    """A valid bundle for `model` with random orthonormal bases: the runtime's math and the exports must hold for any
    rotation."""
    from kvcal.models import adapter_for, fingerprint, tokenizer_hash, weights_hash
    from kvcal.profile.rotation import eig_basis
    from kvcal.runtime.bundle import Bundle, ModelInfo

    a = adapter_for(model.config)
    L, H, d = a.num_layers, a.num_kv_heads, a.head_dim
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, L, H, d, d, generator=g, dtype=torch.float64)
    (R, sr), (Bv, sv) = eig_basis(x[0] @ x[0].transpose(-1, -2)), eig_basis(x[1] @ x[1].transpose(-1, -2))
    full = torch.full((L, H), d, dtype=torch.int32)
    return Bundle(
        model=ModelInfo(name="tiny", fingerprint=fingerprint(model.config), weights_hash=weights_hash(model, a),
                        tokenizer_hash=tokenizer_hash(tok), family=a.family, num_layers=L, num_kv_heads=H,
                        num_q_heads=a.num_q_heads, head_dim=d, layer_types=list(a.layer_types)),
        qk_rotation=R.float(), qk_spectrum=sr.float(), qk_rank=full if rank_k is None else rank_k,
        v_basis=Bv.float(), v_spectrum=sv.float(), v_rank=full if rank_v is None else rank_v,
        qk_source="random-tokens", qk_weighting="trace", v_source="activations-text")


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and a busy machine makes two threads spin (use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def padded_batch(tok, lengths=(40, 23)):
    """Random texts of `lengths` words, left-padded into one batch (the padding a generate call sees)."""
    tok.padding_side = "left"
    return tok([random_text(n, seed=n) for n in lengths], return_tensors="pt", padding=True)


def generate_scored(model, inputs, cache, n: int = 16):
    """Greedy generation of n tokens through `cache`, with each step's logits (`.sequences`, `.scores`)."""
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=n, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, cache=cache)


@torch.inference_mode()
def decode_logits(model, cache, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill ids[:, :prompt] through `cache`, then teacher-force the rest one token per step: logits
    [B, S - prompt + 1, vocab], the prefill's last position first."""
    logits = [model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits, dim=1)


def read_only_folder(folder, monkeypatch) -> None:
    """Make `folder` read-only; as root (who writes anyway) refuse new files there as a read-only mount would."""
    import errno
    from pathlib import Path

    folder.chmod(0o555)
    if os.geteuid() == 0:
        real = os.open

        def read_only(path, *a, **k):
            if Path(path).parent == folder:
                raise PermissionError(errno.EACCES, "Permission denied")
            return real(path, *a, **k)

        monkeypatch.setattr(os, "open", read_only)
