"""Attention over a sequence split across ranks (context parallelism): the ring schedule and
the layouts that deal a sequence to the ranks. See cuattn/dist/ring.py; the JAX form is
``cuattn.jax.ring_attention`` (cuattn/dist/jax_ring.py, which imports jax)."""

from cuattn.dist.layout import LAYOUTS, positions, shard, unshard
from cuattn.dist.ring import ring_attention, ring_attention_backward, ring_attention_backward_simulated, ring_attention_simulated

__all__ = ["LAYOUTS", "positions", "shard", "unshard", "ring_attention", "ring_attention_backward", "ring_attention_simulated",
           "ring_attention_backward_simulated"]
