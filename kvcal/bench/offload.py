"""`kvcal bench --offload`: KVPR partial recompute, modelled per layer and measured where it can be.

    kvcal bench --offload --quick                       # smollm2-135m; writes bench-smollm2-135m/offload.{json,md}
    kvcal bench --offload --bundle b.kvcal.safetensors  # adds the bundle's compressed bytes per token to the model

Modelled (``kvcal.runtime.offload.kvpr``, per layer, summed over the offloaded layers): decode-step time at l = 0 (plain
offloading), l = l* (the solver's split, per layer) and l = s (recompute everything), for each hardware, schedule,
KV format, batch and context. Hardware: this machine as profiled (``kvcal.runtime.offload.profiler``; without CUDA the
"link" is a CPU memcpy, so those rows are not GPU numbers) and the paper's A100 + PCIe 4.0 x16 nominal figures.

Measured: ``OffloadedCache`` decode steps with split none / auto / full against a plain ``DynamicCache``, batch 1,
greedy, and whether the generated tokens are identical. Without CUDA this is a CPU run with no transfer link: the
time is not a GPU measurement (there is no PCIe to hide, so recompute only adds work).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcal.models import LoadedModel
from kvcal.runtime.offload import kvpr

A100_NOMINAL = kvpr.Hardware(link_bytes_per_s=32 * 2**30, matmul_flops_per_s=312e12)   # paper's testbed, fp16 peak
CPU_NOTE = "CPU, no transfer link: measured time is not a GPU measurement"


@dataclass
class OffloadSettings:
    contexts: tuple[int, ...] = (1024, 4096, 16384)   # modelled context lengths s'
    batches: tuple[int, ...] = (1, 8, 32)             # modelled batch sizes
    modes: tuple[str, ...] = ("pipelined", "row")     # runtime's steady-state reading, and the paper's row schedule
    measure_context: int = 1024                       # measured: prompt tokens
    measure_steps: int = 16                           # measured: decode steps timed (after one warm-up step)
    seed: int = 0

    QUICK = {"contexts": (1024, 4096), "batches": (1, 8), "measure_context": 256, "measure_steps": 4}

    @classmethod
    def preset(cls, quick: bool = False, **overrides) -> OffloadSettings:
        base = dict(cls.QUICK) if quick else {}
        return cls(**{**base, **{k: v for k, v in overrides.items() if v is not None}})


def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def bundle_kv_bytes(bundle, head_dim: int) -> list[float]:
    """Stored K+V bytes per token of each layer (all KV heads) in kvcal's high tier: page bytes per token slot at
    the bundle's ranks, padding and quantization metadata included (tokens demoted to the low tier are smaller)."""
    from kvcal.runtime.cache import CompressionConfig
    from kvcal.runtime.storage.layout import PageLayout

    cfg = CompressionConfig.from_dict(bundle.settings)
    page = cfg.page_size(head_dim)
    L, H, _ = bundle.shape
    return [sum(PageLayout.build(cfg.high, int(bundle.qk_rank[i, h]), int(bundle.v_rank[i, h]), page).bytes_per_token
                for h in range(H)) for i in range(L)]


def modelled(adapter, hw: kvpr.Hardware, x_bytes: float, kv_bytes: list[float] | None, batch: int, tokens: int,
             mode: str) -> dict:
    """One modelled decode step over the offloaded layers: l* per layer and step times at l = 0, l*, s."""
    layers = [i for i in range(adapter.num_layers) if not adapter.is_sliding(i)]
    work = [kvpr.LayerWorkload(batch=batch, tokens=tokens, hidden=adapter.hidden_size, kv_heads=adapter.num_kv_heads,
                               head_dim=adapter.head_dim, x_bytes_per_elem=x_bytes,
                               kv_bytes_per_token=None if kv_bytes is None else kv_bytes[i]) for i in layers]
    splits = kvpr.solve_model(work, hw, mode)
    ms = lambda ts: 1e3 * sum(ts)                                                   # noqa: E731
    return {"batch": batch, "context": tokens, "mode": mode,
            "l_star": [s.l for s in splits],
            "ms_l0": ms(kvpr.step_time(w, hw, 0, mode) for w in work),
            "ms_l_star": ms(s.time_s for s in splits),
            "ms_full": ms(kvpr.step_time(w, hw, tokens, mode) for w in work),
            "reasons": sorted({s.reason for s in splits})}


