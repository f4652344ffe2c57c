"""cuda-python backend foundation: GPU probe, NVRTC -> cubin builds with ptxas reports, the disk cache, launch-argument
packing. Everything but the last test runs without a GPU; compile tests need `pip install kvcal[cuda]`."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_gpu

from kvcal.runtime.backends.cuda import (
    CudaStatus,
    ceil_div,
    compile_kernel,
    cuda_status,
    grid_for,
    kernel_source,
    pack_args,
    parse_params,
    parse_ptxas_report,
)
from kvcal.runtime.storage import quant

SMOKE = "dequant_u4_per_token"
SMOKE_SIG = "const unsigned int* codes, const __half* scale, const __half* zero, __half* out, int n_tokens, int n"
ARCHS = ("sm_80", "sm_90")  # A100 and H100/H200
REGISTER_BUDGET = 64  # per thread; the smoke kernel uses about 20
SPILL_BUDGET = (0, 0)  # (store, load) bytes: a spill in this kernel would mean a codegen regression


# ---------------------------------------------------------------- probe


def test_cuda_status_never_raises_and_explains():
    status = cuda_status()
    assert isinstance(status, CudaStatus)
    assert status.reason and "\n" not in status.reason
    print(f"\ncuda_status: available={status.available} reason={status.reason!r} nvrtc={status.nvrtc_version}")
    if not Path("/dev/nvidiactl").exists():  # no NVIDIA driver on this machine
        assert not status.available
    assert cuda_status() is status  # cached


def test_cuda_status_reasons(monkeypatch):
    import kvcal.runtime.backends.cuda as kc

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes `from cuda.bindings import ...` fail
    assert kc._probe() == CudaStatus(False, "cuda-python is not installed (`pip install kvcal[cuda]`)")
    monkeypatch.undo()

    monkeypatch.setenv("KVCAL_DISABLE_CUDA", "1")
    assert kc._probe().reason == "disabled by `KVCAL_DISABLE_CUDA`"
    monkeypatch.delenv("KVCAL_DISABLE_CUDA")

    def boom():
        raise OSError("weird\nsecond line")

    monkeypatch.setattr(kc, "_probe", boom)
    status = kc.cuda_status.__wrapped__()  # the uncached body
    assert not status.available and status.reason == "CUDA probe failed: OSError: weird"


# ---------------------------------------------------------------- NVRTC builds


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_smoke_kernel(nvrtc_cache, arch):
    mod = compile_kernel(kernel_source("smoke.cu"), [SMOKE], arch, cache_dir=nvrtc_cache, name="smoke")
    assert mod.cubin[:4] == b"\x7fELF" and mod.arch == arch
    assert mod.symbols == {SMOKE: SMOKE}  # extern "C": no mangling
    regs, spills = mod.registers[SMOKE], mod.spills[SMOKE]
    assert 0 < regs <= REGISTER_BUDGET
    assert spills <= SPILL_BUDGET


def test_a_build_prints_nothing_and_logs_its_report_at_debug(nvrtc_cache, capfd, caplog):
    """A build is a library call: its ptxas report goes to the logger at debug level, never to stdout or stderr
    (where it would land between pytest's dots or in a command's JSON)."""
    import logging

    src = kernel_source("smoke.cu") + f"\n// quiet test {nvrtc_cache.name}\n"     # unique source: a real compile
    with caplog.at_level(logging.DEBUG, logger="kvcal.runtime.backends.cuda.build"):
        mod = compile_kernel(src, [SMOKE], "sm_80", cache_dir=nvrtc_cache, name="smoke")
        compile_kernel(src, [SMOKE], "sm_80", cache_dir=nvrtc_cache, name="smoke")          # and a cache hit
    out, err = capfd.readouterr()             # file descriptors: NVRTC's own writes would show here too
    assert out == "" and err == ""
    report = [r for r in caplog.records if f"{SMOKE} {mod.registers[SMOKE]} registers" in r.getMessage()]
    assert len(report) == 2 and all(r.levelno == logging.DEBUG for r in report)
    assert report[0].getMessage().startswith("smoke sm_80: ")


def test_compile_template_kernel_maps_mangled_names(nvrtc_cache):
    src = r"""
    template <int BITS> __global__ void fill(unsigned char* out) { out[threadIdx.x] = (1 << BITS) - 1; }
    template __global__ void fill<4>(unsigned char*);
    extern "C" __global__ void plain(float* x) { x[threadIdx.x] *= 2.f; }
    """
    mod = compile_kernel(src, ["fill<4>", "plain"], "sm_90", cache_dir=nvrtc_cache, name="tmpl")
    assert mod.symbols["fill<4>"].startswith("_Z") and mod.symbols["plain"] == "plain"
    assert set(mod.registers) == {"fill<4>", "plain"} and set(mod.spills) == {"fill<4>", "plain"}


def test_disk_cache_hits_and_misses(nvrtc_cache):
    src = kernel_source("smoke.cu") + f"\n// cache test {nvrtc_cache.name}\n"  # unique source: a guaranteed first miss
    first = compile_kernel(src, [SMOKE], "sm_90", cache_dir=nvrtc_cache)
    again = compile_kernel(src, [SMOKE], "sm_90", cache_dir=nvrtc_cache)
    assert not first.cache_hit and again.cache_hit
    assert again.cubin == first.cubin and again.registers == first.registers and again.key == first.key
    assert (nvrtc_cache / f"{first.key}.cubin").read_bytes() == first.cubin
    assert not list(nvrtc_cache.glob(".*.tmp"))  # atomic writes leave no temp files behind

    changed = compile_kernel(src + "// v2\n", [SMOKE], "sm_90", cache_dir=nvrtc_cache)
    assert not changed.cache_hit and changed.key != first.key
    other_opts = compile_kernel(src, [SMOKE], "sm_90", cache_dir=nvrtc_cache, options=["-DKVCAL_UNUSED=1"])
    assert not other_opts.cache_hit and other_opts.key != first.key

    (nvrtc_cache / f"{first.key}.json").write_text("{ not json")  # a corrupt entry is rebuilt, not fatal
    rebuilt = compile_kernel(src, [SMOKE], "sm_90", cache_dir=nvrtc_cache)
    assert not rebuilt.cache_hit and rebuilt.cubin == first.cubin


def test_cache_dir_defaults_to_kvcal_cache(nvrtc_cache, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE", str(nvrtc_cache / "root"))
    mod = compile_kernel(kernel_source("smoke.cu"), [SMOKE], "sm_80")
    assert (nvrtc_cache / "root" / "cuda" / f"{mod.key}.cubin").exists()


def test_compile_error_raises_with_log(nvrtc_cache):
    bad = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_thing; }'
    with pytest.raises(RuntimeError, match="undefined_thing") as exc:
        compile_kernel(bad, ["broken"], "sm_90", cache_dir=nvrtc_cache, name="broken")
    assert "broken.cu" in str(exc.value)
    with pytest.raises(RuntimeError, match="no_such_kernel"):
        compile_kernel(kernel_source("smoke.cu"), ["no_such_kernel"], "sm_90", cache_dir=nvrtc_cache)
    with pytest.raises(ValueError, match="sm_90"):
        compile_kernel(kernel_source("smoke.cu"), [SMOKE], "compute_90", cache_dir=nvrtc_cache)


def test_parse_ptxas_report_counts_callee_spills():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperf
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'kern' for 'sm_90'
ptxas info    : Function properties for kern
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem"""
    regs, spills = parse_ptxas_report(log)
    assert regs == {"kern": 40}
    assert spills == {"_Z6helperf": (8, 4), "kern": (0, 0)}


