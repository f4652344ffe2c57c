"""Key codes before and after RoPE: what calibrated (static) per-channel scales and sparse outliers buy, per key bit.

    python experiments/pre_rope_keys.py -m smollm2-135m --json docs/results/pre-rope-keys-smollm2-135m.json

A what-if measurement that decides which key format the runtime should serve next (issue 32), before any kernel is
written: it codes keys in the forward pass itself, so formats the store does not have (3 bits, static pre-RoPE
scales, exact outliers) cost a row, not a kernel.

Each row codes every layer's keys one way; values stay exact, so the rows compare keys alone. The model runs
teacher-forced over `--windows` windows of evaluation text (`default:eval`) of `--context` tokens at positions
0.., and the last `--steps` positions are scored against the dense model (KL, top-1, perplexity ratio). As in the
runtime's tiers, a query reads the `--window` newest keys (itself included) exact and older keys coded, and the
first `--sinks` tokens of a window stay exact in every row.

- `post` / `pre`: keys coded as the cache receives them (after RoPE), or before it: un-rotated with the layer's own
  (cos, sin), coded, rotated back. RoPE is linear and orthogonal per pair, so only the code's error moves.
- `page`: one (scale, zero) per channel over pages of 32 tokens (the store's `K…c` keys, KIVI), 8-bit metadata
  (`m8`): + 0.5 bit per element.
- `static`: one (scale, zero) per (layer, KV head, channel), fitted on `--fit-windows` windows of calibration text
  (`default:calib`, at the same positions), nothing per token (KVQuant): the range is the fit's min..max, or with
  `outliers` its (f/2, 1 - f/2) quantiles, and every entry outside it is kept exact (dense-and-sparse), counted at
  16 bits for its value + 8 for its index, plus 8 bits per token for the count.
- predicted keys (AQUA-KV's inter-layer prediction, keys only), fitted by least squares on the same calibration
  windows; only the residual is coded, per page. `chain`: every layer's keys before RoPE from the previous layer's
  coded keys by a dense map with a bias ((H d + 1) × H d floats per layer; decoding a layer needs every layer below
  it). `pairs`: each odd layer from the even layer below by one complex number per (RoPE pair, head, head below),
  which commutes with RoPE, so a runtime can move it onto the query and read the layer below's codes once more
  (no chain, no per-token matrix). The predictors are fixed bytes of the model, reported apart (`predictor_bytes`).
- `values per token` rows code the values instead (keys exact): per token over the whole vector, 8-bit metadata
  (+ 16 / d bits per element), alone or as the residual of a dense map (with a bias) from the previous layer's
  coded values (`chain`) or from the even layer below (`pairs`). Values carry no RoPE, so a runtime could apply a
  `pairs` map to the attention output (W over Σ p·v̂ of the layer below, a second weighted sum over its pages).

- `basis`: the channels a per-page key code works in. `model`: the model's own. `bundle` (post-RoPE only, with
  `--bundle`): the key rotation the runtime serves from a kvcal bundle at full rank (its FDC rotation, smoothing and
  mixing, `storage.bases.served_bases`), keys decoded through its inverse. `pca`: per (layer, KV head), the
  eigenvectors of the fitted keys' Gram in that space, so pre- and post-RoPE keys meet in a rotation of their own;
  `pca-mixed`: the same followed by the runtime's fixed random rotation (the bundle basis's mixing, at full rank).

Quantization is the store's arithmetic at any width: asymmetric min-max, fp16 scale and zero, round half to even;
static ranges are rounded outwards (`quant.static_scale_zero`). Uniform levels throughout.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import time

import torch
import torch.nn.functional as F

from kvcal.data import load_corpus, token_windows
from kvcal.models import load_model
from kvcal.profile.capture import attending_by
from kvcal.runtime.bundle import load_bundle
from kvcal.runtime.config import CompressionConfig
from kvcal.runtime.storage.bases import served_bases

PAGE = 32                    # tokens per per-channel key page (kvcal.profile.allocate.PAGE_TOKENS)
META8_BITS = 16 / PAGE       # an 8-bit (scale, zero) pair per channel per page
OUTLIER_BITS = 16 + 8        # an exact fp16 entry and its index within the vector
BLOCK = 512                  # query rows per attention block (bounds the [heads, BLOCK, S] score tensors)


@dataclasses.dataclass(frozen=True)
class KeyCode:
    """One row: keys coded in `space` ("pre" or "post" RoPE) by `mode` ("page" or "static") at `bits`."""

    space: str
    mode: str
    bits: int
    outliers: float = 0.0    # static only: the fitted share of entries kept exact (0: the range is min..max)
    predictor: str = ""      # page only: "chain" or "pairs", code the residual of a prediction (module docstring)
    side: str = "k"          # "v": code the values instead (per token, keys exact; `space` and `mode` unused)
    basis: str = "model"     # page keys only: "model", "bundle", "pca" or "pca-mixed" (module docstring)

    @property
    def label(self) -> str:
        tail = f" + {self.outliers:.0%} outliers" if self.outliers else ""
        tail += f" {self.predictor}" if self.predictor else ""
        tail += f" in the {self.basis} basis" if self.basis != "model" else ""
        if self.side == "v":
            return f"values per token V{self.bits}{tail}"
        return f"{self.space}-RoPE {self.mode} K{self.bits}{tail}"


ROWS = tuple([KeyCode(space, "page", b) for space in ("post", "pre") for b in (4, 3, 2)]
             + [KeyCode("post", "static", 4)]
             + [KeyCode("pre", "static", b) for b in (4, 3, 2)]
             + [KeyCode("pre", "static", b, 0.01) for b in (4, 3, 2)]
             + [KeyCode("pre", "page", b, predictor=p) for p in ("chain", "pairs") for b in (4, 3, 2)]
             + [KeyCode("", "token", b, predictor=p, side="v") for p in ("", "chain", "pairs") for b in (4, 2)]
             + [KeyCode("post", "page", b, basis="bundle") for b in (4, 2)]
             + [KeyCode(space, "page", b, basis=basis) for basis in ("pca", "pca-mixed") for space in ("post", "pre")
                for b in (4, 2)])

_ROW: contextvars.ContextVar = contextvars.ContextVar("pre_rope_row", default=None)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [B, H, S, d]; cos, sin [B, S, d] as transformers' rotary embeddings give them (halves repeated, times the
    attention scaling a). The inverse divides by cos² + sin² = a², so it undoes a scaled rotation too."""
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    if not inverse:
        return x * cos + rotate_half(x) * sin
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16, then up to the next fp16 where rounding went down."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h).float()


