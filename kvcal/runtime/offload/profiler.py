"""KVPR's profiler (paper §2.1): measure this machine's link and matmul speed at the workload's sizes -> ``Hardware``.

    prof = profile_hardware(batch=1, tokens=4096, hidden=576, kv_dim=192, dtype=torch.float16, device="cuda")
    prof.hardware            # kvpr.Hardware(link_bytes_per_s, matmul_flops_per_s, link_latency_s, kernel_latency_s)

Link: with CUDA, host->device copies from pinned memory timed with CUDA events; without it, a device-local memcpy
(``dst.copy_(src)``) standing in for the link, which is *not* a PCIe number. Sizes are the ones a decode step moves:
X[0:l] (b·l·hidden·p bytes) and KV[l:s] (2·b·(s-l)·kv_dim·p bytes) for a few l. Matmul: the recompute GEMM
``[b·l, hidden] x [hidden, 2·kv_dim]`` (fused W_K|W_V) in the serving dtype, for the same l. Each is the median of
``repeats`` runs after a warm-up; then ``t = latency + size / rate`` is fitted by least squares, so
``Hardware`` gets a sustained rate plus a fixed per-call cost (the cost model's ``link_latency_s`` /
``kernel_latency_s``).

Results are cached as JSON under ``$KVCAL_CACHE/hardware/`` (default ``~/.cache/kvcal``), keyed by the machine's
identity (hostname, CPU model, GPU name, torch version) and the workload shape; a file whose identity differs from
the running machine is ignored and re-measured. The paper profiles once at start (its Limitation 3); so do we.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvcal.runtime.adapters import adapter_for
from kvcal.runtime.backends.cpu.build import cpu_name
from kvcal.runtime.disk_cache import cache_dir
from kvcal.runtime.offload.kvpr import Hardware

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_FRACTIONS = (0.125, 0.25, 0.5, 1.0)   # the l / s at which transfers and GEMMs are timed


def machine_identity(device: str | torch.device = "cpu") -> dict[str, str]:
    """What a cached profile must match: hostname, CPU model, GPU name (or "none"), torch version, device type."""
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return {"hostname": socket.gethostname(), "cpu": cpu_name(), "gpu": gpu, "torch": torch.__version__,
            "device": device.type, "threads": str(torch.get_num_threads())}


@dataclass
class Profile:
    """A measured ``Hardware`` and the raw timings it was fitted from."""

    hardware: Hardware
    identity: dict[str, str]
    workload: dict                                    # batch, tokens, hidden, kv_dim, dtype
    link: list[tuple[int, float]] = field(default_factory=list)     # (bytes, seconds) per transfer size
    matmul: list[tuple[float, float]] = field(default_factory=list)  # (FLOPs, seconds) per GEMM size
    link_kind: str = ""                               # "pcie-h2d-pinned" or "cpu-memcpy (not a PCIe link)"
    source: str = "measured"                          # "measured" or "cache"
    path: str | None = None                           # the cache file

    def to_json(self) -> dict:
        d = asdict(self)
        d["format_version"] = FORMAT_VERSION
        d.pop("source"), d.pop("path")
        return d

    @classmethod
    def from_json(cls, d: dict, path: Path) -> Profile:
        return cls(Hardware(**d["hardware"]), d["identity"], d["workload"], [tuple(x) for x in d["link"]],
                   [tuple(x) for x in d["matmul"]], d["link_kind"], "cache", str(path))


# ---- timing -------------------------------------------------------------------------------------------------------


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs after one warm-up; CUDA timed with events."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_rate(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = latency + size / rate`` over (size, seconds) -> (rate, latency >= 0).

    A non-positive slope (noise swamps the sizes) falls back to the best observed size/time with no latency.
    """
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / var if var > 0 else 0.0
    if slope <= 0:
        return max(p[0] / p[1] for p in points if p[1] > 0), 0.0
    latency = my - slope * mx
    if latency < 0:                                   # refit through the origin
        slope, latency = sum(p[0] * p[1] for p in points) / sum(p[0] ** 2 for p in points), 0.0
    return 1.0 / slope, latency


