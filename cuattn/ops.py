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

from cuattn.attention import attention
from cuattn.backward import attention_backward
from cuattn.block_mask import ARRAY_FIELDS as BLOCK_MASK_ARRAYS, BlockMask
from cuattn.decode import append_kv, attention_with_kvcache
from cuattn.merge import merge
from cuattn.options import OP_SCHEMA, SEQLEN_SCHEMA, WINDOW_SCHEMA, AttnOptions, user_seqlen_bounds
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
    mutates: tuple[str, ...] = ()  # arrays the op writes in place (declared in the torch schema)
    mutates_if: str | None = None  # the optional array whose presence makes it write them (None: always)

    @property
    def array_names(self) -> tuple[str, ...]:
        return tuple(a.rstrip("?[]") for a in self.arrays)

    def written(self, arrays) -> tuple[str, ...]:
        """The arrays this call writes in place (``arrays`` in :attr:`arrays` order)."""
        if self.mutates_if is not None and dict(zip(self.array_names, arrays))[self.mutates_if] is None:
            return ()
        return self.mutates


MASK_OPTIONS = OP_SCHEMA  # cuattn.options.AttnOptions' fields
DROPOUT_OPTIONS = MASK_OPTIONS + (("dropout_p", "float"),)
VARLEN_OPTIONS = WINDOW_SCHEMA + SEQLEN_SCHEMA


def _attention_outputs(q, k, v, **_):
    batch, seqlen_q, heads_q, _head_dim = q
    return [(q, "q"), ((batch, heads_q, seqlen_q), "float32")]


def _backward_outputs(dout, q, k, v, out, lse, dlse, **_):
    return [(q, "q"), (k, "k"), (v, "v")]


def _block_mask(*arrays) -> BlockMask:
    """A BlockMask of the call's lengths from its four arrays."""
    return BlockMask(*arrays, seqlen_q=None, seqlen_k=None)


def _sink_backward_outputs(dout, q, k, v, out, lse, dlse, sink, **_):
    return [(q, "q"), (k, "k"), (v, "v"), (sink, "float32")]


def _varlen_outputs(q, k, v, cu_seqlens_q, cu_seqlens_k, **_):
    total_q, heads_q, _head_dim = q
    return [(q, "q"), ((heads_q, total_q), "float32")]


def _varlen_backward_outputs(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse, **_):
    return [(q, "q"), (k, "k"), (v, "v")]


# attention_with_kvcache: the mask options without align (new tokens are bottom-right aligned),
# and the number of key splits (-1: chosen from the shapes).
DECODE_OPTIONS = tuple((name, kind) for name, kind in WINDOW_SCHEMA if name != "align") + (("num_splits", "int"),)


def _decode_keywords(num_splits: int, **flat) -> dict:
    keywords = AttnOptions(align="bottom_right", **flat).user_keywords()
    del keywords["align"]
    return {**keywords, "num_splits": None if num_splits < 0 else num_splits}


def _decode_outputs(q, *_, **__):
    batch, seqlen_q, heads_q, _head_dim = q
    return [(q, "q"), ((batch, heads_q, seqlen_q), "float32")]


def _merge_outputs(outs, lses, **_):
    return [(outs[0], "outs"), (lses[0], "float32")]


