"""Host mirrors of the kernel parameter structs in ``cuda_src/common/params.cuh``.

Each struct is a NumPy structured dtype with C alignment; a kernel receives one
``numpy.void`` scalar of it by value. CI checks every field offset against the C struct.
"""

import numpy as np

MAX_MERGE_PARTIALS = 16

_P = np.uint64  # device pointer
_S3 = (np.int64, (3,))

MERGE_PARAMS = np.dtype(
    [
        ("outs", _P, (MAX_MERGE_PARTIALS,)),
        ("lses", _P, (MAX_MERGE_PARTIALS,)),
        ("out_strides", np.int64, (MAX_MERGE_PARTIALS, 3)),
        ("lse_strides", np.int64, (MAX_MERGE_PARTIALS, 3)),
        ("dst_out", _P),
        ("dst_lse", _P),
        ("dst_out_strides", *_S3),
        ("dst_lse_strides", *_S3),
        ("num_partials", np.int32),
        ("batch", np.int32),
        ("seqlen", np.int32),
        ("heads", np.int32),
        ("head_dim", np.int32),
    ],
    align=True,
)

SUM_PARAMS = np.dtype(
    [
        ("piece", _P),
        ("sum", _P),
        ("out", _P),
        ("outer", np.int64),
        ("inner", np.int64),
        ("piece_stride", np.int64),
        ("sum_stride", np.int64),
        ("out_stride", np.int64),
        ("out_row_stride", np.int64),
        ("row_elems", np.int64),
        ("fresh", np.int32),
    ],
    align=True,
)

ATTN_PARAMS = np.dtype(
    [
        ("q", _P),
        ("k", _P),
        ("v", _P),
        ("out", _P),
        ("lse", _P),
        ("sink", _P),
        ("q_strides", *_S3),
        ("k_strides", *_S3),
        ("v_strides", *_S3),
        ("out_strides", *_S3),
        ("lse_strides", np.int64, (2,)),
        ("batch", np.int32),
        ("seqlen_q", np.int32),
        ("seqlen_k", np.int32),
        ("heads_q", np.int32),
        ("heads_kv", np.int32),
        ("head_dim", np.int32),
        ("window_left", np.int32),
        ("window_right", np.int32),
        ("diagonal_offset", np.int32),
        ("scale", np.float32),
        ("softcap", np.float32),
        ("exp2_scale", np.float32),
        ("batch_offset", np.int32),
        ("cu_seqlens_q", _P),
        ("cu_seqlens_k", _P),
        ("total_q", np.int32),
        ("total_k", np.int32),
        ("bottom_right", np.int32),
        ("cache_seqlens", _P),
        ("block_table", _P),
        ("cache_batch_idx", _P),
        ("block_table_stride", np.int64),
        ("capacity", np.int32),
        ("cache_rows", np.int32),
        ("page_size", np.int32),
        ("seqlen_new", np.int32),
        ("accum", _P),
        ("accum_strides", *_S3),
        ("accum_fresh", np.int32),
        ("dropout_seed_ptr", _P),
        ("dropout_seed", np.uint64),
        ("dropout_threshold", np.uint32),
        ("dropout_scale", np.float32),
        ("kv_block_counts", _P),
        ("kv_block_indices", _P),
        ("q_block_counts", _P),
        ("q_block_indices", _P),
        ("kv_block_strides", np.int64, (2,)),
        ("q_block_strides", np.int64, (2,)),
        ("block_schedule", _P),
        ("block_schedule_stride", np.int64),
    ],
    align=True,
)

BLOCK_SCHEDULE_PARAMS = np.dtype(
    [
        ("counts", _P),
        ("schedule", _P),
        ("count_strides", np.int64, (2,)),
        ("entries", np.int32),
        ("ys", np.int32),
        ("y_per_head", np.int32),
        ("group", np.int32),
        ("tiles", np.int32),
        ("tile_rows", np.int32),
        ("mask_rows", np.int32),
        ("reversed", np.int32),
    ],
    align=True,
)

