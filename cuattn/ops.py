"""The ops that framework adapters (:mod:`cuattn.torch`, :mod:`cuattn.jax`) wrap, as data.

Each entry names its array arguments, its static options with their types, the shapes and
dtypes of its outputs as a function of the inputs' (torch's fake tensors, JAX's abstract
evaluation), and the core call that computes it. Adapters register every entry the same way and
differentiate an op through the entry named by its ``vjp``, so a new op (decode, varlen,
paged) is one more entry here, not a new adapter. Gradients are returned for the leading
arrays only; the rest (integer offsets) get none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cuattn.attention import attention, check_bool, score_options, window_bounds
from cuattn.backward import attention_backward
from cuattn.merge import merge
from cuattn.packed import check_max_seqlen
from cuattn.varlen import attention_varlen, attention_varlen_backward

# Array arguments: "name" a tensor, "name?" an optional one, "name[]" a list of tensors.
# Output dtypes: the name of an input whose dtype it takes, or "float32".


@dataclasses.dataclass(frozen=True)
class OpEntry:
    name: str
    arrays: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (name, "bool" | "int" | "float" | "str")
    returns: tuple[str, ...]  # names of the outputs the op returns
    outputs: Callable[..., list[tuple[tuple, str]]]  # (**input shapes, **options) -> [(shape, dtype)] of ``returns``
    call: Callable  # (*arrays, **options) -> tuple of the returned outputs, through the core API
    vjp: str | None = None  # the entry that computes this op's input gradients
    vjp_arrays: Callable | None = None  # (inputs, outputs, output grads) -> vjp entry's arrays
    vjp_options: tuple[tuple[str, object], ...] = ()  # options of the vjp entry beyond this op's

    @property
    def array_names(self) -> tuple[str, ...]:
        return tuple(a.rstrip("?[]") for a in self.arrays)


MASK_OPTIONS = (("causal", "bool"), ("window_left", "int"), ("window_right", "int"), ("align", "str"), ("scale", "float"), ("softcap", "float"))


def core_mask_options(causal, window_left, window_right, align, scale, softcap) -> dict:
    """The flat, typed options of the op table as the core API's keywords."""
    return dict(
        causal=causal, window=(None if window_left == -1 else window_left, None if window_right == -1 else window_right),
        align=align, scale=scale, softcap=softcap or None,
    )


def flat_mask_options(causal=False, window=None, align="bottom_right", scale=None, softcap=None, head_dim=None) -> dict:
    """The core API's keywords as the op table's flat options (scale resolved, -1 / 0 for none),
    checked as the core API checks them."""
    # A bound past any sequence is unbounded; capped so that it fits the ops' int64 schema.
    left, right = (min(w, 2**62) for w in window_bounds(window))
    if not isinstance(align, str):
        raise TypeError(f"align must be a str, got {type(align).__name__} {align!r}")
    scale, softcap = score_options(scale, softcap, head_dim)
    return dict(
        causal=check_bool("causal", causal), window_left=left, window_right=right, align=align,
        scale=scale, softcap=softcap,
    )


# Bounds on packed sequence lengths (attention_varlen); -1 derives them as the core API does.
VARLEN_OPTIONS = MASK_OPTIONS + (("max_seqlen_q", "int"), ("max_seqlen_k", "int"))


def flat_seqlen_bounds(max_seqlen_q=None, max_seqlen_k=None) -> dict:
    """The core API's ``max_seqlen_*`` as the op table's options (-1 for None), checked."""
    bounds = dict(max_seqlen_q=check_max_seqlen("max_seqlen_q", max_seqlen_q), max_seqlen_k=check_max_seqlen("max_seqlen_k", max_seqlen_k))
    return {name: -1 if value is None else value for name, value in bounds.items()}


def core_seqlen_bounds(max_seqlen_q: int, max_seqlen_k: int) -> dict:
    return dict(max_seqlen_q=None if max_seqlen_q < 0 else max_seqlen_q, max_seqlen_k=None if max_seqlen_k < 0 else max_seqlen_k)


def _attention_outputs(q, k, v, **_):
    batch, seqlen_q, heads_q, _head_dim = q
    return [(q, "q"), ((batch, heads_q, seqlen_q), "float32")]


def _backward_outputs(dout, q, k, v, out, lse, dlse, **_):
    return [(q, "q"), (k, "k"), (v, "v")]


def _varlen_outputs(q, k, v, cu_seqlens_q, cu_seqlens_k, **_):
    total_q, heads_q, _head_dim = q
    return [(q, "q"), ((heads_q, total_q), "float32")]


def _varlen_backward_outputs(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse, **_):
    return [(q, "q"), (k, "k"), (v, "v")]


def _merge_outputs(outs, lses, **_):
    return [(outs[0], "outs"), (lses[0], "float32")]


OPS = {
    "attention": OpEntry(
        name="attention",
        arrays=("q", "k", "v"),
        options=MASK_OPTIONS,
        returns=("out", "lse"),
        outputs=_attention_outputs,
        call=lambda q, k, v, **o: attention(q, k, v, return_lse=True, **core_mask_options(**o)),
        vjp="attention_backward",
        vjp_arrays=lambda inputs, outputs, grads: (grads[0], *inputs, *outputs, grads[1]),  # dout, q, k, v, out, lse, dlse
        vjp_options=(("deterministic", False),),
    ),
    "attention_backward": OpEntry(
        name="attention_backward",
        arrays=("dout", "q", "k", "v", "out", "lse", "dlse?"),
        options=MASK_OPTIONS + (("deterministic", "bool"),),
        returns=("dq", "dk", "dv"),
        outputs=_backward_outputs,
        call=lambda dout, q, k, v, out, lse, dlse, deterministic, **o: attention_backward(
            dout, q, k, v, out, lse, dlse=dlse, deterministic=deterministic, **core_mask_options(**o)
        ),
    ),
    "attention_varlen": OpEntry(
        name="attention_varlen",
        arrays=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
        options=VARLEN_OPTIONS,
        returns=("out", "lse"),
        outputs=_varlen_outputs,
        call=lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **o: attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, return_lse=True, **core_seqlen_bounds(max_seqlen_q, max_seqlen_k), **core_mask_options(**o)
        ),
        vjp="attention_varlen_backward",
        # dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse
        vjp_arrays=lambda inputs, outputs, grads: (grads[0], *inputs[:3], *outputs, *inputs[3:], grads[1]),
        vjp_options=(("deterministic", False),),
    ),
    "attention_varlen_backward": OpEntry(
        name="attention_varlen_backward",
        arrays=("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "dlse?"),
        options=VARLEN_OPTIONS + (("deterministic", "bool"),),
        returns=("dq", "dk", "dv"),
        outputs=_varlen_backward_outputs,
        call=lambda dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse, max_seqlen_q, max_seqlen_k, deterministic, **o: (
            attention_varlen_backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse=dlse, deterministic=deterministic,
                **core_seqlen_bounds(max_seqlen_q, max_seqlen_k), **core_mask_options(**o),
            )
        ),
    ),
    "merge": OpEntry(
        name="merge",
        arrays=("outs[]", "lses[]"),
        options=(),
        returns=("out", "lse"),
        outputs=_merge_outputs,
        call=lambda outs, lses: merge(list(outs), list(lses)),
    ),
}

