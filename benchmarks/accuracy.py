"""Accuracy table: max error against float64 of cuattn, PyTorch SDPA (flash, cuDNN) and naive
attention in bf16, on the same inputs, for the output and the three gradients.

    PYTHONPATH=. python -m benchmarks accuracy [--out results]
"""

from __future__ import annotations

import argparse
import json
import pathlib

SIZES = [(2, 1024, 8, 64, False), (2, 1024, 8, 64, True), (1, 4096, 8, 128, False), (1, 4096, 8, 128, True),
         *((1, 2048, 8, d, True) for d in (96, 160, 192, 224, 256)), (1, 2048, 8, 256, False)]


def _textbook(q, k, v, causal):
    """(batch, heads, seqlen, head_dim) attention with scores materialized, in q's dtype."""
    import torch

    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def errors(batch, seqlen, heads, head_dim, causal, seed=0) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuattn.torch as ct

    g = torch.Generator(device="cuda").manual_seed(seed)
    base = [torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.float64, generator=g) for _ in range(4)]
    q64, k64, v64, do64 = base

    def grads(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q64, k64, v64)]
        out = fn(*leaves)
        return [out.double(), *(g.double() for g in torch.autograd.grad(out, leaves, do64.to(dtype)))]

    def backend(b):
        def run(q, k, v):
            with sdpa_kernel(b):
                return sdpa(q, k, v, is_causal=causal)
        return run

    ref = grads(lambda q, k, v: _textbook(q, k, v, causal), torch.float64)
    impls = {
        "cuattn": lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "sdpa_flash": backend(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": backend(SDPBackend.CUDNN_ATTENTION),
        "naive_bf16": lambda q, k, v: _textbook(q, k, v, causal),
    }
    result = {}
    for name, fn in impls.items():
        try:
            result[name] = [float((x - r).abs().max()) for x, r in zip(grads(fn, torch.bfloat16), ref)]
        except RuntimeError as exc:
            result[name] = str(exc).splitlines()[0][:60]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = parser.parse_args(argv)
    rows = []
    for size in SIZES:
        rows.append({"size": size, "errors": errors(*size)})
    print("max |error| against float64, bf16 inputs: out / dq / dk / dv")
    names = list(rows[0]["errors"])
    print(f"{'batch x seqlen x heads x d, causal':<36}" + "".join(f"{n:>34}" for n in names))
    for r in rows:
        b, s, h, d, c = r["size"]
        cells = ["/".join(f"{e:.1e}" for e in v) if isinstance(v, list) else v for v in r["errors"].values()]
        print(f"{f'{b}x{s}x{h}x{d}' + (' causal' if c else ''):<36}" + "".join(f"{c:>34}" for c in cells))
    from benchmarks.run import versions

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps({"environment": versions(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
