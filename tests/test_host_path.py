"""The host fast path (cuattn.replay) without a GPU: a fake device-array type stands in for a
framework, kernels and allocations are recorded instead of run. Pins what a repeated call does
on the host (no validation, two allocations, one launch, a bounded number of Python calls) and
that the replayed parameter structs are the ones the full path builds."""

from __future__ import annotations

import contextlib
import dataclasses
import ctypes
import importlib
import pathlib
import sys

import collections

import numpy as np
import pytest

import cuattn
from cuattn import boundary, loader, params, replay, tensor_map
from cuattn.kernels import backward as backward_kernels, forward
from cuattn.options import AttnOptions

attention_module = importlib.import_module("cuattn.attention")  # the package exports the function
backward_module = importlib.import_module("cuattn.backward")
decode_module = importlib.import_module("cuattn.decode")

ALIGN = 256
# Python calls of cuattn's code per repeated attention call: 36 on CPython 3.11 and 3.12 for the
# copying forward (CUATTN_TMA=0), 42 for the TMA forward, whose plan writes its three tensor
# maps' address words apart from the struct's other address words.
BUDGET = 46


def fake_encoder(out, data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle, promotion, fill):
    """cuTensorMapEncodeTiled as the Hopper drivers behave: addresses past 48 bits refused, the
    address kept in the map's first word alone."""
    if address >= 1 << 48:
        return 1  # CUDA_ERROR_INVALID_VALUE
    body = bytes(np.array([dims[i] for i in range(rank)] + [strides[i] for i in range(rank - 1)], np.uint64))
    body += bytes(np.array([box[i] for i in range(rank)], np.uint32)) + bytes([data_type, swizzle, promotion])
    ctypes.memmove(out, address.to_bytes(8, "little") + body.ljust(120, b"\0"), 128)
    return 0


class FakeArray:
    """A device array of a fake framework: shape, strides in elements, dtype, address."""

    def __init__(self, shape, dtype, ptr, strides=None):
        self.shape, self.dtype, self.ptr = tuple(shape), np.dtype(dtype), ptr
        self.strides = strides or tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))


class FakeDevice:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeFunction:
    """A loaded kernel; launches through cuLaunchKernel's arguments (``launch_kernel``) or
    CuPy's call, recording the parameter bytes either way."""

    functions: dict[int, FakeFunction] = {}

    def __init__(self, variant, launched):
        self.variant, self.launched, self.ptr = variant, launched, id(self)
        FakeFunction.functions[self.ptr] = self

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        (arg,) = args
        self.launched.append((self.variant.uri, grid, block, shared_mem, ctypes.string_at(arg.ptr, self.variant_struct().itemsize)))

    @staticmethod
    def launch_kernel(f, gx, gy, gz, bx, by, bz, shared_mem, stream, kernel_params, extra):
        function = FakeFunction.functions[f]
        struct_address = ctypes.c_void_p.from_address(kernel_params).value
        params = ctypes.string_at(struct_address, function.variant_struct().itemsize)
        function.launched.append((function.variant.uri, (gx, gy, gz), (bx, by, bz), shared_mem, params))

    def variant_struct(self):
        family = self.variant.family
        if self.variant.kernel == "forward_tma":
            return params.TMA_ATTN_PARAMS
        if self.variant.kernel == "backward_tma":
            return params.TMA_BACKWARD_PARAMS
        if self.variant.uri.startswith("merge/sum_partials/"):
            return params.SUM_PARAMS
        return params.MERGE_PARAMS if family == "merge" else params.BACKWARD_PARAMS if "backward" in family else params.ATTN_PARAMS


class FakeRawKernel:
    def __init__(self, variant, launched):
        self.kernel = FakeFunction(variant, launched)


