"""Per-call host time of the pieces of a PyTorch forward+backward, and merge's GPU time."""
import time
import numpy as np
import torch
import torch.nn.functional as F
import cupy
import cuattn, cuattn.torch as ct

def t(fn, n=3000, sync=torch.cuda.synchronize):
    fn(); sync()
    s = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - s) / n * 1e6

q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
sdpa = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
class Rows(list):
    def append(self, row):
        print(f"{row[0]:<45} {row[1]:8.2f}", flush=True)
        super().append(row)


rows = Rows()
with torch.no_grad():
    rows.append(("cuattn fwd no_grad", t(lambda: ct.attention(q, k, v))))
    rows.append(("core fwd no_grad (torch)", t(lambda: cuattn.attention(q, k, v))))
    rows.append(("sdpa fwd no_grad", t(lambda: sdpa(q, k, v))))
    rows.append(("torch.empty_strided x1", t(lambda: torch.empty_strided((1, 128, 4, 64), (32768, 256, 64, 1), dtype=torch.bfloat16, device=q.device))))
from cuattn import replay
rows.append(("replay read x1", t(lambda: replay._frameworks[torch.Tensor].read(q))))
rows.append(("_eager", t(lambda: ct._eager(q, k, v))))
rows.append(("_EagerAttention.apply", t(lambda: ct._EagerAttention.apply(q, k, v, (False, None, "bottom_right", None, None)))))
for name, f in (("cuattn", ct.attention), ("sdpa", sdpa)):
    rows.append((f"{name} fwd with grad", t(lambda: f(q, k, v))))
    out = f(q, k, v)
    g = torch.ones_like(out)
    rows.append((f"{name} backward only (retain)", t(lambda: torch.autograd.backward(out, g, retain_graph=True))))
    rows.append((f"{name} fwd+bwd (ones grad)", t(lambda: torch.autograd.backward(f(q, k, v), g))))
    rows.append((f"{name} fwd+sum+bwd", t(lambda: f(q, k, v).sum().backward())))
with torch.no_grad():
    out, lse = ct.attention(q, k, v, return_lse=True)
dout = torch.ones_like(out)
rows.append(("core backward torch", t(lambda: cuattn.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse))))
rows.append(("dout expanded .contiguous()", t(lambda: out.sum().expand_as(out).contiguous())))
cq = cupy.asarray(q.detach().float()); o, l = cuattn.attention(cq, cq, cq, return_lse=True)
csync = cupy.cuda.get_current_stream().synchronize
rows.append(("cupy merge host", t(lambda: cuattn.merge([o, o], [l, l]), sync=csync)))
s, e = cupy.cuda.Event(), cupy.cuda.Event()
s.record(); [cuattn.merge([o, o], [l, l]) for _ in range(200)]; e.record(); e.synchronize()
rows.append(("cupy merge per call incl GPU (200 queued)", cupy.cuda.get_elapsed_time(s, e) * 1e3 / 200))
