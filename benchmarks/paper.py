"""Tables 2 (inference) and 3 (differentiation) of Rabe & Staats, "Self-attention does not need
O(n^2) memory" (arXiv 2112.05682), reproduced on this GPU: one head, head_dim 64, bfloat16
inputs (and a float32 variant), sequence lengths 2^8 .. 2^20. Memory overhead is the peak of
PyTorch's allocator beyond the inputs and outputs; "standard" is PyTorch SDPA's math backend
(scores materialized). Also the paper's accuracy check: max |cuattn - standard| at 2^14, fp32,
normal and uniform inputs.

    PYTHONPATH=. python -m benchmarks paper [--max-log2 20] [--out results]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

HEAD_DIM = 64
# The paper's rows (TPUv3, its Tables 2 and 3), by log2 of the sequence length.
PAPER = {
    "inference": {
        "io": ["160KB", "640KB", "2.5MB", "10MB", "40MB", "160MB", "640MB"],
        "standard": ["270KB", "4.0MB", "64MB", "1GB", "OOM", "OOM", "OOM"],
        "efficient": ["270KB", "4.0MB", "16MB", "17MB", "21MB", "64MB", "256MB"],
        "time": ["0.06ms", "0.11ms", "0.7ms", "11.3ms", "177ms", "2.82s", "45.2s"],
    },
    "differentiation": {
        "io": ["192KB", "768KB", "3MB", "12MB", "48MB", "192MB", "768MB"],
        "standard": ["532KB", "8.0MB", "128MB", "2.0GB", "OOM", "OOM", "OOM"],
        "efficient": ["532KB", "8.0MB", "41MB", "64MB", "257MB", "1GB", "4GB"],
        "time": ["0.1ms", "0.18ms", "1.4ms", "21.8ms", "348ms", "5.5s", "88s"],
    },
}
LOG2_LENGTHS = (8, 10, 12, 14, 16, 18, 20)


def human(nbytes) -> str:
    if nbytes is None:
        return "OOM"
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g}{unit}"
    return f"{nbytes}B"


def human_ms(ms) -> str:
    return "-" if ms is None else f"{ms / 1e3:.3g}s" if ms >= 1000 else f"{ms:.3g}ms"


def measure(fn, io_bytes: int, repeat: int = 3):
    """(peak allocator bytes beyond the live inputs and the outputs, median ms) of ``fn()``,
    which returns the outputs; (None, None) when it runs out of memory."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outputs = fn()
        torch.cuda.synchronize()
        overhead = torch.cuda.max_memory_allocated() - base - sum(o.nbytes for o in outputs)
        del outputs
        times = []
        for _ in range(repeat):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return max(0, overhead), statistics.median(times)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def tables(max_log2: int, dtype_name: str, log=print) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuattn
    import cuattn.torch as ct

    dtype = getattr(torch, dtype_name)

    def standard(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    result = {"inference": [], "differentiation": []}
    for log2 in [n for n in LOG2_LENGTHS if n <= max_log2]:
        n = 2**log2
        q, k, v, dout = (torch.randn(1, n, 1, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(4))
        item = q.element_size()
        io = 4 * n * HEAD_DIM * item  # q, k, v, out
        ours = measure(lambda: (cuattn.attention(q, k, v),), io)
        theirs = measure(lambda: (standard(q, k, v),), io)
        result["inference"].append({"log2": log2, "io": io, "cuattn": ours, "standard": theirs})

        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def differentiate(attend):
            def run():
                grads = torch.autograd.grad(attend(*leaves), leaves, dout)
                return grads
            return run

        io = 6 * n * HEAD_DIM * item  # q, k, v and their gradients
        ours = measure(differentiate(ct.attention), io)
        theirs = measure(differentiate(standard), io)
        result["differentiation"].append({"log2": log2, "io": io, "cuattn": ours, "standard": theirs})
        log(f"{dtype_name} 2^{log2}: inference {human(result['inference'][-1]['cuattn'][0])} / {human_ms(result['inference'][-1]['cuattn'][1])}, "
            f"differentiation {human(ours[0])} / {human_ms(ours[1])}")
    return result


def accuracy(log2: int = 14) -> dict:
    """max |cuattn - standard| (both fp32, no tf32) for normal and uniform inputs."""
    import torch

    import cuattn

    torch.backends.cuda.matmul.allow_tf32 = False
    n, out = 2**log2, {}
    for name, make in (("normal", torch.randn), ("uniform", torch.rand)):
        q, k, v = (make(1, n, 1, HEAD_DIM, device="cuda", dtype=torch.float32) for _ in range(3))
        s = (q[0, :, 0] @ k[0, :, 0].T) / HEAD_DIM**0.5
        standard = torch.softmax(s, -1) @ v[0, :, 0]
        out[name] = float((cuattn.attention(q, k, v)[0, :, 0] - standard).abs().max())
    return out


def table_rows(rows: list[dict], kind: str) -> list[tuple[str, list[str]]]:
    """(row name, cells per sequence length) of one reproduced table, the paper's rows beside
    ours; the printed table and the README's are both made from these."""
    paper = PAPER[kind]
    idx = [LOG2_LENGTHS.index(r["log2"]) for r in rows]
    return [
        ("size of inputs and outputs", [human(r["io"]) for r in rows]),
        ("paper", [paper["io"][i] for i in idx]),
        ("overhead, standard (SDPA math)", [human(r["standard"][0]) for r in rows]),
        ("paper, standard", [paper["standard"][i] for i in idx]),
        ("overhead, cuattn", [human(r["cuattn"][0]) for r in rows]),
        ("paper, memory-efficient", [paper["efficient"][i] for i in idx]),
        ("time, standard", [human_ms(r["standard"][1]) for r in rows]),
        ("time, cuattn", [human_ms(r["cuattn"][1]) for r in rows]),
        ("paper, memory-efficient (TPUv3)", [paper["time"][i] for i in idx]),
    ]


def print_tables(results: dict) -> None:
    for dtype_name, res in results.items():
        if dtype_name == "accuracy":
            continue
        for kind in ("inference", "differentiation"):
            rows = res[kind]
            print(f"\n{kind}, {dtype_name}, one head, head_dim {HEAD_DIM} (paper: TPUv3, its own sizes)")
            print(f"{'sequence length':<34}" + "".join(f"{'2^%d' % r['log2']:>10}" for r in rows))
            for name, cells in table_rows(rows, kind):
                print(f"{name:<34}" + "".join(f"{c:>10}" for c in cells))
    if "accuracy" in results:
        acc = results["accuracy"]
        print(f"\naccuracy at 2^14, fp32: max |cuattn - standard| normal {acc['normal']:.2e}, uniform {acc['uniform']:.2e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-log2", type=int, default=20)
    parser.add_argument("--fp32-max-log2", type=int, default=16, help="the float32 variant runs on the CUDA cores")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = parser.parse_args(argv)
    results = {"bfloat16": tables(args.max_log2, "bfloat16"), "float32": tables(min(args.max_log2, args.fp32_max_log2), "float32")}
    results["accuracy"] = accuracy()
    print_tables(results)
    from benchmarks.run import versions

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paper_tables.json").write_text(json.dumps({"environment": versions(), **results}, indent=1))


if __name__ == "__main__":
    main()
