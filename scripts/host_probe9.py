"""Why the PyTorch forward under grad runs slower back-to-back than in bursts (H100 probe):
garbage cycles, GC time, allocator traffic."""
import collections, gc, time
import torch
import cuattn.torch as ct
from host_timing import rate

SHAPE = (1, 128, 4, 64)
q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
sync = torch.cuda.synchronize
spent = [0.0, 0, 0.0]
def cb(phase, info):
    if phase == "start": spent[2] = time.perf_counter()
    else: spent[0] += time.perf_counter() - spent[2]; spent[1] += 1
gc.callbacks.append(cb)
f = lambda: ct.attention(q, k, v)
for trial in range(2):
    for gc_on in (True, False):
        (gc.enable if gc_on else gc.disable)()
        spent[:] = [0.0, 0, 0.0]
        m0 = torch.cuda.memory_stats()
        r = rate(f, sync, 2000)
        m1 = torch.cuda.memory_stats()
        print(f"gc {gc_on}: rate {r:.1f} us; gc runs {spent[1]} taking {spent[0]*1e3:.1f} ms; device allocs {m1.get('num_device_alloc',0)-m0.get('num_device_alloc',0)} segs {m1['segment.all.current']}", flush=True)
gc.enable()
gc.collect()
gc.set_debug(gc.DEBUG_SAVEALL)
for _ in range(50): f()
gc.collect()
print(collections.Counter(type(o).__name__ for o in gc.garbage).most_common(15))
gc.set_debug(0); gc.garbage.clear()
with torch.no_grad():
    print("no_grad rate", rate(f, sync, 2000))
# GPU time per forward (events)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record();
for _ in range(200): f()
e.record(); sync(); print("events per call us", s.elapsed_time(e) / 200 * 1e3)
