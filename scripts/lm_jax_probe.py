"""One JAX LM run in this process: python scripts/lm_jax_probe.py NAME STEPS [sync]; prints
the first step's and the later steps' seconds."""
import sys, time
sys.path.insert(0, "examples")
import jax, numpy as np
import train_lm_jax as lm
from lm_data import batches, corpus, encode
name, steps, sync = sys.argv[1], int(sys.argv[2]), "sync" in sys.argv[3:]
tokens, vocab = encode(corpus())
attend = lm.ATTENTION[name]
params = lm.init(jax.random.PRNGKey(0), len(vocab), seqlen=256)
moments = (jax.tree.map(jax.numpy.zeros_like, params), jax.tree.map(jax.numpy.zeros_like, params))
start = time.perf_counter(); first = None; losses = []
for step, (x, y) in enumerate(batches(tokens, 32, 256, steps, 0)):
    params, moments, loss = lm.train_step(params, moments, step, x, y, attend, steps)
    losses.append(loss)
    if sync or first is None:
        jax.block_until_ready(loss)
    if first is None:
        first = time.perf_counter() - start; t1 = time.perf_counter()
jax.block_until_ready(losses[-1])
end = time.perf_counter()
print(f"{name:30s} sync={sync} first {first:.2f} s, then {(end - t1) / (steps - 1) * 1e3:.2f} ms/step, total {end - start:.2f} s, loss {float(losses[-1]):.4f}")