OPS = {
    "attention": OpEntry(
        name="attention",
        arrays=("q", "k", "v"),
        options=MASK_OPTIONS,
        returns=("out", "lse"),
        outputs=_attention_outputs,
        call=lambda q, k, v, **o: attention(q, k, v, return_lse=True, **AttnOptions(**o).user_keywords()),
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
            dout, q, k, v, out, lse, dlse=dlse, deterministic=deterministic, **AttnOptions(**o).user_keywords()
        ),
    ),
    # With dropout on the probabilities: the seed is an array (drawn on the device by the
    # adapters, so that traced and captured calls draw a new mask each time).
    "attention_dropout": OpEntry(
        name="attention_dropout",
        arrays=("q", "k", "v", "dropout_seed"),
        options=DROPOUT_OPTIONS,
        returns=("out", "lse"),
        outputs=_attention_outputs,
        call=lambda q, k, v, dropout_seed, dropout_p, **o: attention(
            q, k, v, dropout_p=dropout_p, dropout_seed=dropout_seed, return_lse=True, **AttnOptions(**o).user_keywords(),
        ),
        vjp="attention_dropout_backward",
        # dout, q, k, v, out, lse, dlse, dropout_seed
        vjp_arrays=lambda inputs, outputs, grads: (grads[0], *inputs[:3], *outputs, grads[1], inputs[3]),
        vjp_options=(("deterministic", False),),
    ),
    "attention_dropout_backward": OpEntry(
        name="attention_dropout_backward",
        arrays=("dout", "q", "k", "v", "out", "lse", "dlse?", "dropout_seed"),
        options=DROPOUT_OPTIONS + (("deterministic", "bool"),),
        returns=("dq", "dk", "dv"),
        outputs=_backward_outputs,
        call=lambda dout, q, k, v, out, lse, dlse, dropout_seed, deterministic, dropout_p, **o: attention_backward(
            dout, q, k, v, out, lse, dlse=dlse, dropout_p=dropout_p, dropout_seed=dropout_seed, deterministic=deterministic,
            **AttnOptions(**o).user_keywords(),
        ),
    ),
    # Block-sparse: the four arrays of a cuattn.block_mask.BlockMask after q, k and v.
    "attention_block_sparse": OpEntry(
        name="attention_block_sparse",
        arrays=("q", "k", "v", *BLOCK_MASK_ARRAYS),
        options=MASK_OPTIONS,
        returns=("out", "lse"),
        outputs=_attention_outputs,
        call=lambda q, k, v, *mask, **o: attention(q, k, v, block_mask=_block_mask(*mask), return_lse=True, **AttnOptions(**o).user_keywords()),
        vjp="attention_block_sparse_backward",
        # dout, q, k, v, out, lse, dlse, the mask's arrays
        vjp_arrays=lambda inputs, outputs, grads: (grads[0], *inputs[:3], *outputs, grads[1], *inputs[3:]),
        vjp_options=(("deterministic", False),),
    ),
    "attention_block_sparse_backward": OpEntry(
        name="attention_block_sparse_backward",
        arrays=("dout", "q", "k", "v", "out", "lse", "dlse?", *BLOCK_MASK_ARRAYS),
        options=MASK_OPTIONS + (("deterministic", "bool"),),
        returns=("dq", "dk", "dv"),
        outputs=_backward_outputs,
        call=lambda dout, q, k, v, out, lse, dlse, *mask, deterministic, **o: attention_backward(
            dout, q, k, v, out, lse, dlse=dlse, block_mask=_block_mask(*mask), deterministic=deterministic, **AttnOptions(**o).user_keywords(),
        ),
    ),
    # With attention sinks (a learnable per-head logit), differentiable in it too.
    "attention_sink": OpEntry(
        name="attention_sink",
        arrays=("q", "k", "v", "sink"),
        options=MASK_OPTIONS,
        returns=("out", "lse"),
        outputs=_attention_outputs,
        call=lambda q, k, v, sink, **o: attention(q, k, v, sink=sink, return_lse=True, **AttnOptions(**o).user_keywords()),
        vjp="attention_sink_backward",
        # dout, q, k, v, out, lse, dlse, sink
        vjp_arrays=lambda inputs, outputs, grads: (grads[0], *inputs[:3], *outputs, grads[1], inputs[3]),
        vjp_options=(("deterministic", False),),
    ),
    "attention_sink_backward": OpEntry(
        name="attention_sink_backward",
        arrays=("dout", "q", "k", "v", "out", "lse", "dlse?", "sink"),
        options=MASK_OPTIONS + (("deterministic", "bool"),),
        returns=("dq", "dk", "dv", "dsink"),
        outputs=_sink_backward_outputs,
        call=lambda dout, q, k, v, out, lse, dlse, sink, deterministic, **o: attention_backward(
            dout, q, k, v, out, lse, dlse=dlse, sink=sink, deterministic=deterministic, **AttnOptions(**o).user_keywords()
        ),
    ),
    "attention_varlen": OpEntry(
        name="attention_varlen",
        arrays=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
        options=VARLEN_OPTIONS,
        returns=("out", "lse"),
        outputs=_varlen_outputs,
        call=lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **o: attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, return_lse=True, **user_seqlen_bounds(max_seqlen_q, max_seqlen_k), **AttnOptions(**o).user_keywords()
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
                **user_seqlen_bounds(max_seqlen_q, max_seqlen_k), **AttnOptions(**o).user_keywords(),
            )
        ),
    ),
    "attention_varlen_dropout": OpEntry(
        name="attention_varlen_dropout",
        arrays=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "dropout_seed"),
        options=VARLEN_OPTIONS + (("dropout_p", "float"),),
        returns=("out", "lse"),
        outputs=_varlen_outputs,
        call=lambda q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_seed, max_seqlen_q, max_seqlen_k, dropout_p, **o: attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p=dropout_p, dropout_seed=dropout_seed, return_lse=True,
            **user_seqlen_bounds(max_seqlen_q, max_seqlen_k), **AttnOptions(**o).user_keywords(),
        ),
        vjp="attention_varlen_dropout_backward",
        # dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse, dropout_seed
        vjp_arrays=lambda inputs, outputs, grads: (grads[0], *inputs[:3], *outputs, *inputs[3:5], grads[1], inputs[5]),
        vjp_options=(("deterministic", False),),
    ),
    "attention_varlen_dropout_backward": OpEntry(
        name="attention_varlen_dropout_backward",
        arrays=("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "dlse?", "dropout_seed"),
        options=VARLEN_OPTIONS + (("dropout_p", "float"), ("deterministic", "bool")),
        returns=("dq", "dk", "dv"),
        outputs=_varlen_backward_outputs,
        call=lambda dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse, dropout_seed, max_seqlen_q, max_seqlen_k, dropout_p,
        deterministic, **o: attention_varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse=dlse, dropout_p=dropout_p, dropout_seed=dropout_seed,
            deterministic=deterministic, **user_seqlen_bounds(max_seqlen_q, max_seqlen_k), **AttnOptions(**o).user_keywords(),
        ),
    ),
    "attention_with_kvcache": OpEntry(
        name="attention_with_kvcache",
        arrays=("q", "k_cache", "v_cache", "cache_seqlens", "k_new?", "v_new?", "block_table?", "cache_batch_idx?", "sink?"),
        options=DECODE_OPTIONS,
        returns=("out", "lse"),
        outputs=_decode_outputs,
        call=lambda q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_batch_idx, sink, **o: attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table,
            cache_batch_idx=cache_batch_idx, sink=sink, return_lse=True, **_decode_keywords(**o),
        ),
        mutates=("k_cache", "v_cache"),
        mutates_if="k_new",
    ),
    # The same attention when nothing is appended, declaring no write: a traced decode step
    # that only reads the cache (torch.compile) has no mutation to functionalize.
    "attention_with_kvcache_readonly": OpEntry(
        name="attention_with_kvcache_readonly",
        arrays=("q", "k_cache", "v_cache", "cache_seqlens", "block_table?", "cache_batch_idx?", "sink?"),
        options=DECODE_OPTIONS,
        returns=("out", "lse"),
        outputs=_decode_outputs,
        call=lambda q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, sink, **o: attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx, sink=sink,
            return_lse=True, **_decode_keywords(**o),
        ),
    ),
    "append_kv": OpEntry(
        name="append_kv",
        arrays=("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "block_table?", "cache_batch_idx?"),
        options=(),
        returns=(),
        outputs=lambda **_: [],
        call=lambda k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx: append_kv(
            k_new, v_new, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
        ) or (),
        mutates=("k_cache", "v_cache"),
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

