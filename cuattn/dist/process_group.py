"""The ring's exchanges between processes, over a ``torch.distributed`` process group.

One process per rank runs its rank's generator (cuattn/dist/ring.py) and carries out what it
yields: ``("send", channel, sent, into)`` posts a send of ``sent`` to the next rank and a
receive into ``into`` from the previous one, ``("wait", channel)`` makes the compute stream
wait for them. Both channels ("kv", and "acc" in the backward) may be in flight at once; each
has its own tag and every rank posts them in the same order.

With NCCL the transfers run on the process group's stream, ordered after the work the compute
stream had queued when they were posted (NCCL's own stream semantics) and awaited by the
compute stream without blocking the host: what is in flight while a step's kernels run (the
K/V of the next step, the backward's accumulators of the shard held) overlaps them.
Other backends (gloo) move host memory only: each send is staged through host memory and each
wait blocks the host until the data is back on the device. That serves tests and debugging on
machines without NCCL peers (several processes on one GPU); it does not overlap anything.
"""

from __future__ import annotations

from cuattn import boundary

_CHANNELS = ("kv", "acc")


def check_comm(comm):
    """The process group ``comm`` (a ``torch.distributed.ProcessGroup``, which an initialized
    default group must exist for); raises before any launch."""
    import sys

    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    group_type = getattr(getattr(dist, "distributed_c10d", None), "ProcessGroup", None) if dist is not None else None
    if group_type is None or not isinstance(comm, group_type):
        raise TypeError(f"comm must be a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD), got {type(comm).__name__}")
    if not dist.is_initialized():
        raise ValueError("comm: torch.distributed is not initialized (call torch.distributed.init_process_group first)")
    return comm


def nccl_moves_cuda(config: str) -> bool:
    """Whether a process group of backend config ``config`` (``get_backend_config``: "nccl",
    "cuda:nccl", or "cpu:gloo,cuda:nccl", the default where none was named) sends CUDA
    tensors over NCCL."""
    for part in config.lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        if backend == "nccl" and device in ("", "cuda"):
            return True
    return False


class ProcessGroupExchange:
    """This process's rank of the ring ``group``: its neighbours and how data reaches them."""

    def __init__(self, group):
        import torch
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.world = group.size()  # group-local, as ProcessGroup.send / recv take their peers
        self.rank = group.rank()
        self.next = (self.rank + 1) % self.world
        self.prev = (self.rank - 1) % self.world
        self.staged = not nccl_moves_cuda(dist.get_backend_config(group))
        # torch's batch_isend_irecv coalesces (one NCCL group) where it does: exactly a
        # ProcessGroup whose backend for the device moved supports coalescing.
        self._device = torch.device("cpu" if self.staged else "cuda")
        coalescing = None
        if type(group) is dist.ProcessGroup and all(hasattr(group, m) for m in ("_start_coalescing", "_end_coalescing", "_get_backend")):
            try:
                coalescing = bool(group._get_backend(self._device).supports_coalescing)
            except (RuntimeError, AttributeError):  # no backend for the device: torch's own path reports it
                coalescing = None
        self._coalescing = coalescing  # None: post through batch_isend_irecv
        if coalescing is None:  # torch's P2POp takes global ranks (group_peer= only from torch 2.6)
            self._peers = (dist.get_global_rank(group, self.next), dist.get_global_rank(group, self.prev))

    def drive(self, ctx, generator) -> None:
        """Runs ``generator`` with torch's current stream set to the call's (``ctx.stream``):
        tensors the exchange allocates and NCCL's stream order follow it. ``ctx`` None: the
        arrays are host tensors (tests of the transport)."""
        if ctx is None:
            return self._run(generator)
        import contextlib

        import torch

        with ctx.device:
            device = torch.device("cuda", ctx.device.id)
            same = torch.cuda.current_stream(device).cuda_stream == ctx.stream.ptr
            with contextlib.nullcontext() if same else torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream.ptr, device=device)):
                self._run(generator)

    def _run(self, generator) -> None:
        in_flight = {}
        for op in generator:
            kind, channel = op[:2]
            if kind == "send":
                if channel in in_flight:
                    raise AssertionError(f"exchange {channel!r} posted again before it was awaited")
                in_flight[channel] = self._post(channel, [_tensor(a) for a in op[2]], [_tensor(a) for a in op[3]])
            else:
                self._finish(*in_flight.pop(channel))
        if in_flight:
            raise AssertionError(f"exchanges never awaited: {sorted(in_flight)}")

    def _post(self, channel: str, sent: list, into: list) -> tuple:
        if self.world == 1:  # the rank sends to itself
            for src, dst in zip(sent, into):
                dst.copy_(src)
            return (), (), (), ()
        tag = _CHANNELS.index(channel)
        if self.staged:
            host_sent = [t.cpu() for t in sent]  # waits for the compute stream's writes
            host_into = [t.new_empty(t.shape, device="cpu") for t in into]
            requests = self._exchange(host_sent, host_into, tag)
            return requests, host_into, into, host_sent
        return self._exchange(sent, into, tag), (), (), (sent, into)

    def _exchange(self, sent: list, into: list, tag: int) -> list:
        """Posts the sends of ``sent`` to the next rank and the receives into ``into`` from the
        previous one, as torch.distributed.batch_isend_irecv does (one NCCL group where the
        backend coalesces), through the ProcessGroup's own methods; the requests to wait on."""
        group, coalescing = self.group, self._coalescing
        if coalescing:
            device = self._device
            group._start_coalescing(device)
            for t in sent:
                group.send([t], self.next, tag)  # inside the group: no request of its own (None)
            for t in into:
                group.recv([t], self.prev, tag)
            work = group._end_coalescing(device)  # the group's one request
            return [] if work is None else [work]
        if coalescing is False:  # gloo: a request per transfer
            return [group.send([t], self.next, tag) for t in sent] + [group.recv([t], self.prev, tag) for t in into]
        dist = self._dist  # a ProcessGroup subclass or a torch without these methods: torch's own call
        ops = [dist.P2POp(dist.isend, t, self._peers[0], group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self._peers[1], group, tag) for t in into]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def _finish(requests, host_into, into, keep) -> None:
        for request in requests:
            request.wait()  # NCCL: the current (compute) stream waits; gloo: the host waits
        for src, dst in zip(host_into, into):
            dst.copy_(src)


def _tensor(a):
    """A torch tensor over the memory of ``a`` (a DeviceArray of this call, or a tensor)."""
    import torch

    native = a.native if isinstance(a, boundary.DeviceArray) else a
    return native if isinstance(native, torch.Tensor) else torch.from_dlpack(native)
