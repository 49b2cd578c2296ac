"""Host cost of the ways to allocate a torch output and to read a tensor's layout (H100 probe)."""
import torch
from host_timing import host

shape, strides = (1, 128, 4, 64), (32768, 256, 64, 1)
dev = torch.device("cuda", 0)
proto = torch.empty(0, dtype=torch.bfloat16, device=dev)
x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
sync = torch.cuda.synchronize
for name, fn in {
    "empty_strided": lambda: torch.empty_strided(shape, strides, dtype=torch.bfloat16, device=dev),
    "empty": lambda: torch.empty(shape, dtype=torch.bfloat16, device=dev),
    "proto.new_empty": lambda: proto.new_empty(shape),
    "empty_like": lambda: torch.empty_like(x),
    "read 5": lambda: (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr()),
    "x.shape": lambda: x.shape,
    "x.stride()": lambda: x.stride(),
    "x.get_device()": lambda: x.get_device(),
    "x.data_ptr()": lambda: x.data_ptr(),
    "x.dtype": lambda: x.dtype,
}.items():
    print(f"{name:20s} {host(fn, sync, 200, 30):7.2f} us", flush=True)