def _timed_greedy(model, ids: torch.Tensor, cache, steps: int) -> tuple[list[int], float]:
    """Prefill `ids`, then `steps` + 1 greedy steps; (tokens, mean seconds per step over the last `steps`)."""
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        tokens, times = [int(tok)], []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            out = model(input_ids=tok, cache=cache, use_cache=True)
            if ids.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(int(tok))
    return tokens, sum(times[1:]) / steps


def measure(lm: LoadedModel, hw: kvpr.Hardware, context: int, steps: int, mode: str, seed: int) -> dict:
    """Decode ms/step of DynamicCache and OffloadedCache (split none / auto / full), batch 1, greedy."""
    from transformers import DynamicCache

    from kvcal.runtime.offload import OffloadedCache

    model = lm.model
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=g).to(device)
    ref, dense_s = _timed_greedy(model, ids, DynamicCache(config=model.config), steps)
    rows = [{"split": "dense (DynamicCache)", "ms_per_step": 1e3 * dense_s, "same_tokens": True, "l": None}]
    for split in ("none", "auto", "full"):
        with OffloadedCache(model, split=split, hardware=hw, mode=mode) as cache:
            got, secs = _timed_greedy(model, ids, cache, steps)
        used = sorted({l for h in cache.history.values() for l in h})       # distinct l over layers and steps
        rows.append({"split": split, "ms_per_step": 1e3 * secs, "same_tokens": got == ref,
                     "l": f"{used[0]}..{used[-1]}" if len(used) > 1 else str(used[0])})
    return {"device": str(device), "context": context, "steps": steps, "mode": mode, "dtype": str(lm.model.dtype),
            "note": CPU_NOTE if device.type != "cuda" else "measured on the GPU (H2D from pinned host memory)",
            "rows": rows}


def run_offload(lm: LoadedModel, settings: OffloadSettings, bundle=None, status=None) -> dict:
    """Profile, model and measure; returns the report dict that `write_offload_report` writes."""
    from kvcal.runtime.offload.profiler import profile_for_model

    say = status or (lambda msg: None)
    a, model = lm.adapter, lm.model
    device = next(model.parameters()).device
    say("profiling link and matmul speed")
    prof = profile_for_model(model, tokens=max(settings.contexts))
    here = "this GPU (H2D pinned, profiled)" if device.type == "cuda" else "this CPU (memcpy as link, profiled)"
    hardware = [(here, prof.hardware, _elem(model.dtype)), ("A100 + PCIe 4.0 x16 (nominal, paper)", A100_NOMINAL, 2)]
    formats = [("model dtype (uncompressed)", None)]
    if bundle is not None:
        from kvcal.runtime.cache import CompressionConfig

        tier = CompressionConfig.from_dict(bundle.settings).high.name
        formats.append((f"kvcal bundle ({tier} at its ranks)", bundle_kv_bytes(bundle, a.head_dim)))
    rows = []
    for label, hw, p in hardware:
        for fmt, kv in formats:
            for mode in settings.modes:
                for b in settings.batches:
                    for c in settings.contexts:
                        r = modelled(a, hw, p, kv, b, c, mode)
                        rows.append({"hardware": label, "x_bytes_per_elem": p, "kv_format": fmt, **r})
    say(f"measuring decode at {settings.measure_context} tokens on {device}")
    meas = measure(lm, prof.hardware, settings.measure_context, settings.measure_steps, settings.modes[0],
                   settings.seed)
    return {"model": {"name": lm.name, "hidden": a.hidden_size, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
                      "offloaded_layers": sum(not a.is_sliding(i) for i in range(a.num_layers))},
            "settings": asdict(settings),
            "hardware": {"profiled": {**asdict(prof.hardware), "link_kind": prof.link_kind,
                                      "identity": prof.identity, "source": prof.source, "cache": prof.path},
                         "nominal_a100": asdict(A100_NOMINAL)},
            "modelled": rows, "measured": meas,
            "gpu_measured": device.type == "cuda"}