BACKWARD_PARAMS = np.dtype(
    [
        ("attn", ATTN_PARAMS),
        ("dout", _P),
        ("dq", _P),
        ("dk", _P),
        ("dv", _P),
        ("delta", _P),
        ("dq_accum", _P),
        ("dlse", _P),
        ("dsink", _P),
        ("dout_strides", *_S3),
        ("dq_strides", *_S3),
        ("dk_strides", *_S3),
        ("dv_strides", *_S3),
        ("dlse_strides", np.int64, (2,)),
        ("delta_strides", np.int64, (2,)),
        ("dq_accum_tile_strides", np.int64, (2,)),
        ("dq_accum_cols", np.int32),
        ("sum_grads", np.int32),
        ("query_splits", np.int32),
        ("split_stride", np.int64),
    ],
    align=True,
)

DECODE_PARAMS = np.dtype(
    [
        ("q", _P),
        ("k", _P),
        ("v", _P),
        ("out", _P),
        ("lse", _P),
        ("sink", _P),
        ("partial_out", _P),
        ("partial_lse", _P),
        ("cache_seqlens", _P),
        ("block_table", _P),
        ("cache_batch_idx", _P),
        ("k_new", _P),
        ("v_new", _P),
        ("q_strides", *_S3),
        ("k_strides", *_S3),
        ("v_strides", *_S3),
        ("out_strides", *_S3),
        ("lse_strides", np.int64, (2,)),
        ("k_new_strides", *_S3),
        ("v_new_strides", *_S3),
        ("block_table_stride", np.int64),
        ("batch", np.int32),
        ("seqlen_q", np.int32),
        ("seqlen_new", np.int32),
        ("heads_q", np.int32),
        ("heads_kv", np.int32),
        ("head_dim", np.int32),
        ("capacity", np.int32),
        ("cache_rows", np.int32),
        ("page_size", np.int32),
        ("num_splits", np.int32),
        ("window_left", np.int32),
        ("window_right", np.int32),
        ("prefetch_blocks", np.int32),
        ("scale", np.float32),
        ("softcap", np.float32),
        ("exp2_scale", np.float32),
    ],
    align=True,
)

OFFSET_CHECK_PARAMS = np.dtype(
    [
        ("cu_seqlens", _P, (2,)),
        ("report", _P),
        ("batch", np.int32),
        ("totals", np.int32, (2,)),
        ("bounds", np.int32, (2,)),
    ],
    align=True,
)


def _with_tensor_maps(head: str, head_dtype: np.dtype, maps: tuple[str, ...]) -> np.dtype:
    """A struct of ``head`` then 64-byte-aligned 128-byte tensor maps (common/params.cuh TensorMap)."""
    names, formats, offsets = [head], [head_dtype], [0]
    offset = -(-head_dtype.itemsize // 64) * 64
    for name in maps:
        names.append(name)
        formats.append((np.uint8, (128,)))
        offsets.append(offset)
        offset += 128
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": offset})


TMA_ATTN_PARAMS = _with_tensor_maps("attn", ATTN_PARAMS, ("q_map", "k_map", "v_map"))
TMA_BACKWARD_PARAMS = _with_tensor_maps("bwd", BACKWARD_PARAMS, ("q_map", "k_map", "v_map", "dout_map"))


# C struct name for each host mirror, for the layout check.
C_STRUCTS = {
    "MergeParams": MERGE_PARAMS, "SumParams": SUM_PARAMS, "AttnParams": ATTN_PARAMS, "BackwardParams": BACKWARD_PARAMS,
    "OffsetCheckParams": OFFSET_CHECK_PARAMS, "TmaAttnParams": TMA_ATTN_PARAMS, "TmaBackwardParams": TMA_BACKWARD_PARAMS,
    "DecodeParams": DECODE_PARAMS, "BlockScheduleParams": BLOCK_SCHEDULE_PARAMS,
}


def pack(dtype: np.dtype, **values) -> np.void:
    """A parameter scalar with every field of ``dtype`` given by name (one conversion)."""
    missing = set(dtype.names) - values.keys()
    if missing or len(values) != len(dtype.names):
        raise KeyError(f"fields missing or unknown: {sorted(missing ^ (values.keys() - set(dtype.names)))}")
    return np.array(tuple(values[name] for name in dtype.names), dtype=dtype)[()]


def new(dtype: np.dtype) -> np.void:
    """A zeroed parameter scalar of the given struct dtype."""
    return np.zeros((), dtype=dtype)[()]


def field_offsets(dtype: np.dtype) -> dict[str, int]:
    return {name: dtype.fields[name][1] for name in dtype.names}