@pytest.fixture
def fake(monkeypatch):
    """A fake framework registered with replay, a fake Hopper device, and recorded launches."""
    state = {"next": 1 << 32, "launched": [], "allocated": 0}

    def allocate(shape, dtype, device):
        a = FakeArray(shape, dtype, state["next"])
        state["next"] += ALIGN * (1 + a.dtype.itemsize * int(np.prod(shape)) // ALIGN)
        state["allocated"] += 1
        return a, a.ptr

    def scratch(nbytes, device):
        address = state["next"]
        state["next"] += ALIGN * (1 + nbytes // ALIGN)
        state["allocated"] += 1
        return None, address

    framework = replay._Framework(
        boundary.CUPY,
        read=lambda x: (x.shape, x.strides, x.dtype, 0, x.ptr),
        wrap=lambda x: boundary.DeviceArray(x.ptr, x.shape, x.strides, x.dtype, x),
        allocate=allocate,
        scratch=scratch,
        stream=lambda device: 0,
    )
    monkeypatch.setitem(replay._frameworks, FakeArray, framework)
    monkeypatch.setattr(replay, "_current_device", lambda: 0)
    monkeypatch.setattr(replay._Recorder, "device", property(lambda self: FakeDevice()))
    monkeypatch.setattr(replay._Recorder, "stream", property(lambda self: contextlib.nullcontext()))
    kernels = {}  # load_kernel is memoized: one kernel object per variant
    monkeypatch.setattr(loader, "load_kernel", lambda v: kernels.setdefault(v, FakeRawKernel(v, state["launched"])))
    monkeypatch.setattr(loader, "device_arch", lambda device_id=None: "sm_90a")
    # The driver's tensor-map encoder as Hopper machines have it (the address in the first word
    # alone), whether or not this machine has a driver: the dense forward plans the TMA kernel.
    monkeypatch.setattr(tensor_map, "_encoder", lambda: fake_encoder)
    monkeypatch.setattr(loader, "device_sm_count", lambda device_id: 132)
    monkeypatch.setattr(attention_module, "device_arch", lambda device_id=None: "sm_90a")
    monkeypatch.setattr(attention_module, "device_sm_count", lambda device_id: 132)
    monkeypatch.setattr(backward_module, "device_smem_limit", lambda device_id: 232448)
    monkeypatch.setattr(attention_module, "device_smem_limit", lambda device_id: 232448)
    monkeypatch.setattr(replay, "enabled", True)
    monkeypatch.setattr(replay, "_driver_launch", lambda: None)
    monkeypatch.setattr(replay, "_launch_kernel", FakeFunction.launch_kernel)
    monkeypatch.delenv("CUATTN_WGMMA", raising=False)
    monkeypatch.delenv("CUATTN_SMALL_BACKWARD", raising=False)
    monkeypatch.setattr(replay, "counters", replay.Counters())
    replay.clear()
    yield state
    replay.clear()


def _attn_params(launched: bytes) -> np.void:
    """The AttnParams of a launched forward's struct (on its own, or inside TmaAttnParams)."""
    if len(launched) == params.TMA_ATTN_PARAMS.itemsize:
        return np.frombuffer(launched, params.TMA_ATTN_PARAMS)[0]["attn"]
    return np.frombuffer(launched, params.ATTN_PARAMS)[0]


def _map_addresses(launched: bytes) -> tuple:
    """The addresses in the first words of a TMA forward's tensor maps of q, k and v."""
    tp = np.frombuffer(launched, params.TMA_ATTN_PARAMS)[0]
    return tuple(int.from_bytes(tp[name][:8].tobytes(), "little") for name in ("q_map", "k_map", "v_map"))


def _arrays(state, *shapes, dtype="float16"):
    out = []
    for shape in shapes:
        out.append(FakeArray(shape, dtype, state["next"]))
        state["next"] += ALIGN * (1 + 2 * int(np.prod(shape)) // ALIGN)
    return out


def test_a_repeated_call_records_once_and_then_only_allocates_and_launches(fake):
    q, k, v = _arrays(fake, (2, 100, 8, 64), (2, 300, 2, 64), (2, 300, 2, 64))
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, FakeArray) and out.shape == q.shape
    assert replay.counters.recordings == 2 and len(fake["launched"]) == 1
    for i in range(50):
        q2, k2, v2 = _arrays(fake, q.shape, k.shape, v.shape)  # new addresses every call
        out, lse = cuattn.attention(q2, k2, v2, causal=True, return_lse=True)
        assert lse.shape == (2, 8, 100) and lse.dtype == np.float32
    assert replay.counters.recordings == 2  # no validation or planning after the first call
    assert replay.counters.replays == 51 and replay.counters.launches == 51
    assert fake["allocated"] == 2 * 51


def test_replayed_parameters_are_the_full_paths_with_this_calls_addresses(fake):
    q, k, v = _arrays(fake, (3, 77, 4, 96), (3, 50, 1, 96), (3, 50, 1, 96))
    cuattn.attention(q, k, v, window=(5, 3), softcap=30.0)
    q, k, v = _arrays(fake, q.shape, k.shape, v.shape)
    out, lse = cuattn.attention(q, k, v, window=(5, 3), softcap=30.0, return_lse=True)
    wrap = lambda x: boundary.DeviceArray(x.ptr, x.shape, x.strides, x.dtype, x)  # noqa: E731
    options = AttnOptions.from_user(False, (5, 3), "bottom_right", None, 30.0, head_dim=96)
    expected = attention_module.tma_params("f16", attention_module.attn_params(*map(wrap, (q, k, v, out, lse)), options))
    assert fake["launched"][-1][0].startswith("forward_tma/")  # head_dim 96 on the 128 tile
    assert fake["launched"][-1][-1] == expected.tobytes()


def test_tma_kernels_that_do_not_fit_the_devices_shared_memory_give_way(fake, monkeypatch):
    """A Hopper part whose opt-in shared memory is below a TMA kernel's (none is today, every
    sm_90 part has 227 KB) gets the kernels that copy for themselves, forward and backward."""
    q, k, v, dout = _arrays(fake, (1, 300, 4, 128), (1, 300, 4, 128), (1, 300, 4, 128), (1, 300, 4, 128))
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    cuattn.attention_backward(dout, q, k, v, out, lse)
    assert {"forward_tma", "backward_tma"} <= {a[0].split("/")[0] for a in fake["launched"]}
    limit = min(forward.tma_smem_bytes(128), backward_kernels.tma_smem_bytes(128)) - 1
    monkeypatch.setattr(attention_module, "device_smem_limit", lambda device_id: limit)
    monkeypatch.setattr(backward_module, "device_smem_limit", lambda device_id: limit)
    replay.clear()
    fake["launched"].clear()
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    cuattn.attention_backward(dout, q, k, v, out, lse)
    kernels = [a[0].split("/")[0] for a in fake["launched"]]
    assert "forward_wgmma" in kernels and not {"forward_tma", "backward_tma"} & set(kernels), kernels


@pytest.mark.parametrize("page_size, copies", [(16, True), (64, False)])
def test_a_paged_prefill_maps_k_and_v_only_where_its_producer_loads_boxes(fake, monkeypatch, page_size, copies):
    """Chunked prefill over a paged cache on the TMA forward: pages under TMA_BOX_MIN_PAGE rows
    are copied by the producer (the `/copies` form, whose parameters carry q's tensor map alone),
    larger ones come as TMA boxes (k and v mapped with boxes of min(page size, BLOCK_N) rows).
    tma_plan decides and tma_params follows that decision."""
    monkeypatch.setattr(decode_module, "device_smem_limit", lambda device_id: 232448)
    monkeypatch.setattr(decode_module, "device_arch", lambda device_id=None: "sm_90a")
    batch, pages_per_seq = 2, 4
    q, k_cache, v_cache = _arrays(fake, (batch, 64, 8, 128), (batch * pages_per_seq, page_size, 2, 128), (batch * pages_per_seq, page_size, 2, 128))
    table, lengths = _arrays(fake, (batch, pages_per_seq), (batch,), dtype="int32")
    cuattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)
    uri, *_, struct = fake["launched"][-1]
    assert uri.startswith("forward_tma/") and "/paged_cache" in uri and uri.endswith("/copies") == copies, uri
    tp = np.frombuffer(struct, dtype=params.TMA_ATTN_PARAMS, count=1)[0]
    assert any(bytes(tp["q_map"])) and any(bytes(tp["k_map"])) != copies and any(bytes(tp["v_map"])) != copies


def test_grouped_queries_split_the_tma_backwards_key_blocks(fake, monkeypatch):
    """GQA 16:2 at 1k tokens: four CTAs per key block of the TMA backward (kernels.backward.
    tma_query_splits) add dK / dV into fp32 sums zeroed by a launch, rounded into dk and dv by
    two more, and the call replays; with as many KV heads as query heads, one CTA per key block
    writes dk and dv."""
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    for heads_kv, splits in ((2, 4), (16, 1)):
        q, k, v, dout = _arrays(fake, (16, 1024, 16, 128), (16, 1024, heads_kv, 128), (16, 1024, heads_kv, 128), (16, 1024, 16, 128))
        out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
        for call in range(2):
            fake["launched"].clear()
            recordings = replay.counters.recordings
            dq, dk, dv = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)
            assert replay.counters.recordings == recordings + (2 if call == 0 else 0)
            names = [launch[0].split("/")[0] + ("/sum_partials" if "sum_partials" in launch[0] else "") for launch in fake["launched"]]
            one_pass = next(launch for launch in fake["launched"] if launch[0].startswith("backward_tma/"))
            p = np.frombuffer(one_pass[-1], params.TMA_BACKWARD_PARAMS)[0]["bwd"]
            assert one_pass[1] == (8 * splits, heads_kv, 16) and int(p["query_splits"]) == splits
            if splits > 1:
                assert names == ["merge/sum_partials"] * 2 + ["backward_prep", "backward_tma", "backward_dq_finish"] + ["merge/sum_partials"] * 2
                assert p["sum_grads"] & 2 and int(p["dk"]) not in (dk.ptr, dv.ptr)
            else:
                assert names == ["backward_prep", "backward_tma", "backward_dq_finish"]
                assert not p["sum_grads"] & 2 and (int(p["dk"]), int(p["dv"])) == (dk.ptr, dv.ptr)