# ---------------------------------------------------------------- launch arguments


def test_parse_params():
    p = parse_params(SMOKE_SIG)
    assert [x.ctype for x in p] == ["const unsigned int*", "const __half*", "const __half*", "__half*", "int", "int"]
    assert [x.name for x in p] == ["codes", "scale", "zero", "out", "n_tokens", "n"]
    assert parse_params(["float* __restrict__", "unsigned"])[1].ctype == "unsigned"
    assert parse_params("const float** rows")[0].pointee == "float*"
    with pytest.raises(ValueError, match="short"):
        parse_params("short n")


def test_pack_scalars_exact_sizes():
    packed = pack_args("int a, unsigned b, float c, long long d", [-3, 2**32 - 1, 0.1, 2**40])
    assert [type(v) for v in packed.values] == [np.int32, np.uint32, np.float32, np.int64]
    assert packed.values[0] == -3 and packed.values[2] == np.float32(0.1)
    pack_args("int n", [np.int64(2**31 - 1)])  # numpy ints are fine when they fit

    for value in (2**31, -(2**31) - 1):
        with pytest.raises(ValueError, match="does not fit int32"):
            pack_args("int n", [value])
    with pytest.raises(ValueError, match="uint32"):
        pack_args("unsigned n", [-1])
    with pytest.raises(TypeError, match="expects an integer"):
        pack_args("int n", [3.0])
    with pytest.raises(TypeError, match="expects an integer"):
        pack_args("int n", [True])
    with pytest.raises(ValueError, match="overflows float32"):
        pack_args("float x", [1e39])
    with pytest.raises(ValueError, match="not exact in float32"):
        pack_args("float x", [2**24 + 1])
    with pytest.raises(TypeError, match="expects a float"):
        pack_args("float x", ["1.0"])
    with pytest.raises(ValueError, match="takes 2 arguments"):
        pack_args("int a, int b", [1])


