"""PyTorch forward+backward per call, cuattn and SDPA interleaved, GC on and off."""
import gc, time
import torch, torch.nn.functional as F
import cuattn.torch as ct

def t(fn, n=500):
    fn(); torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - s) / n * 1e6

q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
sdpa = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
for gc_on in (True, False):
    (gc.enable if gc_on else gc.disable)()
    for rep in range(3):
        a = t(lambda: ct.attention(q, k, v).sum().backward())
        b = t(lambda: sdpa(q, k, v).sum().backward())
        print(f"gc={gc_on} rep {rep}: cuattn {a:7.1f}  sdpa {b:7.1f}  ratio {a / b:.2f}", flush=True)
gc.enable()
import cProfile, pstats, io
pr = cProfile.Profile(); pr.enable()
for _ in range(500):
    ct.attention(q, k, v).sum().backward()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[-5000:])