@pytest.mark.parametrize("small", ["1", "0"])
def test_backward_and_merge_replay_the_full_paths_parameters(fake, monkeypatch, small):
    """A small backward replays one launch of backward_small and allocates its three gradients
    only; the kernels of larger calls (CUATTN_SMALL_BACKWARD=0) are three launches and a scratch."""
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", small)
    q, k, v, dout = _arrays(fake, (2, 64, 4, 64), (2, 64, 4, 64), (2, 64, 4, 64), (2, 64, 4, 64))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    cuattn.attention_backward(dout, q, k, v, out, lse)
    first = fake["launched"][1:]
    fake["launched"].clear()
    allocated, launches = fake["allocated"], replay.counters.launches
    dq, dk, dv = cuattn.attention_backward(dout, q, k, v, out, lse)
    replayed = fake["launched"]
    assert [l[:4] for l in replayed] == [l[:4] for l in first]
    if small == "1":
        assert [l[0] for l in replayed] == ["backward_small/f16/d64/s64q64"] and replayed[0][1] == (2, 4, 2)
        assert fake["allocated"] - allocated == 3 and replay.counters.launches - launches == 1
    else:
        assert [l[0].split("/")[0] for l in replayed] == ["backward_prep", "backward_tma", "backward_dq_finish"]  # the fake Hopper's maps
        assert fake["allocated"] - allocated == 4 and replay.counters.launches - launches == 3
    # Only the gradient and scratch addresses (fresh allocations) differ from the first call.
    for a, b in zip(first, replayed):
        struct = params.TMA_BACKWARD_PARAMS if a[0].startswith("backward_tma/") else params.BACKWARD_PARAMS
        pa, pb = np.frombuffer(a[-1], struct)[0], np.frombuffer(b[-1], struct)[0]
        if struct is params.TMA_BACKWARD_PARAMS:
            assert [int.from_bytes(pb[f"{name}_map"][:8].tobytes(), "little") for name in ("q", "k", "v", "dout")] == [
                q.ptr, k.ptr, v.ptr, dout.ptr]
            pa, pb = pa["bwd"], pb["bwd"]
        assert pb["dq"] == dq.ptr and pb["dk"] == dk.ptr and pb["dv"] == dv.ptr
        assert pb["attn"].tobytes() == pa["attn"].tobytes() and pb["dout"] == pa["dout"] == dout.ptr

    o1, o2 = _arrays(fake, (1, 9, 2, 64), (1, 9, 2, 64))
    l1, l2 = _arrays(fake, (1, 2, 9), (1, 2, 9), dtype="float32")
    for _ in range(3):
        merged, merged_lse = cuattn.merge([o1, o2], [l1, l2])
    p = np.frombuffer(fake["launched"][-1][-1], params.MERGE_PARAMS)[0]
    assert list(p["outs"][:2]) == [o1.ptr, o2.ptr] and list(p["lses"][:2]) == [l1.ptr, l2.ptr]
    assert p["dst_out"] == merged.ptr and p["dst_lse"] == merged_lse.ptr and p["num_partials"] == 2
    stacked = FakeArray((2, 1, 9, 2, 64), "float16", fake["next"])
    stacked_lse = FakeArray((2, 1, 2, 9), "float32", fake["next"] + (1 << 20))
    for _ in range(2):
        cuattn.merge(stacked, stacked_lse)
    p = np.frombuffer(fake["launched"][-1][-1], params.MERGE_PARAMS)[0]
    assert list(p["outs"][:2]) == [stacked.ptr, stacked.ptr + 9 * 2 * 64 * 2]  # the partials' offsets


