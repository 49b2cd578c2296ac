"""README.md agrees with the code: its opening example uses public names only (and runs, on a
GPU), and every error its Errors section lists is raised, with the class it says. The CPU
triggers run without a GPU: NumPy inputs (and stand-in DLPack arrays) are checked before any
upload."""

from __future__ import annotations

import ast
import builtins
import pathlib
import re

import numpy as np
import pytest

import cuattn

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()


# --- the opening example ---------------------------------------------------------------------


def opening_example() -> str:
    """The README's first code block, which must come before its first section."""
    match = re.search(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)
    assert match and match.group(1) == "python", "the README must open with a python example"
    assert match.start() < README.index("\n## "), "the example must come before the first section"
    return match.group(2)


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    """``["cuattn", "reference", "attention"]`` for ``cuattn.reference.attention``."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


def test_opening_example_is_python_on_public_names():
    tree = ast.parse(opening_example())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert imported == {"numpy", "cuattn"}, imported
    assert not any(isinstance(node, ast.ImportFrom) for node in ast.walk(tree))
    chains = [c for node in ast.walk(tree) if isinstance(node, ast.Attribute) and (c := _attribute_chain(node)) and c[0] == "cuattn"]
    assert chains, "the example calls nothing in cuattn"
    for chain in chains:
        assert chain[1] in cuattn.__all__, f"cuattn.{chain[1]} is not public"
        obj = cuattn
        for name in chain[1:]:
            assert not name.startswith("_"), ".".join(chain)
            obj = getattr(obj, name)  # AttributeError: the README names something that does not exist


@pytest.mark.gpu
def test_opening_example_runs():
    exec(compile(opening_example(), "README.md", "exec"), {})


# --- the errors ------------------------------------------------------------------------------


def _top_level_items(text: str) -> list[str]:
    """``text`` split at the semicolons outside parentheses."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == ";" and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip().rstrip("."))
    return items


def listed_errors() -> dict[type, list[str]]:
    """The Errors section's bullets: exception class -> the cases listed for it."""
    section = README[README.index("\n## Errors"):]
    section = section[:section.index("\n## ", 1)]
    bullets = [(name, " ".join(text.split())) for name, text in re.findall(r"^- `(\w+)`: (.+?)(?=^- |^$)", section, re.M | re.S)]
    assert {name for name, _ in bullets} == {"TypeError", "ValueError"}, bullets
    return {getattr(builtins, name): _top_level_items(text) for name, text in bullets}


class ForeignArray:
    """A stand-in for another framework's array: it says where it lives (DLPack device type
    and index, ``2`` for CUDA) and is never read."""

    def __init__(self, shape, device, dtype=np.float16):
        self.shape, self.dtype, self._device = tuple(shape), np.dtype(dtype), device
        self.ndim = len(self.shape)

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("validation should have refused this array before reading it")

    def __dlpack_device__(self):
        return self._device


def _qkv(b=1, sq=4, sk=5, hq=4, hk=2, d=64, dtype=np.float16):
    return np.ones((b, sq, hq, d), dtype), np.ones((b, sk, hk, d), dtype), np.ones((b, sk, hk, d), dtype)


def _mask():
    """A block mask of _attention's lengths (4 queries, 5 keys)."""
    return cuattn.block_mask.from_dense(np.ones((1, 1), bool), 4, 5)


def _attention(*change, **options):
    """cuattn.attention on the default NumPy inputs, ``change(q, k, v)`` applied first."""
    q, k, v = _qkv()
    for c in change:
        q, k, v = c(q, k, v)
    return cuattn.attention(q, k, v, **options)


def _backward(**changes):
    q, k, v = _qkv()
    args = {"dout": q, "q": q, "k": k, "v": v, "out": q, "lse": np.zeros((1, 4, 4), np.float32)}
    options = {key: changes.pop(key) for key in ("deterministic", "dlse") if key in changes}
    return cuattn.attention_backward(*{**args, **changes}.values(), **options)


def _cpu_torch():
    torch = pytest.importorskip("torch")
    return cuattn.attention(*(torch.ones(x.shape, dtype=torch.float16) for x in _qkv()))


def _foreign(devices):
    q, k, v = _qkv()
    return [ForeignArray(x.shape, d) for x, d in zip((q, k, v), devices)]


