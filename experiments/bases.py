"""Which rotation and which V basis? Attention-logit error and V reconstruction error on held-out text.

    python experiments/bases.py --model smollm2-135m [--json out.json]

Candidates for the post-RoPE rotation R (one per KV head):
  * weighting of Q vs K rows in the Gram: fdc (stacked rows), mean (mean row Grams), trace (equal energy);
  * source: random tokens at positions spread over the model's context (kvcal's default), random tokens at positions
    0..S-1 only (FDC's protocol), calibration text, or both.
Metric at rank k: relative attention-logit error over causal pairs on held-out text (not used for calibration),
    sum_{i>=j} ((q_i P)(k_j P)^T - q_i k_j^T)^2 / sum_{i>=j} (q_i k_j^T)^2,   P = R[:, :k],
averaged over layers and heads, for k = d/4, d/2, 3d/4.

Candidates for the V basis: activation PCA on text, activation PCA on random tokens, SVD of W_V (FDC/Palu).
Metric at rank k: relative V reconstruction error on held-out text, 1 - tr(P^T G P) / tr(G) with G the held-out V Gram.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvcal.data import load_corpus, position_offsets, random_token_windows, token_windows
from kvcal.models import load_model
from kvcal.profile.capture import GramCollector
from kvcal.profile.passes import run_pass
from kvcal.profile.rotation import QK_WEIGHTINGS, eig_basis, qk_gram, token_independence, weight_svd_basis


class LogitError:
    """Per candidate rotation and rank: the squared logit error and the squared logits, over causal pairs."""

    def __init__(self, rotations: dict[str, torch.Tensor], ranks: list[int], group: int):
        self.rotations, self.ranks, self.group = rotations, ranks, group
        self.err = {(name, k): 0.0 for name in rotations for k in ranks}
        self.total = 0.0

    @torch.no_grad()
    def add(self, layer, query, key, value):
        B, H, S, d = key.shape
        q = query.float().view(B, H, self.group, S, d)
        k = key.float()
        causal = torch.ones(S, S).tril()                                     # [S, S] weights 1 on pairs i >= j
        exact = torch.einsum("bhgsd,bhtd->bhgst", q, k)
        self.total += (exact.pow(2) * causal).sum().item()
        for name, R in self.rotations.items():
            Rl = R[layer].float()                                            # [H, d, d]
            qr = torch.einsum("bhgsd,hde->bhgse", q, Rl)
            kr = torch.einsum("bhtd,hde->bhte", k, Rl)
            for rank in self.ranks:
                approx = torch.einsum("bhgse,bhte->bhgst", qr[..., :rank], kr[..., :rank])
                self.err[(name, rank)] += ((approx - exact).pow_(2) * causal).sum().item()

    def result(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for (name, rank), e in self.err.items():
            out.setdefault(name, {})[rank] = e / self.total
        return out


def v_error(basis: torch.Tensor, gram: torch.Tensor, rank: int) -> float:
    """1 - tr(P^T G P) / tr(G), averaged over layers and heads."""
    P = basis[..., :rank].double()
    kept = torch.einsum("lhdk,lhde,lhek->lh", P, gram, P)
    total = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1)
    return (1 - kept / total).mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per calibration pass")
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    lm = load_model(args.model)
    a, S = lm.adapter, args.seq_len
    max_pos = min(a.max_positions, 32768)
    rand = random_token_windows(lm.tokenizer, lm.model.config.vocab_size, args.tokens, S, args.seed)
    text = token_windows(lm.tokenizer, load_corpus("default", "calib"), len(rand), S, args.seed)
    held = token_windows(lm.tokenizer, load_corpus("default", "eval"), args.eval_windows, S, args.seed + 1)
    spread = position_offsets(len(rand), S, max_pos)

    stats = {
        "random-spread": run_pass(lm, "random-spread", rand, spread, GramCollector(a)),
        "random-at-0": run_pass(lm, "random-at-0", rand, [0] * len(rand), GramCollector(a)),
        "text-spread": run_pass(lm, "text-spread", text, spread, GramCollector(a)),
    }
    rotations = {}
    for w in QK_WEIGHTINGS:
        for src, st in stats.items():
            rotations[f"{src}/{w}"] = eig_basis(qk_gram(st, w))[0]
        both = sum(g / torch.diagonal(g, dim1=-2, dim2=-1).sum(-1)[..., None, None]
                   for g in (qk_gram(stats["random-spread"], w), qk_gram(stats["text-spread"], w)))
        rotations[f"both-spread/{w}"] = eig_basis(both)[0]
    d = a.head_dim
    ranks = [d // 4, d // 2, 3 * d // 4]
    held_stats = GramCollector(a)
    logit_error = {}
    # held-out text at the positions a short prompt has (0..S-1), and spread over the context like long prompts' keys
    for where, offsets in (("positions 0..S-1", [0] * len(held)),
                           ("positions spread", position_offsets(len(held), S, max_pos))):
        logits = LogitError(rotations, ranks, a.group_size)

        class Both:
            def __init__(self, collectors):
                self.collectors = collectors

            def add(self, *x):
                for c in self.collectors:
                    c.add(*x)

        run_pass(lm, f"held-out {where}", held, offsets, Both([logits, held_stats]))
        logit_error[where] = logits.result()

    v_bases = {
        "activations-text": eig_basis(stats["text-spread"].vv)[0],
        "activations-random": eig_basis(stats["random-spread"].vv)[0],
        "weight-svd": weight_svd_basis(lm.model, a)[0],
    }
    result = {
        "model": lm.name,
        "head_dim": d,
        "tokens_per_pass": int(rand.numel()),
        "held_out_tokens": int(held.numel()),
        "qk_logit_error": logit_error,
        "v_reconstruction_error": {name: {k: v_error(B, held_stats.vv, k) for k in ranks} for name, B in
                                   v_bases.items()},
        "token_independence": {
            "random-spread vs text-spread (trace)": token_independence(rotations["random-spread/trace"],
                                                                      rotations["text-spread/trace"]),
            "random-at-0 vs random-spread (trace)": token_independence(rotations["random-at-0/trace"],
                                                                      rotations["random-spread/trace"]),
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }
    for where, table in logit_error.items():
        print(f"# {lm.name}: relative attention-logit error, {held.numel()} held-out tokens at {where} "
              "(lower is better)")
        print(f"{'rotation':<32}" + "".join(f"{'k=' + str(k):>10}" for k in ranks))
        for name, errs in sorted(table.items(), key=lambda kv: kv[1][ranks[1]]):
            print(f"{name:<32}" + "".join(f"{errs[k]:>10.4f}" for k in ranks))
    print("\n# relative V reconstruction error on held-out text (both placements)")
    for name, errs in result["v_reconstruction_error"].items():
        print(f"{name:<32}" + "".join(f"{errs[k]:>10.4f}" for k in ranks))
    print("\n# token independence (δ̄/ε̄ sign-aligned; subspace overlap at d/2, 3d/4)")
    for name, ti in result["token_independence"].items():
        print(f"{name:<40} {ti['ratio']:8.2%}  {ti['overlap_half']:.3f}  {ti['overlap_three_quarters']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