def test_a_repeated_call_stays_within_its_python_call_budget(fake):
    q, k, v = _arrays(fake, (1, 128, 4, 64), (1, 128, 4, 64), (1, 128, 4, 64))
    cuattn.attention(q, k, v)
    calls = []
    package = str(pathlib.Path(cuattn.__file__).parent)

    def profile(frame, event, arg):  # Python functions of cuattn, and what they call directly
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(package):
            calls.append(frame.f_code.co_name if event == "call" else getattr(arg, "__name__", "?"))

    sys.setprofile(profile)
    try:
        cuattn.attention(q, k, v)
    finally:
        sys.setprofile(None)
    # The fast path: attention, run, the option key, the plan's run and result picking; no
    # checks, no variant lookup, no struct packing.
    assert not {"check_qkv", "from_user", "kernel_fields", "attn_params", "pack", "select"} & set(calls)
    assert len(calls) <= BUDGET, calls


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"causal": 1}, TypeError),
        ({"scale": True}, TypeError),
        ({"window": (True, 0)}, TypeError),
        ({"window": [2.0, 0]}, TypeError),
        ({"scale": -1.0}, ValueError),
        ({"return_lse": 1}, TypeError),
        ({"align": "middle"}, ValueError),
        ({"window": [[1], 2]}, TypeError),  # unhashable: the full path reports it
    ],
)
def test_bad_options_raise_after_good_ones_were_cached(fake, kwargs, error):
    q, k, v = _arrays(fake, (1, 16, 2, 64), (1, 16, 2, 64), (1, 16, 2, 64))
    good = {"causal": True, "scale": 1.0, "window": (1, 0), "return_lse": True, "align": "top_left"}
    cuattn.attention(q, k, v, **good)
    cuattn.attention(q, k, v, **{**good, **{"window": [1, 0]}})
    with pytest.raises(error):
        cuattn.attention(q, k, v, **{**good, **kwargs})


_Window = collections.namedtuple("_Window", "left right")


@pytest.mark.parametrize("bad", [_Window(True, 0), _Window(1.0, 0)])
def test_a_tuple_subclass_window_is_keyed_by_its_items_types(fake, bad):
    """A namedtuple window was keyed by value alone (True == 1, 1.0 == 1): a bad one replayed
    the plan of a good one instead of raising the full path's TypeError."""
    q, k, v = _arrays(fake, (1, 16, 2, 64), (1, 16, 2, 64), (1, 16, 2, 64))
    for _ in range(2):
        cuattn.attention(q, k, v, window=_Window(1, 0))
    with pytest.raises(TypeError, match="window"):
        cuattn.attention(q, k, v, window=bad)


def test_an_int_seed_takes_the_full_path_even_without_dropout():
    """An int dropout_seed is no part of a plan's key; at dropout_p 0 such calls were replayed,
    so a bad seed after a good one raised nothing. They take the full path, which checks it."""
    from cuattn import dropout

    assert not dropout.replayable(0.0, 5, None) and dropout.replayable(0.0, None, None)
    q = np.ones((1, 16, 2, 64), np.float16)
    for seed in (-1, 2**64):
        with pytest.raises(ValueError, match=r"dropout_seed must be in \[0, 2\*\*64\)"):
            cuattn.attention(q, q, q, dropout_seed=seed)


def test_bad_arrays_raise_after_good_ones_were_cached(fake):
    q, k, v = _arrays(fake, (1, 16, 4, 64), (1, 16, 2, 64), (1, 16, 2, 64))
    cuattn.attention(q, k, v)
    bad_heads = _arrays(fake, (1, 16, 3, 64))[0]
    with pytest.raises(ValueError, match="heads_q"):
        cuattn.attention(q, bad_heads, bad_heads)
    bad_dtype = FakeArray(v.shape, "float32", v.ptr)
    with pytest.raises(TypeError, match="dtype"):
        cuattn.attention(q, k, bad_dtype)
    with pytest.raises(TypeError, match="v is required"):
        cuattn.attention(q, k, None)


