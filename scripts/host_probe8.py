"""Where the PyTorch forward+backward's host time goes (H100 probe): the forward under grad,
the backward alone (retained graph), the core backward on torch tensors, GC's share."""
import gc
import torch, torch.nn.functional as F
import cuattn.torch as ct
from cuattn.backward import attention_backward
from host_timing import host, rate

SHAPE = (1, 128, 4, 64)
q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
sdpa = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
sync = torch.cuda.synchronize
def show(name, fn, calls=1000, burst=20):
    print(f"{name:40s} rate {rate(fn, sync, calls):8.1f}  host {host(fn, sync, burst):8.1f} us", flush=True)
for name, f in (("cuattn", ct.attention), ("sdpa", sdpa)):
    show(f"fwd grad {name}", lambda: f(q, k, v))
    loss = f(q, k, v).sum()
    show(f"bwd retained {name}", lambda: loss.backward(retain_graph=True))
    show(f"f+b {name}", lambda: f(q, k, v).sum().backward(), 500, 10)
    gc.disable()
    show(f"f+b {name} gc off", lambda: f(q, k, v).sum().backward(), 500, 10)
    gc.enable()
    show(f"sum+backward only {name}", lambda: (q * 1).sum().backward(), 500, 10)
out, lse = ct.attention(q.detach(), k.detach(), v.detach(), return_lse=True)
dout = torch.randn_like(out)
qd, kd, vd = q.detach(), k.detach(), v.detach()
show("core backward torch", lambda: attention_backward(dout, qd, kd, vd, out, lse))
show("core backward torch det", lambda: attention_backward(dout, qd, kd, vd, out, lse, deterministic=True))
e = torch.ones((), device="cuda").expand(SHAPE).to(torch.bfloat16)
show("expanded.contiguous", lambda: torch.ones((), device="cuda", dtype=torch.bfloat16).expand(SHAPE).contiguous())
show("empty_strided", lambda: torch.empty_strided(SHAPE, (SHAPE[1]*SHAPE[2]*SHAPE[3], SHAPE[2]*SHAPE[3], SHAPE[3], 1), dtype=torch.bfloat16, device="cuda"))
show("no_grad ctx", lambda: torch.no_grad().__enter__())
print("gc counts", gc.get_count(), gc.get_threshold(), gc.get_stats())
