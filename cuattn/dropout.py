"""Dropout on the attention probabilities: the user's ``dropout_p`` and ``dropout_seed`` checked
into the kernels' AttnParams fields.

The mask is never stored: every kernel that needs it draws it again from the seed and each
element's coordinates (``cuda_src/common/dropout.cuh``; host twin
:func:`cuattn.reference.dropout_keep`). ``dropout_p`` is applied as an 8-bit threshold, as
FlashAttention's (:func:`cuattn.reference.dropout_threshold`, ``min(round(256 p), 255)``): the
kept fraction is ``1 - threshold / 256`` and kept probabilities are divided by exactly that.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from cuattn import validation
from cuattn.reference import dropout_threshold

SEED_LAYOUT = "(2,) uint32 (the seed's low and high words) or (1,) int64 / uint64"
NO_DROPOUT_FIELDS = {"dropout_seed_ptr": 0, "dropout_seed": 0, "dropout_threshold": 0, "dropout_scale": 1.0}


@dataclasses.dataclass(frozen=True)
class Dropout:
    """A checked dropout: the 8-bit threshold and the seed, a host int or (``seed_array``) two
    uint32 words on the device that the kernels read."""

    threshold: int
    seed: int = 0
    seed_array: object = None  # boundary.DeviceArray

    @property
    def scale(self) -> float:
        return 256.0 / (256 - self.threshold)

    def fields(self) -> dict:
        """The AttnParams fields (cuda_src/common/params.cuh)."""
        return {
            "dropout_seed_ptr": 0 if self.seed_array is None else self.seed_array.ptr,
            "dropout_seed": self.seed, "dropout_threshold": self.threshold, "dropout_scale": self.scale,
        }


def check_dropout_p(dropout_p) -> float:
    """``dropout_p`` as a float in [0, 1) (TypeError / ValueError naming it)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    p = float(dropout_p)
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def seed_is_int(dropout_seed) -> bool:
    return isinstance(dropout_seed, numbers.Integral) and not isinstance(dropout_seed, bool)


def seed_array_argument(dropout_seed):
    """``dropout_seed`` when it is an array (imported with the op's arrays), else None; a
    TypeError for what is neither an int nor an array (a bool, a float, a string)."""
    if dropout_seed is None or seed_is_int(dropout_seed):
        return None
    if not (hasattr(dropout_seed, "shape") or hasattr(dropout_seed, "__dlpack__")):
        raise TypeError(f"dropout_seed must be an int in [0, 2**64) or an 8-byte array, got {type(dropout_seed).__name__} "
                        f"{dropout_seed!r}")
    return dropout_seed


def replayable(dropout_p, dropout_seed, seed_array) -> bool:
    """Whether a call may take a replayed plan: not with an int seed, which the plan would
    bake in (a plan per seed would never be replayed) and which the full path checks even
    where ``dropout_p`` is 0. A ``dropout_p`` that is no plain number takes the full path too,
    whose checks name it."""
    if seed_array is not None:
        return True
    kind = type(dropout_p)
    return dropout_seed is None and (kind is float or kind is int) and not dropout_p


def check_seed_int(seed) -> int:
    """An int seed in [0, 2**64) (TypeError / ValueError naming dropout_seed)."""
    if isinstance(seed, bool) or not seed_is_int(seed):
        raise TypeError(f"dropout_seed must be an int or a {SEED_LAYOUT} array, got {type(seed).__name__}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"dropout_seed must be in [0, 2**64), got {seed}")
    return int(seed)


def from_user(dropout_p, dropout_seed, seed_array=None, sink_tokens=0) -> Dropout | None:
    """The checked dropout, or None where nothing is dropped (``dropout_p`` 0, or at most
    1 / 512, which the 8-bit threshold rounds to 0). ``seed_array``: ``dropout_seed`` imported as a
    DeviceArray when it is an array; ``sink_tokens``: the call's (dropout is refused with them)."""
    p = check_dropout_p(dropout_p)
    if seed_array is not None:
        check_seed_array(seed_array)
    elif dropout_seed is not None:
        check_seed_int(dropout_seed)
    if p == 0.0:
        return None
    if dropout_seed is None:
        raise ValueError(f"dropout_p > 0 needs dropout_seed (an int, or a {SEED_LAYOUT} array on the device); pass the same one to the backward")
    threshold = dropout_threshold(p)
    if threshold == 0:
        return None
    if sink_tokens:
        raise ValueError("dropout is not supported with sink_tokens")
    return Dropout(threshold, int(dropout_seed)) if seed_is_int(dropout_seed) else Dropout(threshold, 0, seed_array)


def check_seed_array(seed) -> None:
    """A seed array: 8 bytes that the kernels read as one little-endian 64-bit word."""
    validation.check_rank("dropout_seed", seed, 1, SEED_LAYOUT)
    dtype = np.dtype(seed.dtype)
    if dtype not in (np.uint32, np.int64, np.uint64):
        raise TypeError(f"dropout_seed must be {SEED_LAYOUT}, got {validation.dtype_name(seed.dtype)}")
    validation.check_shape("dropout_seed", seed, (8 // dtype.itemsize,), SEED_LAYOUT)
    validation.check_unit_last_stride("dropout_seed", seed)
    if seed.ptr is not None and seed.ptr % 8:
        raise ValueError("dropout_seed's address must be a multiple of 8 bytes (the kernels read it as one 64-bit word)")