def test_signatures_that_differ_only_in_strides_or_dtype_get_their_own_plans(fake):
    q, k, v = _arrays(fake, (1, 16, 2, 64), (1, 16, 2, 64), (1, 16, 2, 64))
    cuattn.attention(q, k, v)
    strided = FakeArray(q.shape, q.dtype, q.ptr, strides=(16 * 2 * 128, 2 * 128, 128, 1))
    cuattn.attention(strided, k, v)
    p = _attn_params(fake["launched"][-1][-1])
    assert tuple(p["q_strides"]) == (16 * 2 * 128, 2 * 128, 128)
    assert replay.counters.recordings == 4


def test_an_op_that_cannot_be_replayed_runs_its_full_path(fake):
    """heads_q = 0 zero-fills dK/dV with a memset: not a launch, so never replayed."""
    q = FakeArray((1, 8, 0, 64), "float16", 1 << 40)
    k, v = _arrays(fake, (1, 8, 2, 64), (1, 8, 2, 64))
    with pytest.raises(TypeError, match="must be a CuPy"):  # the full path does not know the fake type
        cuattn.attention_backward(q, q, k, v, q, FakeArray((1, 0, 8), "float32", 1 << 41))
    assert replay.run("x", lambda: None, (q,), ()) is replay.MISS  # cached as not replayable


def test_a_plan_recorded_with_aliased_arguments_serves_distinct_ones(fake):
    """Self-attention passes one array as q, k and v; each position still gets its own slot."""
    (x,) = _arrays(fake, (1, 16, 2, 64))
    cuattn.attention(x, x, x)
    q, k, v = _arrays(fake, (1, 16, 2, 64), (1, 16, 2, 64), (1, 16, 2, 64))
    cuattn.attention(q, k, v)
    p = _attn_params(fake["launched"][-1][-1])
    assert (p["q"], p["k"], p["v"]) == (q.ptr, k.ptr, v.ptr)
    assert _map_addresses(fake["launched"][-1][-1]) == (q.ptr, k.ptr, v.ptr)  # the tensor maps' too
    (o,) = _arrays(fake, (1, 9, 2, 64))
    (l,) = _arrays(fake, (1, 2, 9), dtype="float32")
    cuattn.merge([o, o], [l, l])
    o1, o2 = _arrays(fake, (1, 9, 2, 64), (1, 9, 2, 64))
    l1, l2 = _arrays(fake, (1, 2, 9), (1, 2, 9), dtype="float32")
    cuattn.merge([o1, o2], [l1, l2])
    p = np.frombuffer(fake["launched"][-1][-1], params.MERGE_PARAMS)[0]
    assert list(p["outs"][:2]) == [o1.ptr, o2.ptr] and list(p["lses"][:2]) == [l1.ptr, l2.ptr]


def test_negative_offsets_from_a_reversed_stack_are_replayed(fake):
    outs = FakeArray((2, 1, 8, 2, 64), "float16", 1 << 36)
    for base in ((1 << 37) + 64, (1 << 38) + 64):  # lses[::-1]: partial 1 lies 64 bytes below partial 0
        lses = FakeArray((2, 1, 2, 8), "float32", base, strides=(-16, 16, 8, 1))
        cuattn.merge(outs, lses)
        p = np.frombuffer(fake["launched"][-1][-1], params.MERGE_PARAMS)[0]
        assert list(p["lses"][:2]) == [lses.ptr, lses.ptr - 64]
    assert replay.counters.replays == 2 and replay.counters.recordings == 2


