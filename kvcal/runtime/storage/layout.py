"""Byte layout of one page: which segment sits where, for one tier format and one head's ranks.

A page belongs to one (sequence, layer, KV head) and holds tokens of one tier (DiffKV §5, "unified page"). Segments,
in order, each starting on a 16-byte boundary (T = tokens per page):

    k      uint8 [T, k_bytes]          K·R[:, :r_k], packed codes (or raw float for 16/32-bit tiers)
    k_meta fp16  [T, k_groups, 2]      (scale, zero) per token and channel group          -- key mode "token"
           fp16  [r_k, 2]              (scale, zero) per channel over the page's tokens    -- key mode "channel"
                                       (formats ending in m8: uint8 scale code, int8 zero code instead of the two
                                       fp16, `quant.meta8_encode`; the same for v_meta)
           (none)                      key mode "static": per-channel (scale, zero) fixed per (layer, KV head),
                                       calibrated offline (bundle `k.range_low/high`), held once by the store
    v      uint8 [T, v_bytes]          V·B[:, :r_v], packed codes
    v_meta fp16  [T, v_groups, 2]      (scale, zero) per token and channel group
    score  fp32  [T]                   cumulative attention probability received (max over the query heads)
    pos    int32 [T]                   cache index of the token; -1 marks an empty or dropped slot

Score and position are *tracked* metadata: a token policy reads them to move or drop the token. A tier whose tokens
can never move or be dropped (the low tier with no pruning and no eviction policy: `CompressionConfig.low_tracked`)
has neither segment (offsets -1): its slots below the section's fill all hold tokens, and attention needs no more.

Raw tiers (16 or 32 bits) store floats and have no meta segments. All offsets are computed here once, in Python, and
handed to every reader and writer (the torch store and the CUDA kernels), so no layout is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.runtime.storage.quant import packed_size

ALIGN = 16
RAW_BITS = (16, 32)
QUANT_BITS = (2, 3, 4, 8)
META_BITS = (16, 8)
K_MODES = ("token", "channel", "static")
_MODE_LETTER = {"token": "", "channel": "c", "static": "s"}
LEVELS = ("uniform", "calibrated")      # a side's codes index 0..2**b-1 (uniform) or the bundle's levels (calibrated)
_LEVELS_LETTER = {"uniform": "", "calibrated": "n"}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class TierFormat:
    """How one tier stores a token. `k_mode` "channel" = KIVI-style per-channel key scales over the page's tokens;
    "static" = per-channel key scales calibrated offline (KVQuant-style), the same for every token of a (layer, KV
    head), so a key is written on its own (any tier, no page grouping) and the page holds its codes only.
    `k_levels` / `v_levels` "calibrated" (an `n` after that side's bits, "non-uniform": `K4cnV2n`): a code indexes
    the bundle's levels of its (layer, KV head, side, bits), x = zero + scale * levels[code], instead of the uniform
    x = zero + scale * code; the pages hold the same bytes either way."""

    k_bits: int = 8                  # 2, 3, 4, 8, or 16/32 for raw floats
    v_bits: int = 4
    k_mode: str = "token"            # "token", "channel" or "static"
    k_group: int | None = None       # channels per (scale, zero) for per-token keys; None = the whole vector
    v_group: int | None = None       # channels per (scale, zero) for values; None = the whole vector
    meta_bits: int = 16              # bits per scale and per zero in the pages: 16 (fp16) or 8 (`quant.meta8_encode`)
    k_levels: str = "uniform"        # "uniform" or "calibrated" (bundle `levels.k.{bits}`)
    v_levels: str = "uniform"        # "uniform" or "calibrated" (bundle `levels.v.{bits}`)

    def __post_init__(self):
        for name, bits in (("k_bits", self.k_bits), ("v_bits", self.v_bits)):
            if bits not in QUANT_BITS + RAW_BITS:
                raise ValueError(f"`{name}={bits}` is not one of {QUANT_BITS + RAW_BITS}")
        if self.k_mode not in K_MODES:
            raise ValueError(f"`k_mode={self.k_mode}` must be one of {', '.join(K_MODES)}")
        if self.k_mode != "token" and self.k_bits in RAW_BITS:
            raise ValueError(f"{self.k_mode} key scales need quantized keys (k_bits 2, 3, 4 or 8)")
        if self.meta_bits not in META_BITS:
            raise ValueError(f"`meta_bits={self.meta_bits}` must be one of {META_BITS}")
        if self.meta_bits != 16 and self.k_bits in RAW_BITS and self.v_bits in RAW_BITS:
            raise ValueError("raw (16/32-bit) tiers have no scales or zeros; drop the `m8` suffix")
        if self.k_mode != "token" and self.k_group is not None:
            raise ValueError(f"`k_group` groups per-token key scales; {self.k_mode} keys have one scale per channel")
        for side, bits, levels in (("K", self.k_bits, self.k_levels), ("V", self.v_bits, self.v_levels)):
            if levels not in LEVELS:
                raise ValueError(f"`{side.lower()}_levels={levels}` must be one of {', '.join(LEVELS)}")
            if levels == "calibrated" and bits in RAW_BITS:
                raise ValueError(f"{side}{bits} stores raw floats, which have no levels; drop the `n` after "
                                 f"`{side}{bits}` or quantize that side (2, 3, 4 or 8 bits)")

    @property
    def name(self) -> str:
        k = f"K{self.k_bits}{_MODE_LETTER[self.k_mode]}{_LEVELS_LETTER[self.k_levels]}"
        v = f"V{self.v_bits}{_LEVELS_LETTER[self.v_levels]}"
        group = f"g{self.v_group}" if self.v_group else ""
        kgroup = f"kg{self.k_group}" if self.k_group else ""
        meta = "m8" if self.meta_bits == 8 else ""
        return f"{k}{v}{group}{kgroup}{meta}"

    @property
    def calibrated(self) -> bool:
        """Whether either side's codes index the bundle's calibrated levels."""
        return "calibrated" in (self.k_levels, self.v_levels)

    @classmethod
    def parse(cls, spec: str) -> TierFormat:
        """'K8V4' -> per-token keys; 'K4cV2' -> per-channel keys over a page; 'K4sV4' -> static (calibrated)
        per-channel keys; 'K16V16' / 'K32V32' -> raw; a suffix 'g32' quantizes values in groups of 32 channels (one
        scale and zero each), 'kg32' the same for per-token keys; an 'n' after a side's bits (and key mode) makes
        its codes index calibrated levels ('K4cnV2n', 'K8V4n')."""
        import re

        m = re.fullmatch(r"[Kk](\d+)([cs]?)(n?)[Vv](\d+)(n?)(?:g(\d+))?(?:kg(\d+))?(m8)?", spec.strip())
        if not m:
            raise ValueError(f"tier `{spec}` must look like K8V4, K4cV2 (c = per-channel keys), K4sV4 (s = static "
                             "calibrated per-channel keys), K8V4g32 (values in groups of 32 channels), K4cV4m8 (8-bit "
                             "scales and zeros), K4cnV2n (n = calibrated levels) or K16V16")
        group = lambda i: int(m.group(i)) if m.group(i) else None      # noqa: E731
        mode = {v: k for k, v in _MODE_LETTER.items()}[m.group(2)]
        levels = lambda i: "calibrated" if m.group(i) else "uniform"   # noqa: E731
        return cls(int(m.group(1)), int(m.group(4)), mode, k_group=group(7), v_group=group(6),
                   meta_bits=8 if m.group(8) else 16, k_levels=levels(3), v_levels=levels(5))

    @property
    def meta_pair_bytes(self) -> int:
        """Bytes of one (scale, zero) pair in the pages."""
        return self.meta_bits // 4


def _groups(n: int, group: int | None) -> int:
    if group is None or group >= n:
        return 1
    if n % group:
        raise ValueError(f"quantization group {group} does not divide the stored rank {n}; use a group that divides "
                         "every rank, or None")
    return n // group


@dataclass(frozen=True)
class PageLayout:
    """Offsets (bytes from the page start) and sizes for one (tier format, r_k, r_v) in pages of `page_bytes`."""

    fmt: TierFormat
    r_k: int
    r_v: int
    page_bytes: int
    tokens: int          # T: tokens per page
    k_bytes: int         # per token
    v_bytes: int
    k_groups: int        # per-token key groups (0 for per-channel or raw keys)
    v_groups: int        # (0 for raw values)
    k_off: int
    k_meta_off: int
    v_off: int
    v_meta_off: int
    score_off: int
    pos_off: int         # score_off, pos_off: -1 when the tier is not tracked
    end: int             # bytes actually used (<= page_bytes)
    tracked: bool = True  # score and position segments present (module docstring)

    @classmethod
    def build(cls, fmt: TierFormat, r_k: int, r_v: int, page_bytes: int, tracked: bool = True) -> PageLayout:
        """The layout with the most tokens per page that fits `page_bytes`."""
        sizes = _sizes(fmt, r_k, r_v)
        k_bytes, v_bytes, k_groups, v_groups = sizes
        T = max(1, page_bytes // (k_bytes + v_bytes + fmt.meta_pair_bytes * (k_groups + v_groups) + 8 * tracked))
        while T > 1 and _offsets(fmt, r_k, sizes, T, tracked)[-1] > page_bytes:   # alignment padding can overflow
            T -= 1
        offs = _offsets(fmt, r_k, sizes, T, tracked)
        if offs[-1] > page_bytes:
            raise ValueError(f"a page of {page_bytes} B cannot hold one {fmt.name} token at ranks ({r_k}, {r_v}); "
                             f"raise `page_bytes` to at least {offs[-1]}")
        return cls(fmt, r_k, r_v, page_bytes, T, *sizes, *offs, tracked)

    @property
    def bytes_per_token(self) -> float:
        """Page bytes per token slot, padding and meta included."""
        return self.page_bytes / self.tokens


def _sizes(fmt: TierFormat, r_k: int, r_v: int) -> tuple[int, int, int, int]:
    """(k_bytes, v_bytes per token, per-token key groups, value groups)"""
    def elem_bytes(bits: int, n: int) -> int:
        return n * bits // 8 if bits in RAW_BITS else packed_size(n, bits)

    k_groups = _groups(r_k, fmt.k_group) if fmt.k_bits in QUANT_BITS and fmt.k_mode == "token" else 0
    v_groups = _groups(r_v, fmt.v_group) if fmt.v_bits in QUANT_BITS else 0
    return elem_bytes(fmt.k_bits, r_k), elem_bytes(fmt.v_bits, r_v), k_groups, v_groups


def _offsets(fmt: TierFormat, r_k: int, sizes: tuple[int, int, int, int], T: int,
             tracked: bool = True) -> tuple[int, ...]:
    """(k_off, k_meta_off, v_off, v_meta_off, score_off, pos_off, end) for T tokens per page"""
    k_bytes, v_bytes, k_groups, v_groups = sizes
    pair = fmt.meta_pair_bytes
    k_meta = r_k * pair if fmt.k_mode == "channel" else T * k_groups * pair
    k_meta_off = _align(T * k_bytes)
    v_off = _align(k_meta_off + k_meta)
    v_meta_off = _align(v_off + T * v_bytes)
    v_end = v_meta_off + T * v_groups * pair
    if not tracked:
        return 0, k_meta_off, v_off, v_meta_off, -1, -1, v_end
    score_off = _align(v_end)
    pos_off = _align(score_off + T * 4)
    return 0, k_meta_off, v_off, v_meta_off, score_off, pos_off, pos_off + T * 4


def default_page_bytes(head_dim: int, fmt: TierFormat, tokens: int = 32, tracked: bool = True) -> int:
    """Page size that holds `tokens` full-rank tokens of `fmt` (DiffKV's geometry: 32 K8V4 tokens per page)."""
    return _offsets(fmt, head_dim, _sizes(fmt, head_dim, head_dim), tokens, tracked)[-1]


def check_sliding_format(fmt: TierFormat) -> None:
    """A sliding format stores each token on its own or its keys per channel over blocks of tokens (KIVI's layout,
    kvcal.runtime.hf.sliding): quantized K and V, on uniform or calibrated levels."""
    if fmt.k_mode == "static" or fmt.k_bits not in QUANT_BITS or fmt.v_bits not in QUANT_BITS:
        raise ValueError(f"sliding-layer format `{fmt.name}` must quantize keys per token or per channel and values "
                         "(e.g. K8V4, K4V4g32, K4cV4g32): static key ranges are calibrated for the paged tiers only")