# (class, a phrase of the README's bullet for that class, what the message must say, a call that
# raises it)
CPU_TRIGGERS = [
    (TypeError, "an unsupported dtype", "q has dtype float64", lambda: _attention(lambda q, k, v: (q.astype(np.float64), k, v))),
    (TypeError, "an unsupported dtype", "q has dtype int16", lambda: _attention(lambda q, k, v: (q.astype(np.int16), k.astype(np.int16), v.astype(np.int16)))),
    (TypeError, "take `q`'s dtype", "k has dtype float32 but q", lambda: _attention(lambda q, k, v: (q, k.astype(np.float32), v))),
    (TypeError, "take `q`'s dtype", "dout has dtype float32 but q", lambda: _backward(dout=np.ones((1, 4, 4, 64), np.float32))),
    (TypeError, "must be float32", "lse must be float32", lambda: _backward(lse=np.zeros((1, 4, 4), np.float64))),
    (TypeError, "must be float32", "dlse must be float32", lambda: _backward(dlse=np.zeros((1, 4, 4), np.float16))),
    (TypeError, "must be float32", r"lses\[0\] must be float32", lambda: cuattn.merge([np.ones((1, 3, 2, 8), np.float32)] * 2, [np.zeros((1, 2, 3), np.float16)] * 2)),
    (TypeError, "different frameworks", "k is a dlpack array but q is a numpy array", lambda: cuattn.attention(_qkv()[0], *_foreign([(2, 0), (2, 0), (2, 0)])[1:])),
    (TypeError, "not an array", "got list", lambda: cuattn.attention(_qkv()[0].tolist(), *_qkv()[1:])),
    (TypeError, "given as `None`", "out is required", lambda: _backward(out=None)),
    (TypeError, "`causal`", "causal must be a bool", lambda: _attention(causal="yes")),
    (TypeError, "`return_lse`", "return_lse must be a bool", lambda: _attention(return_lse=1)),
    (TypeError, "`deterministic`", "deterministic must be a bool", lambda: _backward(deterministic="yes")),
    (TypeError, "`window` bound not an integer", "window", lambda: _attention(window=(2.5, 0))),
    (TypeError, "not a real number", "scale", lambda: _attention(scale="0.125")),
    (TypeError, "not a real number", "softcap", lambda: _attention(softcap="30")),
    (TypeError, "`out=`", "out=", lambda: _attention(out=np.ones((1, 4, 4, 64), np.float16))),
    (TypeError, "`merge_`", "merge_", lambda: cuattn.merge_(np.ones((1, 3, 2, 8), np.float32), np.zeros((1, 2, 3), np.float32),
                                                   np.ones((1, 3, 2, 8), np.float32), np.zeros((1, 2, 3), np.float32))),
    (ValueError, "wrong rank", "q must have 4 dimensions", lambda: _attention(lambda q, k, v: (q[0], k, v))),
    (ValueError, "wrong rank", "lse must have 3 dimensions", lambda: _backward(lse=np.zeros((4, 4), np.float32))),
    (ValueError, "`k` / `v` against `q`", "v has shape", lambda: _attention(lambda q, k, v: (q, k, v[:, :3]))),
    (ValueError, "`k` / `v` against `q`", "k has shape", lambda: _attention(lambda q, k, v: (q, k[..., :32], v[..., :32]))),
    (ValueError, "multiple of `heads_kv`", "heads_kv", lambda: _attention(lambda q, k, v: (q, np.ones((1, 5, 3, 64), np.float16), np.ones((1, 5, 3, 64), np.float16)))),
    (ValueError, "`lse` not `(batch, heads_q, seqlen_q)`", "lse has shape", lambda: _backward(lse=np.zeros((1, 4, 2), np.float32))),
    (ValueError, "unsupported `head_dim`", "head_dim 12", lambda: _attention(lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]))),
    (ValueError, "without unit stride", "q must have unit stride", lambda: _attention(lambda q, k, v: (np.ones((1, 4, 4, 128), np.float16)[..., ::2], k, v))),
    (ValueError, "not in CUDA device memory", "q is not in CUDA device memory", lambda: cuattn.attention(*_foreign([(1, 0), (1, 0), (1, 0)]))),
    (ValueError, "a CPU PyTorch tensor", "q is on device 'cpu'", _cpu_torch),
    (ValueError, "different devices", "k is on device 1 but q is on device 0", lambda: cuattn.attention(*_foreign([(2, 0), (2, 1), (2, 0)]))),
    (ValueError, "normal float32", "scale", lambda: _attention(scale=-0.5)),
    (ValueError, "normal float32", "scale", lambda: _attention(scale=float("nan"))),
    (ValueError, "normal float32", "scale", lambda: _attention(scale=1e-50)),  # positive in float64, 0 in float32
    (ValueError, "normal float32", "softcap", lambda: _attention(softcap=1e39)),  # finite in float64, inf in float32
    (ValueError, "below -1", "window", lambda: _attention(window=(-4, 2))),
    (ValueError, "not a pair", "window", lambda: _attention(window=(3,))),
    (ValueError, "`align`", "align", lambda: _attention(align="center")),
    (ValueError, "`cu_seqlens` not int32", "cu_seqlens_q must be int32", lambda: _varlen(cu_seqlens_q=np.array([0, 4], np.int64))),
    (ValueError, "not starting at 0", "cu_seqlens_k must start at 0", lambda: _varlen(cu_seqlens_k=np.array([1, 5], np.int32))),
    (ValueError, "decreasing", "cu_seqlens_q must be non-decreasing", lambda: _varlen(cu_seqlens_q=np.array([0, 4, 2, 4], np.int32), cu_seqlens_k=np.array([0, 5, 5, 5], np.int32))),
    (ValueError, "not ending at the row count", "cu_seqlens_k must end at the number of rows", lambda: _varlen(cu_seqlens_k=np.array([0, 3], np.int32))),
    (ValueError, "a `max_seqlen` below a sequence's length", "max_seqlen_q", lambda: _varlen(max_seqlen_q=3)),
    (ValueError, "values outside the cache", r"cache_seqlens\[0\] is 9, outside \[0, 5\]", lambda: cuattn.attention_with_kvcache(
        *_qkv(), cache_seqlens=np.array([9], np.int32))),
    (TypeError, "`dropout_p` not a real number", "dropout_p", lambda: _attention(dropout_p="0.1", dropout_seed=1)),
    (TypeError, "not uint32 / int64 / uint64", "dropout_seed", lambda: _attention(dropout_p=0.1, dropout_seed=np.zeros(2, np.float32))),
    (ValueError, "`dropout_p` outside [0, 1)", "dropout_p", lambda: _attention(dropout_p=1.0, dropout_seed=1)),
    (ValueError, "without a `dropout_seed`", "dropout_seed", lambda: _attention(dropout_p=0.1)),
    (ValueError, "an int seed outside [0, 2**64)", "dropout_seed", lambda: _attention(dropout_p=0.1, dropout_seed=2**64)),
    (ValueError, "not 8 bytes", "dropout_seed", lambda: _attention(dropout_p=0.1, dropout_seed=np.zeros(3, np.uint32))),
    (ValueError, "dropout with `sink_tokens`", "sink_tokens", lambda: _attention(window=(1, 0), sink_tokens=1, dropout_p=0.1, dropout_seed=1)),
    (TypeError, "not a `BlockMask`", "block_mask must be", lambda: _attention(block_mask=np.ones((1, 1), bool))),
    (TypeError, "not int32", "block_mask.kv_counts must be int32", lambda: _attention(block_mask=_mask().to(lambda a: a.astype(np.int64)))),
    (ValueError, "built for other lengths", "block_mask was built", lambda: _attention(block_mask=cuattn.block_mask.from_dense(np.ones((1, 1), bool), 4, 4))),
    (ValueError, "neither 1 nor the call's", "heads_q", lambda: _attention(block_mask=cuattn.block_mask.from_dense(np.ones((1, 3, 1, 1), bool), 4, 5))),
    (ValueError, "not C-contiguous", "contiguous", lambda: _attention(block_mask=_mask().to(lambda a: np.repeat(a, 8, axis=1)[:, ::2]))),
    (ValueError, "a block mask with dropout", "dropout", lambda: _attention(block_mask=_mask(), dropout_p=0.1, dropout_seed=1)),
]


