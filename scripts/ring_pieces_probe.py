"""The ring's kernels alone, on one GPU, causal zigzag, d128, GQA 32:8, bf16:
- ``single``: attention over the whole sequence (2 T tokens: W = 2 ranks of T);
- ``ring``: the simulated ring (every rank's steps in turn, the exchange as device copies);
- ``pieces``: the same (query, key) pieces as plain calls, each writing its own out / grads (what
  a ring costs with no fold, no gradient sums and no exchange).
Ratio = single / ring: the efficiency the ring's kernels allow before any transfer or host cost.

    PYTHONPATH=<tree>:. python scripts/ring_pieces_probe.py [--tokens-per-rank 8192,16384] [--tag TEXT]
"""

import argparse

import cupy

import cuattn
import cuattn.dist
import cuattn.dtypes
from benchmarks.timing import median_ms
from cuattn.dist import layout as layouts


def _zigzag_pieces(qs, ks, vs, ds):
    """W = 2: each rank's own shard causal, then rank 0's second query chunk against rank 1's
    keys and rank 1's queries against rank 0's first key chunk, unmasked."""
    half = qs[0].shape[1] // 2
    return [
        (qs[0], ks[0], vs[0], ds[0], True), (qs[1], ks[1], vs[1], ds[1], True),
        (qs[0][:, half:], ks[1], vs[1], ds[0][:, half:], False), (qs[1], ks[0][:, :half], vs[0][:, :half], ds[1], False),
    ]


def case(tokens: int, w: int = 2):
    """The whole sequence (q, k, v, dout, out, lse), its zigzag shards (qs, ks, vs, ds, outs,
    lses from the simulated ring), and the pieces with their outputs."""
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, tokens * w, h, 128), dtype=cupy.float32).astype(cuattn.dtypes.BFLOAT16) for h in (32, 8, 8, 32))
    shard = lambda x: [cupy.ascontiguousarray(layouts.shard(x, w, r, "zigzag")) for r in range(w)]  # noqa: E731
    qs, ks, vs, ds = shard(q), shard(k), shard(v), shard(dout)
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    outs, lses = cuattn.dist.ring_attention_simulated(qs, ks, vs, layout="zigzag", causal=True, return_lse=True)
    pieces = _zigzag_pieces(qs, ks, vs, ds)
    piece_outs = [cuattn.attention(pq, pk, pv, causal=c, return_lse=True) for pq, pk, pv, _, c in pieces]
    return (q, k, v, dout, out, lse), (qs, ks, vs, ds, outs, lses), pieces, piece_outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens-per-rank", default="8192,16384")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    w = 2
    ms = lambda fn: median_ms(lambda i: fn(), warmup=1, repeat=7)  # noqa: E731
    for tokens in map(int, args.tokens_per_rank.split(",")):
        (q, k, v, dout, out, lse), (qs, ks, vs, ds, outs, lses), pieces, piece_outs = case(tokens, w)
        t = {
            "single_fwd": ms(lambda: cuattn.attention(q, k, v, causal=True, return_lse=True)),
            "ring_fwd": ms(lambda: cuattn.dist.ring_attention_simulated(qs, ks, vs, layout="zigzag", causal=True, return_lse=True)),
            "pieces_fwd": ms(lambda: [cuattn.attention(pq, pk, pv, causal=c, return_lse=True) for pq, pk, pv, _, c in pieces]),
            "single_bwd": ms(lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)),
            "ring_bwd": ms(lambda: cuattn.dist.ring_attention_backward_simulated(ds, qs, ks, vs, outs, lses, layout="zigzag", causal=True)),
            "pieces_bwd": ms(lambda: [cuattn.attention_backward(pd, pq, pk, pv, o, lz, causal=c)
                                      for (pq, pk, pv, pd, c), (o, lz) in zip(pieces, piece_outs)]),
        }
        t.update({f"piece{i}_bwd": ms(lambda p=p, o=o: cuattn.attention_backward(p[3], *p[:3], *o, causal=p[4]))
                  for i, (p, o) in enumerate(zip(pieces, piece_outs))})
        ratio = lambda a, b: round(a / b, 3)  # noqa: E731
        print(f"{args.tag} tokens/rank {tokens} W {w}", {a: round(b, 3) for a, b in t.items()},
              "single/ring fwd", ratio(t["single_fwd"], t["ring_fwd"]), "bwd", ratio(t["single_bwd"], t["ring_bwd"]),
              "fwd+bwd", ratio(t["single_fwd"] + t["single_bwd"], t["ring_fwd"] + t["ring_bwd"]),
              "single/pieces fwd", ratio(t["single_fwd"], t["pieces_fwd"]), "bwd", ratio(t["single_bwd"], t["pieces_bwd"]), flush=True)


if __name__ == "__main__":
    main()