def fp16_down(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h).float()


def round_trip(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int, outward: bool) -> torch.Tensor:
    """x coded on the grid of `bits` over [low, high] (broadcast against x), fp16 scale and zero (rounded to nearest,
    or outwards for a static range); values outside saturate."""
    top = (1 << bits) - 1
    zero = fp16_down(low) if outward else low.to(torch.float16).float()
    step = (high - zero) / top
    scale = fp16_up(step) if outward else step.to(torch.float16).float()
    codes = torch.where(scale > 0, torch.round((x - zero) / scale.clamp_min(1e-30)), 0).clamp(0, top)
    return zero + scale * codes


def page_code(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [B, H, S, d] -> coded per channel over pages of PAGE tokens (a partial last page is its own page)."""
    S = x.shape[2]
    out = torch.empty_like(x)
    for t0 in range(0, S, PAGE):
        page = x[:, :, t0:t0 + PAGE]
        out[:, :, t0:t0 + PAGE] = round_trip(page, page.amin(2, keepdim=True), page.amax(2, keepdim=True), bits, False)
    return out


def token_code(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [B, H, S, d] -> coded per token over the whole vector (the store's values)."""
    return round_trip(x, x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), bits, False)


class Coder:
    """Codes a layer's keys or values for the active row; counts the outlier entries it keeps exact."""

    def __init__(self, ranges: dict, sinks: int):
        self.ranges, self.sinks = ranges, sinks      # ranges[(space, outliers)] = (low, high) [L, H, d]
        self.predictors: dict[tuple, dict] = {}         # (side, "chain" / "pairs") -> layer -> its predictor (Capture)
        self.bases: dict[tuple, tuple] = {}              # (space, basis) -> (R, R^-1), each [L, H, d, d]
        self.previous: torch.Tensor | None = None       # the previous layer's coded keys before RoPE (or values)
        self.kept = self.entries = 0

    def values(self, layer: int, value: torch.Tensor, row: KeyCode) -> torch.Tensor:
        """value [B, H, S, d] -> as `row` stores them: per token, or the residual of a dense prediction from the
        previous (`chain`) or the even (`pairs`) layer's coded values."""
        x = value.float()
        w = self.predictors.get(("v", row.predictor), {}).get(layer)
        guess = predict(self.previous, w, x.shape[1]) if w is not None and self.previous is not None else 0.0
        coded = guess + token_code(x - guess, row.bits)
        coded[:, :, :self.sinks] = x[:, :, :self.sinks]
        self.previous = coded
        return coded

    def __call__(self, layer: int, key: torch.Tensor, cos, sin, row: KeyCode) -> torch.Tensor:
        """key [B, H, S, d] after RoPE -> the keys as `row` stores them, after RoPE."""
        x = rope(key.float(), cos, sin, inverse=True) if row.space == "pre" else key.float()
        if row.predictor and layer in self.predictors[("k", row.predictor)] and self.previous is not None:
            w = self.predictors[("k", row.predictor)][layer]
            guess = predict(self.previous, w, x.shape[1]) if row.predictor == "chain" else \
                predict_pairs(self.previous, w)
            coded = guess + page_code(x - guess, row.bits)
        elif row.mode == "page" and row.basis != "model":
            R, back = (b[layer] for b in self.bases[(row.space, row.basis)])
            coded = torch.einsum("bhse,hed->bhsd", page_code(torch.einsum("bhsd,hde->bhse", x, R), row.bits), back)
        elif row.mode == "page":
            coded = page_code(x, row.bits)
        else:
            low, high = (r[layer][None, :, None] for r in self.ranges[(row.space, row.outliers)])
            coded = round_trip(x, low, high, row.bits, True)
            if row.outliers:
                outside = (x < low) | (x > high)
                coded = torch.where(outside, x, coded)
                self.kept += int(outside[:, :, self.sinks:].sum())
                self.entries += outside[:, :, self.sinks:].numel()
        coded[:, :, :self.sinks] = x[:, :, :self.sinks]
        self.previous = coded
        return rope(coded, cos, sin) if row.space == "pre" else coded