def test_backward_wrapper_still_refuses_double_backward():
    """cuattn.torch runs its backward without once_differentiable's no_grad scope when no graph
    of it is built; with create_graph=True the wrapper is there and differentiating the
    gradients again raises, as torch's own once_differentiable does."""
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("cuattn.torch")

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @ct._once_differentiable
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = torch.randn(4, requires_grad=True)
    (g,) = torch.autograd.grad(ct._raw_apply(Square)(x).sum(), x)
    torch.testing.assert_close(g, 2 * x.detach())
    assert not g.requires_grad
    w = torch.randn(4, requires_grad=True)  # an incoming gradient that itself requires grad
    (g,) = torch.autograd.grad((ct._raw_apply(Square)(x) * w).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def test_block_sparse_backwards_take_the_tma_backward_where_it_has_their_form(fake, monkeypatch):
    """A block-sparse backward on Hopper at head_dim 128 runs the TMA kernel's block-sparse form,
    after the schedule of its key blocks, one CTA per key block (a mask's steps are not split,
    even with grouped queries); at 64, whose form would spill, the copying fused kernel."""
    from cuattn import block_mask as bm

    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    for d, one_pass, key_blocks in ((128, "backward_tma/f16/d128/m64s2/sparse", 8), (64, "backward_wgmma_fused/f16/d64/", 16)):
        q, k, v, dout = _arrays(fake, (2, 1000, 8, d), (2, 1000, 2, d), (2, 1000, 2, d), (2, 1000, 8, d))
        mask = bm.local_global(1000, 1000, window_blocks=1)
        mask = mask.to(lambda a: _arrays(fake, a.shape, dtype=a.dtype)[0])
        out, lse = cuattn.attention(q, k, v, block_mask=mask, return_lse=True)
        fake["launched"].clear()
        cuattn.attention_backward(dout, q, k, v, out, lse, block_mask=mask)
        uris = [launch[0] for launch in fake["launched"]]
        passes = [u for u in uris if u.startswith(("backward_tma/", "backward_wgmma_fused/"))]
        assert len(passes) == 1 and passes[0].startswith(one_pass) and passes[0].endswith("/sparse"), uris
        assert uris[uris.index(passes[0]) - 1] == "sparse/block_schedule", uris
        launch = fake["launched"][uris.index(passes[0])]
        assert launch[1] == (key_blocks, 2, 2)  # 1000 keys in blocks of 128 (TMA) or 64, KV heads, sequences


def test_given_gradients_and_out_are_written_and_replayed_without_allocations(fake):
    """dq= / dk= / dv= (any subset) and the forward's out= are sources of the plan: a repeated
    call writes them through the replayed launches, allocates nothing for them and returns them."""
    q, k, v, dout = _arrays(fake, (2, 64, 4, 64), (2, 64, 2, 64), (2, 64, 2, 64), (2, 64, 4, 64))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    for subset in (("dq", "dk", "dv"), ("dk",)):
        replay.clear()
        recordings = replay.counters.recordings
        for _ in range(3):
            given = dict(zip(subset, _arrays(fake, *(dict(dq=q, dk=k, dv=v)[n].shape for n in subset))))
            allocated, replays = fake["allocated"], replay.counters.replays
            grads = cuattn.attention_backward(dout, q, k, v, out, lse, **given)
            assert replay.counters.replays == replays + 1 and fake["allocated"] - allocated == 3 - len(subset)
            for name, g in zip(("dq", "dk", "dv"), grads):
                assert g is given[name] if name in given else isinstance(g, FakeArray)
            p = np.frombuffer(fake["launched"][-1][-1], params.BACKWARD_PARAMS)[0]
            assert (int(p["dq"]), int(p["dk"]), int(p["dv"])) == tuple(g.ptr for g in grads)
        assert replay.counters.recordings == recordings + 2
    for order in ((False, True), (True, False)):  # recorded with out=q, a distinct out still comes back
        replay.clear()
        for alias in order:
            for _ in range(3):
                (dst,) = [q] if alias else _arrays(fake, q.shape)
                allocated, replays = fake["allocated"], replay.counters.replays
                assert cuattn.attention(q, k, v, out=dst) is dst
                assert cuattn.attention(q, k, v, out=dst, return_lse=True)[0] is dst
                assert replay.counters.replays == replays + 2 and fake["allocated"] == allocated + 1  # the lse
                assert _attn_params(fake["launched"][-1][-1])["out"] == dst.ptr
    replay.clear()
    empty = _arrays(fake, (2, 0, 4, 64), (2, 0, 4, 64), (2, 4, 0))
    e_out, e_lse = cuattn.attention(empty[0], k, v, return_lse=True)
    for dq in (empty[1], *_arrays(fake, (2, 0, 4, 64))):  # first the very array given as dout
        assert cuattn.attention_backward(empty[1], empty[0], k, v, e_out, e_lse, dq=dq)[0] is dq


def test_a_written_array_overlapping_another_misses_the_plan(fake):
    """Whether an output overlaps an input depends on addresses, which a plan does not fix: a
    call whose dk (or out) overlaps another array takes the full path (which raises its
    ValueError on real arrays; the fake type it does not know), after the same shapes replayed."""
    q, k, v, dout = _arrays(fake, (1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    dq, dk, dv = _arrays(fake, q.shape, k.shape, v.shape)
    cuattn.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    cuattn.attention(q, k, v, out=dq)
    replays = replay.counters.replays
    inside = lambda x: FakeArray(x.shape, x.dtype, x.ptr + 1024)  # noqa: E731 - overlaps x
    for bad in (dict(dk=inside(v)), dict(dk=inside(dq)), dict(dq=FakeArray(q.shape, q.dtype, lse.ptr)), dict(dv=inside(dout))):
        with pytest.raises(TypeError, match="must be a CuPy"):
            cuattn.attention_backward(dout, q, k, v, out, lse, **{**dict(dq=dq, dk=dk, dv=dv), **bad})
    for bad in (inside(q), inside(k)):
        with pytest.raises(TypeError, match="must be a CuPy"):
            cuattn.attention(q, k, v, out=bad)
    assert replay.counters.replays == replays
    (pair,) = _arrays(fake, (2, *k.shape))  # dk and dv adjacent: touching, not overlapping
    touching = [FakeArray(k.shape, k.dtype, pair.ptr + i * 2 * int(np.prod(k.shape))) for i in range(2)]
    cuattn.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=touching[0], dv=touching[1])
    assert replay.counters.replays == replays + 1


def test_an_append_whose_cache_overlaps_another_array_misses_the_plan(fake, monkeypatch):
    """attention_with_kvcache with k_new / v_new writes k_cache and v_cache: a call whose cache
    overlaps another argument (the other cache, the new rows, q, the lengths) takes the full
    path, which refuses it (the fake type it does not know), after the same shapes replayed;
    caches interleaved in one buffer (no shared element) replay."""
    monkeypatch.setattr(decode_module, "device_smem_limit", lambda device_id: 232448)
    monkeypatch.setattr(decode_module, "device_sm_count", lambda device_id: 132)
    monkeypatch.setattr(decode_module, "resident_ctas", lambda variant, device_id: 2)
    monkeypatch.setenv("CUATTN_PDL", "0")
    q, k_cache, v_cache, k_new, v_new = _arrays(fake, (2, 1, 8, 64), (2, 64, 2, 64), (2, 64, 2, 64), (2, 1, 2, 64), (2, 1, 2, 64))
    (lengths,) = _arrays(fake, (2,), dtype="int32")
    call = dict(cache_seqlens=lengths, k_new=k_new, v_new=v_new)
    cuattn.attention_with_kvcache(q, k_cache, v_cache, **call)
    replays = replay.counters.replays
    cuattn.attention_with_kvcache(q, k_cache, v_cache, **call)
    assert replay.counters.replays == replays + 1
    inside = lambda x, like: FakeArray(like.shape, like.dtype, x.ptr + 1024)  # noqa: E731 - within x
    for bad in (dict(v_cache=k_cache), dict(k_new=inside(k_cache, k_new)), dict(v_new=inside(v_cache, v_new)),
                dict(q=inside(v_cache, q)), dict(cache_seqlens=FakeArray((2,), "int32", k_cache.ptr + 4096))):
        args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, **call, **bad}
        with pytest.raises(TypeError, match="must be a CuPy"):
            cuattn.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    assert replay.counters.replays == replays + 1
    (kv,) = _arrays(fake, (2, 64, 2, 2, 64))  # (batch, capacity, k / v, heads_kv, head_dim): interleaved, apart
    strides = (64 * 256, 256, 64, 1)
    k_view, v_view = (FakeArray(k_cache.shape, "float16", kv.ptr + i * 128 * 2, strides=strides) for i in range(2))
    for _ in range(2):
        cuattn.attention_with_kvcache(q, k_view, v_view, **call)
    assert replay.counters.replays == replays + 3  # both served by plans (ranges that meet, no shared element)


def test_given_gradients_with_rows_apart_are_summed_into_by_their_row_stride(fake, monkeypatch):
    """Where dK / dV come from fp32 sums (the TMA backward's key-block splits under GQA), the
    rounding pass writes a given dk whose rows lie apart (a slice of a packed dqkv) by its
    own strides."""
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    shape_q, shape_kv = (4, 1024, 16, 128), (4, 1024, 2, 128)
    q, k, v, dout = _arrays(fake, shape_q, shape_kv, shape_kv, shape_q)
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    (packed,) = _arrays(fake, (4, 1024, 2, 2, 128))  # (batch, seqlen, dk / dv, heads_kv, head_dim)
    dk = FakeArray(shape_kv, "float16", packed.ptr, strides=(1024 * 512, 512, 128, 1))
    dv = FakeArray(shape_kv, "float16", packed.ptr + 256 * 2, strides=dk.strides)
    replays = replay.counters.replays
    for _ in range(2):
        fake["launched"].clear()
        cuattn.attention_backward(dout, q, k, v, out, lse, causal=True, dk=dk, dv=dv)
        sums = [np.frombuffer(l[-1], params.SUM_PARAMS)[0] for l in fake["launched"] if "sum_partials" in l[0]]
        rounding = [p for p in sums if p["out"]]
        assert [int(p["out"]) for p in rounding] == [dk.ptr, dv.ptr]
        assert all((int(p["out_stride"]), int(p["out_row_stride"]), int(p["row_elems"])) == (1024 * 512, 512, 256) for p in rounding)
    assert replay.counters.replays == replays + 2  # interleaved dk and dv (overlapping ranges, no shared element) replay


def test_given_gradients_must_be_writable_device_arrays():
    """NumPy arrays are uploaded, so a NumPy dq= could never receive the gradient: a TypeError
    before anything runs (dense and packed)."""
    q = np.ones((1, 8, 2, 64), np.float16)
    lse = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="dq= / dk= / dv= are written in place, which numpy arrays cannot be"):
        cuattn.attention_backward(q, q, q, q, q, lse, dq=np.empty_like(q))
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="dq= / dk= / dv= are written in place, which numpy arrays cannot be"):
        cuattn.attention_varlen_backward(q[0], q[0], q[0], q[0], q[0], lse[0], cu, cu, dv=np.empty_like(q[0]))