def _varlen(**changes):
    """cuattn.attention_varlen on one NumPy sequence of 4 queries and 5 keys, ``changes`` applied."""
    q, k, v = (x[0] for x in _qkv())
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": np.array([0, 4], np.int32), "cu_seqlens_k": np.array([0, 5], np.int32)}
    options = {key: changes.pop(key) for key in ("max_seqlen_q",) if key in changes}
    return cuattn.attention_varlen(*{**args, **changes}.values(), **options)


def _cupy_qkv(shape=(1, 5, 2, 64)):
    import cupy

    return [cupy.ones(shape, np.float16) for _ in range(3)]


def _misaligned():
    import cupy

    q = cupy.ones(1 * 5 * 2 * 64 + 1, np.float16)[1:].reshape(1, 5, 2, 64)  # 2 bytes past an aligned address
    return cuattn.attention(q, *_cupy_qkv()[1:])


def _overlapping_out(which):
    import cupy

    q, k, v = _cupy_qkv()
    out = k if which == "k" else cupy.broadcast_to(cupy.ones((1, 1, 2, 64), np.float16), q.shape)
    return cuattn.attention(q, k, v, out=out)


def _overlapping_merge():
    import cupy

    rows, lses = cupy.ones((1, 9, 2, 64), np.float16), cupy.zeros((1, 2, 9), np.float32)
    return cuattn.merge_(rows[:, 1:], lses[..., 1:].copy(), rows[:, :-1], lses[..., :-1])