def test_pack_pointers_from_tensors():
    codes = torch.zeros(4, 16, dtype=torch.uint8)  # [T, n / 2] for n = 32
    scale, zero, out = torch.ones(4, dtype=torch.half), torch.zeros(4, dtype=torch.half), torch.empty(4, 32).half()
    packed = pack_args(SMOKE_SIG, [codes.view(torch.int32), scale, zero, out, 4, 32])
    assert packed.values[0] == codes.data_ptr() and packed.values[3] == out.data_ptr()
    assert all(type(v) is np.uint64 for v in packed.values[:4])
    assert len(packed.tensors) == 4  # kept alive with the packed arguments
    assert pack_args("float* x", [None]).values[0] == 0  # NULL
    assert pack_args("void* x", [codes]).values[0] == codes.data_ptr()  # void* takes any dtype

    with pytest.raises(TypeError, match="torch.float16"):
        pack_args(SMOKE_SIG, [codes.view(torch.int32), scale.float(), zero, out, 4, 32])
    with pytest.raises(TypeError, match="torch.int32"):
        pack_args(SMOKE_SIG, [codes, scale, zero, out, 4, 32])  # uint8 codes must be viewed as 32-bit words
    with pytest.raises(ValueError, match="contiguous"):
        pack_args("float* x", [torch.zeros(4, 4).t()])
    with pytest.raises(TypeError, match="torch.Tensor"):
        pack_args("float* x", [np.zeros(4, np.float32)])


def test_kernel_params_point_at_exact_bytes():
    x = torch.zeros(3)
    addresses, holders = pack_args("float* x, int n, float s", [x, 7, 1.5]).kernel_params()
    assert addresses.dtype == np.uint64 and len(addresses) == 3 and len(holders) == 3
    raw = [ctypes.string_at(int(a), n) for a, n in zip(addresses, (8, 4, 4))]
    assert raw == [x.data_ptr().to_bytes(8, "little"), (7).to_bytes(4, "little"), np.float32(1.5).tobytes()]


def test_grid_math():
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert grid_for(1000, 256) == 4 and grid_for(0, 128) == 0
    assert grid_for(4 * 4096, 128, items_per_thread=8) == 16
    with pytest.raises(ValueError, match="block"):
        grid_for(10, 2048)
    with pytest.raises(ValueError, match="gridDim.x"):
        grid_for(2**40, 32)
    with pytest.raises(ValueError):
        ceil_div(1, 0)


# ---------------------------------------------------------------- GPU


def test_gpu_entry_points_refuse_cleanly_without_gpu(nvrtc_cache):
    from kvcal.runtime.backends.cuda import launch, load_module
    from kvcal.runtime.backends.cuda.build import cuda_core

    mod = compile_kernel(kernel_source("smoke.cu"), [SMOKE], "sm_90", cache_dir=nvrtc_cache)
    cuda_core().ObjectCode.from_cubin(mod.cubin, symbol_mapping=mod.symbols)  # host-side object; no driver needed
    with pytest.raises(ValueError, match="CUDA tensors"):
        launch(None, 1, 32, pack_args("float* x", [torch.zeros(4)]))  # checked before any driver call
    if not cuda_status().available:
        with pytest.raises(RuntimeError, match="cannot load CUDA module"):
            load_module(mod)


@pytest.mark.gpu
@needs_gpu
def test_smoke_kernel_matches_torch_reference(tmp_path):
    from kvcal.runtime.backends.cuda import launch, load_module

    torch.manual_seed(0)
    n_tokens, n = 37, 256  # odd token count exercises the tail block
    x = torch.randn(n_tokens, n) * 3 + 1
    codes, scale, zero = quant.quantize_per_token(x, 4)  # codes [T, n], scale/zero fp16 [T, 1]
    ref = quant.dequantize_per_token(codes, scale, zero, dtype=torch.float16)  # [T, n]

    dev = torch.device("cuda")
    packed_codes = quant.pack(codes, 4).to(dev).view(torch.int32)  # [T, n / 2] u8 -> [T, n / 8] 32-bit words
    out = torch.full((n_tokens, n), float("nan"), dtype=torch.float16, device=dev)
    mod = compile_kernel(kernel_source("smoke.cu"), [SMOKE], cuda_status().arch, cache_dir=tmp_path)
    kernel = load_module(mod).get_kernel(SMOKE)
    args = pack_args(SMOKE_SIG, [packed_codes, scale[:, 0].contiguous().to(dev), zero[:, 0].contiguous().to(dev),
                                 out, n_tokens, n])
    block = 128
    launch(kernel, grid_for(n_tokens * n, block, items_per_thread=8), block, args)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)  # same fp32 mul-then-add, same fp16 rounding