@pytest.mark.parametrize("count, levels", [(40, [3]), (300, [19, 2])])
def test_merge_of_many_partials_rounds_once(fake, count, levels):
    """More than 16 partials: groups of 16 merge into float32 scratch, the groups' results
    merge again (in groups while more than 16), and only the last launch writes the result's
    dtype; every group's scratch is its own, allocated with the outputs (a repeated call: the
    two results and one scratch buffer)."""
    outs = _arrays(fake, *[(1, 9, 2, 64)] * count)
    lses = _arrays(fake, *[(1, 2, 9)] * count, dtype="float32")
    for _ in range(3):
        fake["launched"].clear()
        allocated = fake["allocated"]
        merged, merged_lse = cuattn.merge(outs, lses)
    launched = [(uri, np.frombuffer(raw, params.MERGE_PARAMS)[0]) for uri, *_, raw in fake["launched"]]
    assert fake["allocated"] - allocated == 3
    assert [uri for uri, _ in launched] == (
        ["merge/f16/vec8/cap16/to_float"] * levels[0] + ["merge/float/vec4/cap16"] * sum(levels[1:]) + ["merge/float/vec4/cap16/to_f16"]
    )
    inputs = [(o.ptr, l.ptr) for o, l in zip(outs, lses)]
    at = 0
    for n in levels + [1]:
        step, at = launched[at:at + n], at + n
        assert [p["num_partials"] for _, p in step] == [min(16, len(inputs) - 16 * i) for i in range(n)]
        assert [(int(a), int(b)) for _, p in step for a, b in zip(p["outs"][:p["num_partials"]], p["lses"][:p["num_partials"]])] == inputs
        inputs = [(int(p["dst_out"]), int(p["dst_lse"])) for _, p in step]
    assert inputs == [(merged.ptr, merged_lse.ptr)]
    assert len({a for pair in (x for _, p in launched[:-1] for x in [(int(p["dst_out"]), int(p["dst_lse"]))]) for a in pair}) == 2 * sum(levels)