def _overlapping_caches():
    import cupy

    cache, new = cupy.ones((1, 16, 2, 64), np.float16), cupy.ones((1, 1, 2, 64), np.float16)
    return cuattn.append_kv(new, new.copy(), cache, cache, cache_seqlens=cupy.zeros(1, np.int32))


def _bad_device_offsets():
    import cupy

    q, k, v = (x[0] for x in _cupy_qkv())
    cuattn.attention_varlen(q, k, v, cupy.array([0, 3, 1, 5], np.int32), cupy.array([0, 2, 4, 5], np.int32))
    cuattn.check_varlen_offsets()

# What only device arrays can show (NumPy arrays are uploaded contiguous, and cannot be out=).
GPU_TRIGGERS = [
    (ValueError, "multiples of 8 elements", "q strides", lambda: cuattn.attention(*(x[..., :64] for x in _cupy_qkv((1, 5, 2, 68))))),
    (ValueError, "16-byte aligned", "q strides", _misaligned),
    (ValueError, "overlaps `k`, `v`", "out overlaps k", lambda: _overlapping_out("k")),
    (ValueError, "or itself", "out has overlapping elements", lambda: _overlapping_out("itself")),
    (ValueError, "checked on the GPU", "cu_seqlens_q decreases at entry 2", _bad_device_offsets),
    (ValueError, "`merge_`'s `out` / `lse` overlapping", "out overlaps out_b", _overlapping_merge),
    (ValueError, "`k_cache` / `v_cache` overlap", "k_cache overlaps v_cache", _overlapping_caches),
]

ALLOWED = [(ValueError, "`out=q`, the very same array, is allowed")]


def _ids(triggers):
    return [f"{cls.__name__}: {phrase}" for cls, phrase, _, _ in triggers]


def test_every_listed_error_has_a_trigger():
    phrases = {(cls, phrase) for cls, phrase, _, _ in CPU_TRIGGERS + GPU_TRIGGERS} | set(ALLOWED)
    for cls, items in listed_errors().items():
        for item in items:
            assert any(c is cls and p in item for c, p in phrases), f"README lists a {cls.__name__} that no test raises: {item!r}"


@pytest.mark.parametrize(
    "cls, phrase, match, call",
    [*CPU_TRIGGERS, *(pytest.param(*t, marks=pytest.mark.gpu) for t in GPU_TRIGGERS)],  # device arrays need a GPU
    ids=_ids(CPU_TRIGGERS + GPU_TRIGGERS),
)
def test_listed_error_is_raised(cls, phrase, match, call):
    assert any(phrase in item for item in listed_errors()[cls]), f"README's {cls.__name__} bullet does not list {phrase!r}"
    with pytest.raises(cls, match=match):
        call()


@pytest.mark.gpu
def test_out_may_be_q_itself():
    assert any(ALLOWED[0][1] in item for item in listed_errors()[ALLOWED[0][0]])
    import cupy

    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((1, 33, 2, 64)).astype(np.float16)) for _ in range(3))
    expected = cuattn.reference.attention(q.get(), k.get(), v.get(), causal=True)
    assert cuattn.attention(q, k, v, causal=True, out=q) is q
    np.testing.assert_allclose(q.get().astype(np.float64), expected, atol=1e-2)


def test_errors_are_described_in_one_place():
    """TypeError / ValueError appear in the Errors section only, so that no other sentence can
    drift from what the tests above check."""
    section_start = README.index("\n## Errors")
    section_end = README.index("\n## ", section_start + 1)
    for name in ("TypeError", "ValueError"):
        outside = [m.start() for m in re.finditer(name, README) if not section_start <= m.start() < section_end]
        assert not outside, f"{name} is mentioned outside the Errors section"
