"""Compression settings: one typed object, `CompressionConfig`, and its one codec, `to_dict` / `from_dict`.

The codec is the only reader and writer of a bundle's settings block (`Bundle.settings`, stored under the metadata key
`policy` of bundle format v1; the key keeps its name so that every bundle written before still loads). Keys, in this
order:

    high, low         str    tier formats (`TierFormat.name`, e.g. "K8V4g16", "K4cV2")
    window            int    recent tokens always at high precision (DiffKV W)
    alpha_high        float | null   DiffKV high threshold; null = no tiers
    alpha_low         float  DiffKV low (pruning) threshold; written only with tiers
    threshold_base    str    "length" or "position"; written only when not "length"
    fastgen           {recovery, r_local, r_frequent} | absent (FastGen off)
    qk_removal_rate, v_removal_rate   float  FDC removal rates the bundle's ranks came from; written only when > 0
    page_tokens       int    low-tier tokens per page (the per-channel key group); written only when set
    h2o               {fraction, recent} | absent (off)             token-budget eviction baselines
    snapkv            {fraction, window, kernel, reserve} | absent (off)
    streamingllm      {fraction, sinks} | absent (off)
    sliding           str    tier format of sliding-window layers (keys per token, e.g. "K8V4", or per channel over
                             blocks of `page_tokens` tokens, 32 if unset, e.g. "K4cV4g32"); absent = dense
    low_layers        {layer: str}  low-tier format of these layers instead of `low` (bits where they matter; same
                                    key mode and groups as `low`, other bits); absent = `low` everywhere
    low_heads         {layer: {KV head: str}}  low-tier format of these KV heads instead of their layer's (the same
                                    rule as `low_layers`); absent = per layer
    sliding_layers    {layer: str}  format of these sliding-window layers instead of `sliding`; absent = `sliding`
    sliding_recent    int    newest tokens each quantized sliding-window layer keeps at 16 bits; written only when > 0
    smooth            bool   channel smoothing (bundle `qk.smoothing`: keys / D, queries * D); written only when true
    exact_window      bool   the `window` newest tokens of each paged layer held at 16 bits outside the pages and read
                             exactly (kvcal.runtime.exact_window); written only when true

A key that is absent reads as its default, so bundles written with fewer keys (`kvcal calibrate --no-search` records
only the window) load as before. The removal rates are provenance: the runtime serves the bundle's rank tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from kvcal.runtime.policies import TOKEN_POLICY_CONFIGS
from kvcal.runtime.policies.diffkv import TieringConfig
from kvcal.runtime.policies.fastgen import FastGenConfig
from kvcal.runtime.policies.h2o import H2OConfig
from kvcal.runtime.policies.snapkv import SnapKVConfig
from kvcal.runtime.policies.streamingllm import StreamingLLMConfig
from kvcal.runtime.storage.layout import TierFormat, check_sliding_format, default_page_bytes

SETTINGS_KEYS = ("high", "low", "window", "alpha_high", "alpha_low", "threshold_base", "fastgen", "qk_removal_rate",
                 "v_removal_rate", "page_tokens", "h2o", "snapkv", "streamingllm", "sliding", "low_layers",
                 "low_heads", "sliding_layers", "sliding_recent", "smooth", "exact_window")
@dataclass(frozen=True)
class CompressionConfig:
    """Runtime settings. `CompressionConfig.none()` stores everything exactly (for checks against dense)."""

    high: TierFormat = field(default_factory=lambda: TierFormat(8, 4))            # DiffKV's high tier
    low: TierFormat = field(default_factory=lambda: TierFormat(4, 2, "channel"))  # per-channel keys: outlier-safe
    tiering: TieringConfig = field(default_factory=TieringConfig)   # DiffKV's window and thresholds
    use_ranks: bool = True        # False: store full rank even if the bundle has lower ranks
    rotate: bool = True           # False: no rotation (identity R and B); only meaningful at full rank
    mix: bool = True              # spread energy evenly over the kept coordinates before quantizing (see bases.py)
    smooth: bool = False          # move key range to the queries first (bundle `qk.smoothing`, see bases.py)
    # Pages hold `page_tokens` full-rank low-tier tokens; None: 32 high-tier tokens. A per-channel low tier computes
    # its key scales over one page and keeps up to a page of low tokens waiting at the high tier, so with a raw
    # (fp16) high tier the page must be sized by the low tier, or the waiting tokens cost more than they save.
    page_tokens: int | None = None
    fastgen: FastGenConfig | None = None   # FastGen's per-head patterns on top of the tiers (None: off)
    qk_removal_rate: float = 0.0  # FDC removal rates behind the bundle's ranks (recorded, not applied here)
    v_removal_rate: float = 0.0
    h2o: H2OConfig | None = None                     # token-budget eviction baselines (None: off)
    snapkv: SnapKVConfig | None = None
    streamingllm: StreamingLLMConfig | None = None
    sliding: TierFormat | None = None     # sliding-window layers stored in this format (None: dense, model dtype)
    # (layer, format) pairs, ascending by layer: these layers' low tier in `format` instead of `low`
    low_layers: tuple[tuple[int, TierFormat], ...] = ()
    # (layer, KV head, format) triples, ascending: these KV heads' low tier in `format` instead of their layer's
    low_heads: tuple[tuple[int, int, TierFormat], ...] = ()
    # (layer, format) pairs, ascending by layer: these sliding-window layers in `format` instead of `sliding`
    sliding_layers: tuple[tuple[int, TierFormat], ...] = ()
    sliding_recent: int = 0       # newest tokens a quantized sliding-window layer keeps unquantized (KIVI's residual)
    # the `tiering.window` newest tokens of each paged layer at 16 bits outside the pages, read exactly; a token enters
    # the high tier when it leaves the window (kvcal.runtime.exact_window). False: every new token is written to the
    # high tier's pages, so a quantized high tier also codes each query's nearest predecessors
    exact_window: bool = False

    def __post_init__(self):
        for *where, fmt in (*self.low_layers, *self.low_heads):
            if (fmt.k_mode, fmt.k_group, fmt.v_group) != (self.low.k_mode, self.low.k_group, self.low.v_group) \
                    or self.low.k_mode == "static":
                what = f"layer {where[0]}" + (f", KV head {where[1]}" if len(where) > 1 else "")
                raise ValueError(f"{what}: low tier {fmt.name} must differ from `low` ({self.low.name}) in bits only, "
                                 "with per-token or per-channel keys: choose a format like `low` with other bits")
        for name in ("low_layers", "low_heads", "sliding_layers"):
            where = [tuple(entry[:-1]) for entry in getattr(self, name)]
            if where != sorted(set(where)) or any(i < 0 for w in where for i in w):
                raise ValueError(f"`{name}` must list each {'(layer, KV head)' if name == 'low_heads' else 'layer'} "
                                 "once, ascending, from 0")
        for fmt in (self.sliding, *(fmt for _, fmt in self.sliding_layers)):
            if fmt is not None:
                check_sliding_format(fmt)
        if self.sliding_layers and self.sliding is None:
            raise ValueError("`sliding_layers` overrides `sliding` for some layers; set `sliding` too")
        if not isinstance(self.sliding_recent, int) or self.sliding_recent < 0 \
                or (self.sliding_recent and self.sliding is None):
            raise ValueError(f"`sliding_recent={self.sliding_recent!r}` must be a non-negative integer, and 0 unless "
                             "`sliding` quantizes the sliding-window layers")
        if self.smooth and (self.static_keys or not self.rotate):
            raise ValueError("channel smoothing (`smooth`) scales the rotated key coordinates: serve it with "
                             "`rotate=True` and without static (K…s) key tiers")
        if self.page_tokens is not None and (not isinstance(self.page_tokens, int) or self.page_tokens < 1):
            raise ValueError(f"`page_tokens={self.page_tokens!r}` must be a positive integer (low-tier tokens per "
                             "page)")

    @classmethod
    def none(cls) -> CompressionConfig:
        return cls(high=TierFormat(32, 32), low=TierFormat(32, 32), tiering=TieringConfig(), use_ranks=False,
                   rotate=False)

    @property
    def static_keys(self) -> bool:
        """Whether a tier stores keys with static calibrated per-channel scales (k_mode "static")."""
        return "static" in (self.high.k_mode, self.low.k_mode)

    @property
    def low_tracked(self) -> bool:
        """Whether low-tier pages keep each token's score and position (`layout` module docstring). A low token
        moves only when something drops it: pruning (alpha_low > 0) or a token policy (FastGen, H2O, SnapKV,
        StreamingLLM). Without those its score is never read and its slot's place below the fill is all attention
        needs, so the 8 bytes a token would spend on them are not stored."""
        policies = [getattr(self, name) for name in TOKEN_POLICY_CONFIGS]
        return not self.tiering.tiered or self.tiering.alpha_low > 0 or any(p is not None for p in policies)

    def low_of(self, layer: int, head: int | None = None) -> TierFormat:
        """The low-tier format of KV head `head` of `layer` (`low_heads`, else `low_layers`, else `low`); without a
        head, the layer's (`low_layers`, else `low`)."""
        if head is not None and (layer, head) in (heads := {(la, h): fmt for la, h, fmt in self.low_heads}):
            return heads[(layer, head)]
        return dict(self.low_layers).get(layer, self.low)

    def sliding_of(self, layer: int) -> TierFormat | None:
        """The format of sliding-window `layer` (`sliding` unless `sliding_layers` names the layer; None: dense)."""
        return dict(self.sliding_layers).get(layer, self.sliding)

    @property
    def sliding_spec(self) -> str | None:
        """`sliding` and `sliding_recent` as one spec, "K8V4m8+16" (`split_sliding_spec` reads it); None: dense."""
        if self.sliding is None:
            return None
        return f"{self.sliding.name}+{self.sliding_recent}" if self.sliding_recent else self.sliding.name

    @property
    def formats(self) -> tuple[TierFormat, ...]:
        """Every tier format the cache may store in its pages (what a backend must serve)."""
        return (self.high, self.low, *(fmt for _, fmt in self.low_layers), *(fmt for *_, fmt in self.low_heads))

    @property
    def value_group(self) -> int:
        """Channels per value (scale, zero) group of either tier (1: per token); it must divide each V rank."""
        return max(self.high.v_group or 1, self.low.v_group or 1)

    @property
    def sliding_block(self) -> int:
        """Tokens per key block of a sliding layer with per-channel keys: `page_tokens`, else 32."""
        return self.page_tokens or 32

    def page_size(self, head_dim: int, page_bytes: int | None = None) -> int:
        """Bytes per page for heads of `head_dim` (the arena's one page size, shared by both tiers). page_bytes: an
        explicit size (`ServeOptions.page_bytes`, a serving choice: never in the settings); None: from `page_tokens`,
        else 32 high-tier tokens."""
        if page_bytes:
            return page_bytes
        if self.page_tokens:
            return default_page_bytes(head_dim, self.low, self.page_tokens, self.low_tracked)
        return default_page_bytes(head_dim, self.high)

    def with_(self, **changes) -> CompressionConfig:
        return replace(self, **changes)

    def with_tiering(self, **changes) -> CompressionConfig:
        """A copy whose tiering has `changes` (window, alpha_high, alpha_low, threshold_base)."""
        return replace(self, tiering=replace(self.tiering, **changes))

    # ------------------------------------------------------------------------------------------------ codec

    def to_dict(self, *, searched: bool = True) -> dict:
        """The bundle's settings block (see module docstring). `searched=False`: only the window, for a bundle
        whose settings were not chosen by a search (the runtime's defaults serve it)."""
        p = self.tiering
        if not searched:
            return {"window": p.window}
        out = {"high": self.high.name, "low": self.low.name, "window": p.window, "alpha_high": p.alpha_high}
        if p.tiered:
            out["alpha_low"] = p.alpha_low
        if p.threshold_base != TieringConfig.threshold_base:
            out["threshold_base"] = p.threshold_base
        if self.fastgen is not None:
            out["fastgen"] = asdict(self.fastgen)
        for name in ("qk_removal_rate", "v_removal_rate"):
            if getattr(self, name) > 0:
                out[name] = getattr(self, name)
        if self.page_tokens is not None:
            out["page_tokens"] = self.page_tokens
        for name in ("h2o", "snapkv", "streamingllm"):
            if getattr(self, name) is not None:
                out[name] = asdict(getattr(self, name))
        if self.sliding is not None:
            out["sliding"] = self.sliding.name
        if self.low_layers:
            out["low_layers"] = {str(layer): fmt.name for layer, fmt in self.low_layers}
        for layer, head, fmt in self.low_heads:
            out.setdefault("low_heads", {}).setdefault(str(layer), {})[str(head)] = fmt.name
        if self.sliding_layers:
            out["sliding_layers"] = {str(layer): fmt.name for layer, fmt in self.sliding_layers}
        if self.sliding_recent:
            out["sliding_recent"] = self.sliding_recent
        if self.smooth:
            out["smooth"] = True
        if self.exact_window:
            out["exact_window"] = True
        return out

    @classmethod
    def from_dict(cls, d: dict) -> CompressionConfig:
        """Settings from a bundle's settings block; absent keys keep their defaults, unknown keys are refused."""
        unknown = sorted(set(d) - set(SETTINGS_KEYS))
        if unknown:
            raise ValueError(f"settings key `{unknown[0]}` is not one of {', '.join(SETTINGS_KEYS)}; the bundle was "
                             "written by a newer kvcal: upgrade kvcal")
        base = cls()
        tokens = {k: d[k] for k in ("window", "alpha_high", "alpha_low", "threshold_base") if k in d}
        policies = {name: kind(**d[name]) if d.get(name) else None for name, kind in TOKEN_POLICY_CONFIGS.items()}
        return replace(base, high=TierFormat.parse(d["high"]) if "high" in d else base.high,
                       low=TierFormat.parse(d["low"]) if "low" in d else base.low, tiering=TieringConfig(**tokens),
                       qk_removal_rate=d.get("qk_removal_rate", 0.0), v_removal_rate=d.get("v_removal_rate", 0.0),
                       page_tokens=d.get("page_tokens"),
                       sliding=TierFormat.parse(d["sliding"]) if d.get("sliding") else None,
                       low_layers=_layer_formats(d.get("low_layers", {})),
                       low_heads=_head_formats(d.get("low_heads", {})),
                       sliding_layers=_layer_formats(d.get("sliding_layers", {})),
                       sliding_recent=d.get("sliding_recent", 0), smooth=bool(d.get("smooth")),
                       exact_window=bool(d.get("exact_window")),
                       **policies)


def split_sliding_spec(spec: str) -> tuple[str, int | None]:
    """"K8V4m8+16" -> ("K8V4m8", 16): a sliding-window format and its newest tokens at 16 bits (None without "+")."""
    fmt, plus, recent = spec.partition("+")
    return fmt, int(recent) if plus else None


def _layer_formats(by_layer: dict[str, str]) -> tuple[tuple[int, TierFormat], ...]:
    """{"3": "K4cV2"} (a settings block's per-layer formats) -> ((3, TierFormat), ...) ascending by layer."""
    return tuple(sorted((int(layer), TierFormat.parse(name)) for layer, name in by_layer.items()))


def _head_formats(by_layer: dict[str, dict[str, str]]) -> tuple[tuple[int, int, TierFormat], ...]:
    """{"3": {"1": "K4cV2"}} (a settings block's per-head formats) -> ((3, 1, TierFormat), ...) ascending."""
    return tuple(sorted((int(layer), int(head), TierFormat.parse(name))
                        for layer, heads in by_layer.items() for head, name in heads.items()))