def measure_link(sizes: list[int], device: torch.device, repeats: int) -> list[tuple[int, float]]:
    """(bytes, seconds) of host->device copies (CUDA, pinned source) or device-local memcpy (CPU)."""
    out = []
    for n in sizes:
        src = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        out.append((n, _median_seconds(lambda d=dst, s=src: d.copy_(s, non_blocking=True), device, repeats)))
    return out


def measure_matmul(rows: list[int], hidden: int, kv_dim: int, dtype: torch.dtype, device: torch.device,
                   repeats: int) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of the recompute GEMM [rows, hidden] x [hidden, 2·kv_dim] at each row count."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(hidden, 2 * kv_dim, generator=g).to(device, dtype)
    out = []
    for m in rows:
        x = torch.randn(m, hidden, generator=g).to(device, dtype)
        out.append((2.0 * m * hidden * 2 * kv_dim, _median_seconds(lambda x=x: x @ w, device, repeats)))
    return out


# ---- cache ---------------------------------------------------------------------------------------------------------


def _cache_path(identity: dict, workload: dict) -> Path:
    key = hashlib.sha256(json.dumps([identity, workload], sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "hardware" / f"{identity['device']}-{key}.json"


def _load(path: Path, identity: dict, workload: dict) -> Profile | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if d.get("format_version") != FORMAT_VERSION or d.get("identity") != identity or d.get("workload") != workload:
        logger.info("ignoring hardware profile %s: another machine, version or workload", path)
        return None
    return Profile.from_json(d, path)


def _save(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1))
    tmp.replace(path)                                 # atomic: a crash never leaves half a profile
    profile.path = str(path)


# ---- entry points ---------------------------------------------------------------------------------------------------


def profile_hardware(*, batch: int, tokens: int, hidden: int, kv_dim: int, dtype: torch.dtype = torch.float16,
                     device: str | torch.device = "cpu", repeats: int = 5, cache: bool = True) -> Profile:
    """Profile link and matmul speed at one workload's sizes (see module docstring); cached unless `cache=False`.

    kv_dim = H_kv·d (one of K or V); sizes use l = s·{1/8, 1/4, 1/2, 1}.
    """
    device = torch.device(device)
    identity = machine_identity(device)
    workload = {"batch": batch, "tokens": tokens, "hidden": hidden, "kv_dim": kv_dim, "dtype": str(dtype)}
    path = _cache_path(identity, workload)
    if cache and (hit := _load(path, identity, workload)) is not None:
        return hit
    p = torch.tensor([], dtype=dtype).element_size()
    ls = sorted({max(1, round(f * tokens)) for f in _FRACTIONS})
    sizes = sorted({batch * l * hidden * p for l in ls} | {2 * batch * l * kv_dim * p for l in ls})
    link = measure_link(sizes, device, repeats)
    matmul = measure_matmul([batch * l for l in ls], hidden, kv_dim, dtype, device, repeats)
    bw, link_lat = fit_rate(link)
    flops, kernel_lat = fit_rate(matmul)
    kind = "pcie-h2d-pinned" if device.type == "cuda" else "cpu-memcpy (not a PCIe link)"
    prof = Profile(Hardware(bw, flops, link_lat, kernel_lat), identity, workload, link, matmul, kind)
    if cache:
        _save(prof, path)
    return prof


def profile_for_model(model, *, batch: int = 1, tokens: int = 4096, device: str | torch.device | None = None,
                      **kwargs) -> Profile:
    """``profile_hardware`` at a model's shapes (hidden size, H_kv·d, parameter dtype)."""
    a = adapter_for(model.config)
    param = next(model.parameters())
    return profile_hardware(batch=batch, tokens=tokens, hidden=a.hidden_size, kv_dim=a.num_kv_heads * a.head_dim,
                            dtype=param.dtype, device=device or param.device, **kwargs)
