"""Packed variable-length batches (``attention_varlen`` and its backward), same run:

- equal lengths: varlen next to the dense kernel on the same tokens (batch x seqlen = 16k,
  heads = 2048 / head_dim, bf16), forward and backward TFLOP/s (FlashAttention's count);
- a ragged batch (16k tokens, lengths drawn from [1, 4096]): varlen next to the dense kernel on
  the batch padded to its longest sequence, and next to PyTorch's own varlen path (SDPA on
  nested jagged tensors) in the same run; time in ms and useful TFLOP/s (real tokens only).

Bars (issue 15): varlen within 5% of dense on equal lengths; on the ragged batch faster than
padding by at least the padding fraction (padded time / varlen time >= 1 / (1 - fraction)).

    PYTHONPATH=. python -m benchmarks varlen [--csv docs/bench/varlen.csv]
"""

from __future__ import annotations

import argparse

import numpy as np

import cuattn
from benchmarks.timing import environment, torch_kernel_ms, write_csv


def _offsets(lengths, device):
    import torch

    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def _ms(fn) -> float:
    try:
        return round(torch_kernel_ms(fn), 4)
    except RuntimeError as exc:  # a peer that refuses the case
        print(f"failed: {exc}")
        return float("nan")


def equal_lengths(d: int, s: int, causal: bool) -> dict:
    import torch

    b, h = 16384 // s, 2048 // d
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qp, kp, vp, dop = (x.reshape(b * s, h, d) for x in (q, k, v, do))
    cu = _offsets([s] * b, "cuda")
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
    outp, lsep = cuattn.attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=s, max_seqlen_k=s, causal=causal, return_lse=True)
    times = {
        "dense_fwd": _ms(lambda: cuattn.attention(q, k, v, causal=causal)),
        "varlen_fwd": _ms(lambda: cuattn.attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=s, max_seqlen_k=s, causal=causal)),
        "dense_bwd": _ms(lambda: cuattn.attention_backward(do, q, k, v, out, lse, causal=causal)),
        "varlen_bwd": _ms(lambda: cuattn.attention_varlen_backward(
            dop, qp, kp, vp, outp, lsep, cu, cu, max_seqlen_q=s, max_seqlen_k=s, causal=causal)),
    }
    row = {"case": "equal", "head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal}
    for name, ms in times.items():
        row[name + "_tflops"] = round((2.5 if name.endswith("bwd") else 1) * flops / ms / 1e9, 1)
    row["fwd_ratio"] = round(times["dense_fwd"] / times["varlen_fwd"], 3)
    row["bwd_ratio"] = round(times["dense_bwd"] / times["varlen_bwd"], 3)
    return row


def ragged(d: int, causal: bool, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4097, 8)
    lengths = (lengths * 16384 / lengths.sum()).astype(int).clip(1, 4096)
    h, total, longest, b = 2048 // d, int(lengths.sum()), int(lengths.max()), len(lengths)
    flops = sum(4 * h * int(n) * int(n) * d / (2 if causal else 1) for n in lengths)
    qp, kp, vp, dop = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cu = _offsets(lengths, "cuda")
    qd, kd, vd, dod = (torch.randn(b, longest, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    outp, lsep = cuattn.attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal, return_lse=True)
    outd, lsed = cuattn.attention(qd, kd, vd, causal=causal, return_lse=True)
    times = {
        "varlen_fwd": _ms(lambda: cuattn.attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)),
        "padded_fwd": _ms(lambda: cuattn.attention(qd, kd, vd, causal=causal)),
        "varlen_bwd": _ms(lambda: cuattn.attention_varlen_backward(
            dop, qp, kp, vp, outp, lsep, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)),
        "padded_bwd": _ms(lambda: cuattn.attention_backward(dod, qd, kd, vd, outd, lsed, causal=causal)),
    }
    # PyTorch's varlen: SDPA on nested (jagged) tensors, (batch, heads, j, d) views.
    try:
        offsets = cu.long()  # one offsets tensor: nested tensors built on it share their ragged dimension
        leaves = [torch.nested.nested_tensor_from_jagged(x.detach().clone(), offsets).requires_grad_() for x in (qp, kp, vp)]
        heads_first = [x.transpose(1, 2) for x in leaves]
        torch_out = F.scaled_dot_product_attention(*heads_first, is_causal=causal)
        grad_out = torch.nested.nested_tensor_from_jagged(dop, offsets).transpose(1, 2)
        times["torch_nested_fwd"] = _ms(lambda: F.scaled_dot_product_attention(*heads_first, is_causal=causal))
        times["torch_nested_bwd"] = _ms(lambda: torch.autograd.grad(torch_out, leaves, grad_out, retain_graph=True))
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        print(f"torch nested SDPA failed: {type(exc).__name__}: {exc}")
        times["torch_nested_fwd"] = times["torch_nested_bwd"] = float("nan")
    padding = 1 - total / (b * longest)
    row = {"case": "ragged", "head_dim": d, "seqlen": longest, "batch": b, "heads": h, "causal": causal,
           "lengths": " ".join(map(str, lengths)), "padding_fraction": round(padding, 3)}
    for name, ms in times.items():
        row[name + "_ms"] = ms
        row[name + "_tflops"] = round((2.5 if name.endswith("bwd") else 1) * flops / ms / 1e9, 1)
    bar = 1 / (1 - padding)
    row["fwd_speedup_vs_padded"] = round(times["padded_fwd"] / times["varlen_fwd"], 2)
    row["bwd_speedup_vs_padded"] = round(times["padded_bwd"] / times["varlen_bwd"], 2)
    row["speedup_bar"] = round(bar, 2)
    return row


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default="docs/bench/varlen.csv")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    args = parser.parse_args(argv)
    env = {**environment(), "torch": torch.__version__}
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                rows.append({**equal_lengths(d, s, causal), **env})
        for causal in (False, True):
            rows.append({**ragged(d, causal, seed=0), **env})
    write_csv(args.csv, rows)
    print(f"varlen, bf16 — {env['gpu']}, {env['date']}, torch {env['torch']}, cupy {env['cupy']}")
    print("equal lengths (TFLOP/s):")
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} {'dense f':>8} {'varlen f':>8} {'ratio':>6} {'dense b':>8} {'varlen b':>8} {'ratio':>6}")
    for r in rows:
        if r["case"] == "equal":
            print(f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} {r['dense_fwd_tflops']:>8} {r['varlen_fwd_tflops']:>8} "
                  f"{r['fwd_ratio']:>6} {r['dense_bwd_tflops']:>8} {r['varlen_bwd_tflops']:>8} {r['bwd_ratio']:>6}")
    print("ragged batch, 16k tokens (ms; speedup = padded / varlen, bar = 1 / (1 - padding)):")
    print(f"{'d':>4} {'causal':>6} {'pad':>5} {'varlen f':>8} {'padded f':>8} {'torch f':>8} {'x':>5} {'varlen b':>8} {'padded b':>8} "
          f"{'torch b':>8} {'x':>5} {'bar':>5}")
    for r in rows:
        if r["case"] == "ragged":
            print(f"{r['head_dim']:>4} {str(r['causal']):>6} {r['padding_fraction']:>5} {r['varlen_fwd_ms']:>8} {r['padded_fwd_ms']:>8} "
                  f"{r['torch_nested_fwd_ms']:>8} {r['fwd_speedup_vs_padded']:>5} {r['varlen_bwd_ms']:>8} {r['padded_bwd_ms']:>8} "
                  f"{r['torch_nested_bwd_ms']:>8} {r['bwd_speedup_vs_padded']:>5} {r['speedup_bar']:>5}")


if __name__ == "__main__":
    main()