def predict(previous: torch.Tensor, w: torch.Tensor, heads: int) -> torch.Tensor:
    """previous [B, H', S, d'] (a layer's keys) and w [H' d' + 1, H d] -> the next layer's keys [B, H, S, d]."""
    B, _, S, _ = previous.shape
    x = previous.transpose(1, 2).reshape(B, S, -1)
    y = x @ w[:-1] + w[-1]
    return y.reshape(B, S, heads, -1).transpose(1, 2)


def as_complex(x: torch.Tensor) -> torch.Tensor:
    """[..., d] real -> [..., d/2] complex: channel i and i + d/2 are the pair RoPE rotates (rotate_half)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.complex(a, b)


def predict_pairs(previous: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """previous [B, H', S, d] and c complex [d/2, H', H] -> [B, H, S, d]: each RoPE pair of each head, a complex
    combination of the same pair of the previous layer's heads. A complex scalar commutes with the rotation, so the
    prediction is the same before and after RoPE, and attention can apply it to the query instead of the keys."""
    z = torch.einsum("bgsi,igh->bhsi", as_complex(previous), c)
    return torch.cat((z.real, z.imag), dim=-1)


def windowed_attention(query, key, coded, value, coded_value, mask, scaling: float, window: int) -> torch.Tensor:
    """query [B, Hq, S, d], key/coded/value/coded_value [B, H, S, d], mask bool [B, 1, S, S] or None (causal) ->
    [B, S, Hq, d]. A query reads keys and values less than `window` positions back exact, older ones coded."""
    B, Hq, S, _ = query.shape
    g = Hq // key.shape[1]
    values_coded = coded_value is not value
    key, coded, value, coded_value = (t.float().repeat_interleave(g, 1) for t in (key, coded, value, coded_value))
    out = torch.empty(B, Hq, S, value.shape[-1])
    for i0 in range(0, S, BLOCK):
        i1 = min(S, i0 + BLOCK)
        q = query[:, :, i0:i1].float() * scaling
        i = torch.arange(i0, i1)[:, None]
        s = q @ coded[:, :, :i1].transpose(-1, -2)
        lo = max(0, i0 - window + 1)                  # the keys some query of the block reads exact
        near = torch.arange(lo, i1)[None, :] > i - window
        s[..., lo:] = torch.where(near, q @ key[:, :, lo:i1].transpose(-1, -2), s[..., lo:])
        allowed = (torch.arange(i1)[None, :] <= i) if mask is None else mask[:, :, i0:i1, :i1]
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1)
        if not values_coded:
            out[:, :, i0:i1] = p @ value[:, :, :i1]
            continue
        old = p.clone()
        old[..., lo:] = old[..., lo:].masked_fill(near, 0.0)
        out[:, :, i0:i1] = old @ coded_value[:, :, :i1] + (p - old)[..., lo:] @ value[:, :, lo:i1]
    return out.transpose(1, 2).contiguous()


class Probe:
    """The model with keys coded by the active row: per-layer (cos, sin) from a pre-hook on each attention module."""

    def __init__(self, lm, coder: Coder, window: int):
        self.lm, self.coder, self.window = lm, coder, window
        self.rope: dict[int, tuple] = {}
        for layer in lm.model.model.layers:
            layer.self_attn.register_forward_pre_hook(self._keep_rope, with_kwargs=True)

    def _keep_rope(self, module, args, kwargs):
        self.rope[module.layer_idx] = kwargs["position_embeddings"]

    def attention(self, module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
        row = _ROW.get()
        cos, sin = self.rope[module.layer_idx]
        coded, coded_value = key, value
        if isinstance(row, Capture):
            row.add(module.layer_idx, rope(key.float(), cos, sin, inverse=True), key.float(), value.float())
        elif row is not None and row.side == "v":
            coded_value = self.coder.values(module.layer_idx, value, row)
        elif row is not None:
            coded = self.coder(module.layer_idx, key, cos, sin, row)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask > -1
        out = windowed_attention(query, key, coded, value, coded_value, mask, scale, self.window)
        return out.to(query.dtype), None

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, steps: int, row) -> torch.Tensor:
        """ids [B, S] -> float32 log-probabilities [B, steps, V] of the last `steps` positions."""
        with attending_by(self.lm.model, "kvcal_pre_rope_probe", self.attention, "sdpa", _ROW, row):
            out = self.lm.model(input_ids=ids, logits_to_keep=steps, use_cache=False)
        return F.log_softmax(out.logits.float(), dim=-1)


class Capture:
    """A pass that records every layer's keys before and after RoPE, and its values (beyond the sinks), to fit static
    ranges and predictors."""

    def __init__(self, sinks: int):
        self.sinks = sinks
        self.keys: dict[str, dict[int, list]] = {"pre": {}, "post": {}, "v": {}}

    def add(self, layer: int, pre: torch.Tensor, post: torch.Tensor, value: torch.Tensor) -> None:
        for space, k in (("pre", pre), ("post", post), ("v", value)):   # [B, H, S, d] -> [H, B * (S - sinks), d]
            self.keys[space].setdefault(layer, []).append(k[:, :, self.sinks:].transpose(0, 1).flatten(1, 2))

    def predictors(self, space: str = "pre", every: bool = True, ridge: float = 1e-3) -> dict[int, torch.Tensor]:
        """layer -> W [H' d' + 1, H d]: least squares (ridge `ridge` times the mean diagonal) of each layer's keys
        before RoPE (`space` "pre") or values ("v") from the previous layer's, with a bias row, over the fitted tokens;
        every layer from the one below (`every`), or each odd layer from the even one below."""
        flat = {layer: torch.cat(k, dim=1).transpose(0, 1).flatten(1).double()      # [N, H d]
                for layer, k in self.keys[space].items()}
        out = {}
        for layer in sorted(flat)[1::1 if every else 2]:
            x = torch.cat([flat[layer - 1], torch.ones(len(flat[layer - 1]), 1, dtype=torch.float64)], dim=1)
            gram = x.T @ x
            gram += ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=torch.float64)
            out[layer] = torch.linalg.solve(gram, x.T @ flat[layer]).float()
        return out

    def pair_predictors(self, ridge: float = 1e-3) -> dict[int, torch.Tensor]:
        """odd layer -> c complex [d/2, H', H]: `predict_pairs` from the even layer below, least squares per RoPE
        pair (ridge as `predictors`), no bias (a bias before RoPE would turn with the position after it)."""
        z = {layer: as_complex(torch.cat(k, dim=1)).permute(2, 1, 0).to(torch.complex128)    # [d/2, N, H]
             for layer, k in self.keys["pre"].items()}
        out = {}
        for layer in sorted(z)[1::2]:
            x, y = z[layer - 1], z[layer]
            gram = x.mH @ x
            eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
            scale = gram.diagonal(dim1=-2, dim2=-1).real.mean(-1)[:, None, None]
            gram = gram + (ridge * scale + 1e-12) * eye          # + 1e-12: a pair that is 0 on every token
            out[layer] = torch.linalg.solve(gram, x.mH @ y).to(torch.complex64)
        return out

    def pca(self, space: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, R^T), each [L, H, d, d]: per layer and KV head, the eigenvectors of the Gram k^T k of the fitted keys in
        `space` ("pre" or "post"), by descending eigenvalue."""
        grams = torch.stack([(lambda k: k.transpose(1, 2) @ k)(torch.cat(self.keys[space][layer], dim=1).double())
                             for layer in sorted(self.keys[space])])                   # [L, H, d, d]
        R = torch.linalg.eigh(grams).eigenvectors.flip(-1).float()
        return R, R.transpose(-1, -2)

    def ranges(self, outliers: float) -> dict:
        """(space, outliers) -> (low, high) float32 [L, H, d]: min..max, or the (f/2, 1 - f/2) quantiles."""
        out = {}
        for space, per_layer in self.keys.items():
            lows, highs = [], []
            for layer in sorted(per_layer):
                k = torch.cat(per_layer[layer], dim=1).sort(dim=1).values        # [H, N, d]
                n = k.shape[1]
                lo, hi = (int(outliers / 2 * n), n - 1 - int(outliers / 2 * n)) if outliers else (0, n - 1)
                lows.append(k[:, lo])
                highs.append(k[:, hi])
            out[(space, outliers)] = (torch.stack(lows), torch.stack(highs))
        return out


def bundle_basis(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, R^-1), each [L, H, d, d]: the key rotation the runtime serves from the bundle at `path` under its own
    settings at full rank (keys stored as K @ R)."""
    bundle = load_bundle(path)
    config = dataclasses.replace(CompressionConfig.from_dict(bundle.settings), use_ranks=False)
    served = served_bases(bundle.qk_rotation, bundle.v_basis, bundle.qk_rank, bundle.v_rank, config,
                          bundle.extras.get("qk.smoothing")).rotation
    return served, torch.linalg.inv(served.double()).float()


def mixed(rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R M, (R M)^T) for R [L, H, d, d] orthogonal: the runtime's mixing M at full rank (`served_bases`)."""
    L, H, d, _ = rotation.shape
    full = torch.full((L, H), d, dtype=torch.int32)
    out = served_bases(rotation, torch.eye(d).expand(L, H, d, d), full, full, CompressionConfig()).rotation
    return out, out.transpose(-1, -2)


def metrics(dense: torch.Tensor, coded: torch.Tensor, labels: torch.Tensor) -> dict:
    """Log-probabilities [B, T, V] of both models and the next tokens [B, T] -> KL, top-1, perplexity ratio."""
    kl = (dense.exp() * (dense - coded)).sum(-1).mean()
    top1 = (dense.argmax(-1) == coded.argmax(-1)).float().mean()
    nll = lambda lp: -lp.gather(-1, labels[..., None]).mean()     # noqa: E731
    return {"kl": float(kl), "top1": float(top1), "ppl_ratio": float(torch.exp(nll(coded) - nll(dense)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=4096, help="tokens per window (the deployment context)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--steps", type=int, default=256, help="scored positions at the end of each window")
    ap.add_argument("--fit-windows", type=int, default=2, help="calibration windows the static ranges are fitted on")
    ap.add_argument("--window", type=int, default=16, help="newest keys each query reads exact (the high tier)")
    ap.add_argument("--sinks", type=int, default=4, help="first tokens of a window kept exact in every row")
    ap.add_argument("--rows", help="comma-separated row numbers (0-based) to run; default all")
    ap.add_argument("--bundle", help="a kvcal bundle of the model, for the rows in its served key rotation")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(args.model, dtype="float32")
    fit = token_windows(lm.tokenizer, load_corpus("default", "calib"), args.fit_windows, args.context, 0)
    ids = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.windows, args.context + 1, 1)
    inputs, labels = ids[:, :-1], ids[:, -args.steps:]
    coder = Coder({}, args.sinks)
    probe = Probe(lm, coder, args.window)
    t0 = time.perf_counter()
    capture = Capture(args.sinks)
    for w in range(len(fit)):
        probe.logits(fit[w:w + 1], 1, capture)
    picked = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else list(ROWS)
    if any(r.basis == "bundle" for r in picked) and not args.bundle:
        raise SystemExit("rows in the bundle's key rotation need `--bundle PATH` (a bundle of this model)")
    coder.bases = {(r.space, r.basis): bundle_basis(args.bundle) if r.basis == "bundle" else
                   mixed(capture.pca(r.space)[0]) if r.basis == "pca-mixed" else capture.pca(r.space)
                   for r in picked if r.basis != "model"}
    for share in sorted({r.outliers for r in picked if r.mode == "static"}):
        coder.ranges.update(capture.ranges(share))
    wanted = {(r.side, r.predictor) for r in picked}
    coder.predictors = {("k", "chain"): capture.predictors() if ("k", "chain") in wanted else {},
                        ("k", "pairs"): capture.pair_predictors() if ("k", "pairs") in wanted else {},
                        ("v", "chain"): capture.predictors("v") if ("v", "chain") in wanted else {},
                        ("v", "pairs"): capture.predictors("v", every=False) if ("v", "pairs") in wanted else {}}
    del capture
    dense = [probe.logits(inputs[w:w + 1], args.steps, None) for w in range(len(inputs))]
    print(f"fit and dense passes: {time.perf_counter() - t0:.0f} s", flush=True)
    d = lm.model.config.head_dim if getattr(lm.model.config, "head_dim", None) else \
        lm.model.config.hidden_size // lm.model.config.num_attention_heads
    rows = []
    for row in picked:
        t0, coder.kept, coder.entries = time.perf_counter(), 0, 0
        coded = [probe.logits(inputs[w:w + 1], args.steps, row) for w in range(len(inputs))]
        m = metrics(torch.cat(dense), torch.cat(coded), labels)
        share = coder.kept / coder.entries if coder.entries else 0.0
        bits = row.bits + (META8_BITS if row.mode == "page" else 0.0) + (16 / d if row.side == "v" else 0.0) + \
            (share * OUTLIER_BITS + 8 / d if row.outliers else 0.0)
        rows.append({"label": row.label, **dataclasses.asdict(row), "key_bits_per_entry": round(bits, 3),
                     "outlier_share": round(share, 5), **m, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{row.label:44} {bits:5.2f} bits/entry  KL {m['kl']:.4f}  top-1 {m['top1']:.3f}  "
              f"ppl ratio {m['ppl_ratio']:.3f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "context": args.context, "windows": args.windows,
                           "steps": args.steps, "fit_windows": args.fit_windows, "window": args.window,
                           "sinks": args.sinks, "split": "default:eval", "fit_split": "default:calib",
                           "predictor_bytes": {"/".join(name): sum(w.element_size() * w.numel() for w in per.values())
                                               for name, per in coder.predictors.items()},
                           "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
