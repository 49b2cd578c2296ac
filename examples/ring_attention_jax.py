"""Context parallelism in JAX: one causal sequence split over every GPU of the machine (zigzag
layout), attention by cuattn's ring inside ``jax.shard_map``, forward and backward, checked
against cuattn.jax.attention over the whole sequence on one GPU.

    python examples/ring_attention_jax.py [--seqlen 16384] [--heads 16] [--kv-heads 4]

On one GPU the ring has one rank (the exchange sends to itself).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cuattn.dist
import cuattn.jax


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()

    devices = jax.devices()
    world = len(devices)
    mesh = jax.make_mesh((world,), ("cp",), devices=devices)
    rng = np.random.default_rng(0)
    shapes = [(1, args.seqlen, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    full = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    dout = rng.standard_normal(shapes[0]).astype(np.float32)

    # Rank r's shard is the r-th piece of the sharded sequence axis: lay the shards out in rank order.
    def sharded(x):
        rows = np.concatenate([cuattn.dist.shard(x, world, r, "zigzag") for r in range(world)], axis=1)
        return jax.device_put(jnp.asarray(rows, jnp.bfloat16), NamedSharding(mesh, P(None, "cp")))

    ring = jax.shard_map(lambda q, k, v: cuattn.jax.ring_attention(q, k, v, axis_name="cp", layout="zigzag", causal=True),
                         mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
    w = sharded(dout)

    @jax.jit
    def ring_step(q, k, v):
        out, vjp = jax.vjp(ring, q, k, v)
        return out, vjp(w)

    q, k, v = (sharded(x) for x in full)
    jax.block_until_ready(ring_step(q, k, v))
    start = time.perf_counter()
    out, grads = jax.block_until_ready(ring_step(q, k, v))
    seconds = time.perf_counter() - start

    def unshard(x):
        return cuattn.dist.unshard(np.split(np.asarray(x.astype(jnp.float32)), world, axis=1), "zigzag", axis=1)

    whole = [jax.device_put(jnp.asarray(x, jnp.bfloat16), devices[0]) for x in full]
    want, vjp = jax.vjp(lambda q, k, v: cuattn.jax.attention(q, k, v, causal=True), *whole)
    want_grads = vjp(jnp.asarray(dout, jnp.bfloat16))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        diff = np.abs(unshard(got) - np.asarray(ref.astype(jnp.float32))).max()
        print(f"{name}: max |ring - one GPU| = {diff:.3e}")
    print(f"{world} device(s), {args.seqlen} tokens, forward + backward {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
