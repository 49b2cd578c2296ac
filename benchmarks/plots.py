"""PNG plots of suite results: rate against sequence length, one line per implementation, one
panel per (head_dim, causal); every figure labelled with the GPU, date and versions."""

from __future__ import annotations

import pathlib


def _caption(env: dict) -> str:
    return f"{env['gpu']}, {env['date']}, cuattn {env['cuattn_version']}, torch {env.get('torch', '-')}, jax {env.get('jax', '-')}, cupy {env['cupy']}"


def plot_suite(rows, impl_names, env: dict, out_dir: pathlib.Path, stem: str = "suite") -> list[pathlib.Path]:
    """One PNG per mode, ``out_dir/<stem>_<mode>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for mode in ("fwd", "bwd", "fwdbwd", "decode"):
        # The MHA bf16 sweep; GQA and fp16 spot checks stay in the tables.
        sel = [r for r in rows if r["mode"] == mode and r["dtype"] == "bfloat16" and (mode == "decode" or r["heads_q"] == r["heads_kv"])]
        if not sel:
            continue
        panels = sorted({(r["head_dim"], r["causal"]) for r in sel})
        cols = 2 if len(panels) > 1 else 1
        nrows = -(-len(panels) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.4 * nrows), squeeze=False)
        for ax, (d, causal) in zip(axes.flat, panels):
            pts = sorted((r for r in sel if r["head_dim"] == d and r["causal"] == causal), key=lambda r: r["seqlen_k"])
            for name in impl_names:
                xs = [r["seqlen_k"] for r in pts if r.get(name) is not None]
                ys = [r[name] for r in pts if r.get(name) is not None]
                if xs:
                    ax.plot(xs, ys, marker="o", markersize=3, label=name, linewidth=2.2 if name == "cuattn" else 1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("KV length" if mode == "decode" else "sequence length")
            ax.set_ylabel(sel[0]["unit"])
            ax.set_title(f"{mode}, head_dim {d}" + (", causal" if causal else ""), fontsize=9)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(_caption(env), fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}_{mode}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_decode(rows, copy_gbs: float, env: dict, path: pathlib.Path) -> pathlib.Path:
    """GB/s of K/V read against cached tokens, one panel per batch size: cuattn (contiguous and
    paged) next to SDPA's backends, and the measured copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches), 3.3), squeeze=False)
    lines = (("cuattn_contiguous", "cuattn", 2.2), ("cuattn_page16", "cuattn paged (16)", 1.4), ("cuattn_page1", "cuattn paged (1)", 1.0),
             ("sdpa_flash", "SDPA flash", 1.0), ("sdpa_cudnn", "SDPA cuDNN", 1.0))
    for ax, batch in zip(axes.flat, batches):
        pts = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["cached_tokens"])
        for key, label, width in lines:
            ax.plot([r["cached_tokens"] for r in pts], [r[key] for r in pts], marker="o", markersize=3, label=label, linewidth=width)
        ax.axhline(copy_gbs, color="gray", linestyle=":", linewidth=1, label="copy (read + write)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached tokens")
        ax.set_ylabel("GB/s of K/V read")
        ax.set_title(f"batch {batch}", fontsize=9)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(f"decode, GQA 32:8, head_dim 128, bf16; {env['gpu']}, {env['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