def test_traced_merge_of_many_partials_allocates_its_scratch_before_any_launch():
    """JAX sizes an op's buffers by tracing it up to its first launch: every group's float32
    scratch must be allocated by then."""
    import types

    outs = [types.SimpleNamespace(shape=(1, 9, 2, 64), dtype=np.dtype("float16")) for _ in range(300)]
    lses = [types.SimpleNamespace(shape=(1, 2, 9), dtype=np.dtype("float32")) for _ in range(300)]
    allocations = boundary.validate(cuattn.merge, outs, lses)
    assert allocations == [
        ((1, 9, 2, 64), np.dtype("float16")), ((1, 2, 9), np.dtype("float32")),
        ((19, 1, 9, 2, 64), np.dtype("float32")), ((19, 1, 2, 9), np.dtype("float32")),
        ((2, 1, 9, 2, 64), np.dtype("float32")), ((2, 1, 2, 9), np.dtype("float32")),
    ]


def test_a_plan_is_recorded_again_when_dependent_launches_change(fake, monkeypatch):
    """CUATTN_PDL is part of a plan's key, as the other switches that change what it launches,
    and a refused dependent launch drops every plan (recorded with dependent launches and the
    choices made for them, such as the decode's prefetch)."""
    from cuattn import launch

    q, k, v = _arrays(fake, (1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64))
    cuattn.attention(q, k, v)
    recordings = replay.counters.recordings
    cuattn.attention(q, k, v)
    assert replay.counters.recordings == recordings
    monkeypatch.setenv("CUATTN_PDL", "0")
    cuattn.attention(q, k, v)
    assert replay.counters.recordings == recordings + 2
    assert replay._plans
    monkeypatch.setattr(launch, "refused", None)
    with pytest.warns(RuntimeWarning, match="refused a programmatic dependent launch"):
        launch._refuse(801)
    assert not replay._plans


def test_a_cleared_cache_invalidates_the_plans_of_jax_traces(monkeypatch):
    """Each JAX trace keeps its own plans (replay.run_preallocated); replay.clear() (a refused
    dependent launch) reaches them too: they are keyed by its generation, so the next call
    records its plan afresh (launches no longer dependent). Choices the trace made and sized
    its buffers by (traced.decisions, the decode's prefetch among them) are replayed as traced."""

    class Buffer:  # an XLA buffer as the callback sees it; misaligned, so no recording is tried
        __cuda_array_interface__ = {"data": (4097, False)}

    plans = {}
    calls = []
    assert not replay.run_preallocated(plans, lambda: calls.append(1), [Buffer()], [Buffer()], 0, 0, ())
    assert not replay.run_preallocated(plans, lambda: calls.append(1), [Buffer()], [Buffer()], 0, 0, ())
    assert len(plans) == 1 and not calls
    replay.clear()
    assert not replay.run_preallocated(plans, lambda: calls.append(1), [Buffer()], [Buffer()], 0, 0, ())
    assert len(plans) == 2 and not calls


def test_split_sums_are_sized_where_the_fused_kernel_does_not_run(monkeypatch):
    """A JAX call traced on a Hopper GPU sized the TMA backward's split dK / dV sums; run on a
    device that takes the unfused kernels (decisions replayed), the op must allocate the same
    buffers (unused there, as the dQ accumulator is) and leave the gradients where they are."""
    allocated = []

    class Replaying:
        def decide(self, name, choose):
            return {"tma_query_splits": 4}[name]

        def empty(self, shape, dtype):
            allocated.append((tuple(shape), np.dtype(dtype)))
            return boundary.DeviceArray(0, tuple(shape), boundary._contiguous_strides(shape), np.dtype(dtype), None)

    p = params.new(params.BACKWARD_PARAMS)
    grads = [boundary.DeviceArray(1 << 20, (1, 8, 2, 64), (1024, 128, 64, 1), np.dtype(np.float16), None) for _ in range(3)]
    assert backward_module._split_key_blocks(Replaying(), "f16", p, None, grads, False, fused=False) is None
    assert allocated == [((1, 8, 2, 64), np.dtype(np.float32))] * 2
    assert int(p["query_splits"]) == 0 and int(p["sum_grads"]) == 0 and int(p["dk"]) == 0


def test_replayed_calls_mark_the_arrays_they_write(fake, monkeypatch):
    """A framework whose autograd tracks in-place writes (PyTorch: version counters) hears of
    every array a replayed call writes: merge_'s out and lse, the backward's given gradients;
    nothing for a call that writes none."""
    marked = []
    framework = replay._frameworks[FakeArray]
    monkeypatch.setitem(replay._frameworks, FakeArray, dataclasses.replace(framework, mark_written=lambda *a: marked.append(a)))
    o1, o2 = _arrays(fake, (1, 9, 2, 64), (1, 9, 2, 64))
    l1, l2 = _arrays(fake, (1, 2, 9), (1, 2, 9), dtype="float32")
    for _ in range(3):
        cuattn.merge_(o1, l1, o2, l2)
    assert marked[-1] == (o1, l1) and len(marked) >= 1
    q, k, v, dout, dq, dk = _arrays(fake, *[(1, 64, 2, 64)] * 6)
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    before = len(marked)
    for _ in range(3):
        cuattn.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk)
    assert marked[-1] == (dq, dk) and len(marked) > before
    before = len(marked)
    cuattn.attention(q, k, v)
    cuattn.attention(q, k, v)
    assert len(marked) == before