def _ls(ls: list[int]) -> str:
    """Compact per-layer l: 'all 30: 0' or the list."""
    return f"all {len(ls)}: {ls[0]}" if len(set(ls)) == 1 else ",".join(map(str, ls))


def to_markdown(r: dict) -> str:
    h = r["hardware"]["profiled"]
    m = r["model"]
    lines = [f"# KVPR offloading: {m['name']}", "",
             f"hidden {m['hidden']}, {m['kv_heads']} KV heads x {m['head_dim']}, {m['offloaded_layers']} offloaded "
             "layers. Modelled times are per decode step, summed over the offloaded layers "
             "(kvcal.runtime.offload.kvpr); l* is chosen per layer.", "",
             f"Profiled: link {h['link_bytes_per_s'] / 2**30:.2f} GiB/s ({h['link_kind']}), matmul "
             f"{h['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, latencies {h['link_latency_s'] * 1e6:.1f} / "
             f"{h['kernel_latency_s'] * 1e6:.1f} us ({h['source']}).", "",
             "| hardware | KV format | mode | batch | context | l* per layer | ms l=0 | ms l* | ms full | speedup |",
             "|---|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for x in r["modelled"]:
        sp = x["ms_l0"] / x["ms_l_star"] if x["ms_l_star"] else 1.0
        lines.append(f"| {x['hardware']} | {x['kv_format']} | {x['mode']} | {x['batch']} | {x['context']} | "
                     f"{_ls(x['l_star'])} | {x['ms_l0']:.3f} | {x['ms_l_star']:.3f} | {x['ms_full']:.3f} | "
                     f"{sp:.2f}x |")
    zero = sorted({why for x in r["modelled"] for why in x["reasons"] if not why.startswith("balanced")})
    lines += ["", "Mode `row` is the paper's latency model, which leaves X's bytes off the link (optimistic: X and KV "
              "share it); `pipelined` counts both, as this runtime sends them. Why l* = 0 where it is: "
              + "; ".join(zero) + ".", ""]
    mm = r["measured"]
    lines += [f"## Measured ({mm['note']})", "",
              f"{mm['device']}, {mm['dtype']}, batch 1, context {mm['context']}, mean of {mm['steps']} greedy "
              f"decode steps, split solver mode {mm['mode']}.", "",
              "| cache | l used | ms/step | tokens identical to dense |", "|---|---|---:|---|"]
    for x in mm["rows"]:
        lines.append(f"| {x['split']} | {'' if x['l'] is None else x['l']} | {x['ms_per_step']:.2f} | "
                     f"{'yes' if x['same_tokens'] else 'NO'} |")
    lines += ["", "GPU: " + ("measured above." if r["gpu_measured"] else
                             "nothing was measured on a GPU; GPU rows are modelled only."), ""]
    return "\n".join(lines)


OUTPUTS = ("offload.json", "offload.md")


def write_offload_report(r: dict, out_dir: Path, *, overwrite: bool = False) -> dict[str, Path]:
    """offload.json and offload.md in `out_dir` (`write_file`: never through a link; replaced only with
    `overwrite`)."""
    import json

    from kvcal.runtime.files import write_file

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / OUTPUTS[0], "md": out_dir / OUTPUTS[1]}
    write_file(paths["json"], json.dumps(r, indent=2, default=str), overwrite=overwrite)
    write_file(paths["md"], to_markdown(r), overwrite=overwrite)
    return paths
