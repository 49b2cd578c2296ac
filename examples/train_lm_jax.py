"""The language model of train_lm_torch.py in plain JAX (jit, grad, a hand-written AdamW),
trained twice from the same initialization on the same batches: with cuattn.jax.attention and
with jax.nn.dot_product_attention. Attention runs in bfloat16, the rest in float32.

    python examples/train_lm_jax.py [--steps 300] [--out results/]

writes ``<out>/lm_jax.json`` (GPU, wall time per run, last-50-step mean losses: what the README
quotes, with ``--out docs``), ``lm_jax_losses.csv`` and ``lm_jax_losses.png``.
"""

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import cuattn.jax
from lm_data import batches, compare

ATTENTION = {
    "cuattn": lambda q, k, v: cuattn.jax.attention(q, k, v, causal=True),
    "jax.nn.dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
}


def init(key, vocab, dim=256, heads=4, layers=4, seqlen=256):
    keys = iter(jax.random.split(key, 6 * layers + 3))

    def dense(n_in, n_out):
        return {"w": jax.random.normal(next(keys), (n_in, n_out)) / math.sqrt(n_in), "b": jnp.zeros(n_out)}

    norm = lambda: {"g": jnp.ones(dim), "b": jnp.zeros(dim)}  # noqa: E731
    blocks = [
        {"ln1": norm(), "qkv": dense(dim, 3 * dim), "proj": dense(dim, dim), "ln2": norm(), "fc1": dense(dim, 4 * dim), "fc2": dense(4 * dim, dim)}
        for _ in range(layers)
    ]
    return {
        "embed": jax.random.normal(next(keys), (vocab, dim)) * 0.02,
        "pos": jax.random.normal(next(keys), (seqlen, dim)) * 0.02,
        "blocks": blocks, "ln": norm(), "head": dense(dim, vocab),
    }


def layer_norm(p, x):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]


def linear(p, x):
    return x @ p["w"] + p["b"]


def forward(params, tokens, attend, heads=4):
    b, s = tokens.shape
    x = params["embed"][tokens] + params["pos"][:s]
    for blk in params["blocks"]:
        d = x.shape[-1]
        q, k, v = (t.astype(jnp.bfloat16) for t in linear(blk["qkv"], layer_norm(blk["ln1"], x)).reshape(b, s, 3, heads, d // heads).transpose(2, 0, 1, 3, 4))
        x = x + linear(blk["proj"], attend(q, k, v).astype(jnp.float32).reshape(b, s, d))
        x = x + linear(blk["fc2"], jax.nn.gelu(linear(blk["fc1"], layer_norm(blk["ln2"], x))))
    return linear(params["head"], layer_norm(params["ln"], x))


def loss_fn(params, x, y, attend):
    logp = jax.nn.log_softmax(forward(params, x, attend))
    return -jnp.take_along_axis(logp, y[..., None], -1).mean()


@functools.partial(jax.jit, static_argnames=("attend", "steps"))
def train_step(params, moments, step, x, y, attend, steps, lr=1e-3, wd=0.01, b1=0.9, b2=0.999):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, attend)
    rate = lr * jnp.minimum(1.0, (step + 1) / 30) * 0.5 * (1 + jnp.cos(jnp.pi * step / steps))
    m, v = moments
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    t = step + 1
    params = jax.tree.map(
        lambda p, m, v: p - rate * ((m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + 1e-8) + wd * p), params, m, v
    )
    return params, (m, v), loss


def train(attend, tokens, vocab, steps, batch, seqlen, seed=0):
    params = init(jax.random.PRNGKey(seed), len(vocab), seqlen=seqlen)
    moments = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))
    losses, first = [], None
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches(tokens, batch, seqlen, steps, seed)):
        params, moments, loss = train_step(params, moments, step, x, y, attend, steps)
        losses.append(loss)
        if first is None:  # the first step compiles
            jax.block_until_ready(loss)
            first = time.perf_counter() - start
    losses = np.array([float(v) for v in losses])
    return losses, time.perf_counter() - start, first


def main():
    import cupy

    compare(__doc__, ATTENTION, train, "lm_jax", "char LM, JAX, bf16 attention", lambda: jax.devices()[0].device_kind,
            {"cuattn": cuattn.__version__, "jax": jax.__version__, "cupy": cupy.__version__})


if __name__ == "__main__":
    main()
