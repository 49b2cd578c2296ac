"""The one place where attention options become kernel parameters.

The user's options (``causal``, ``window``, ``align``, ``scale``, ``softcap``) are checked once
into an :class:`AttnOptions`. Its fields are the op table's flat, typed options (the torch and
JAX schemas), and :meth:`AttnOptions.kernel_fields` gives the window bounds, diagonal offset
and score factors of the kernels' ``AttnParams``. The packed-sequence length bounds
(``max_seqlen_*``) are here too.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from cuattn.reference import diagonal_offset
from cuattn.validation import check_bool

LOG2E = 1.4426950408889634
ALIGNS = ("bottom_right", "top_left")
# A window bound past any sequence is unbounded; capped so that it fits the ops' int64 schema.
_MAX_WINDOW = 2**62
_FLOAT32_NORMAL = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


@dataclasses.dataclass(frozen=True)
class AttnOptions:
    """Checked attention options: window bounds -1 where unbounded, ``scale`` resolved,
    ``softcap`` 0 for none; scale and softcap exact float32 values."""

    causal: bool
    window_left: int
    window_right: int
    align: str
    scale: float
    softcap: float
    sink_tokens: int = 0  # keys 0 .. sink_tokens - 1 stay visible beside a window (StreamingLLM)

    @classmethod
    def from_user(
        cls, causal=False, window=None, align="bottom_right", scale=None, softcap=None, *, head_dim: int, sink_tokens=0,
    ) -> AttnOptions:
        """The public keywords, checked (TypeError / ValueError naming the option)."""
        causal = check_bool("causal", causal)
        sink_tokens = check_sink_tokens(sink_tokens)
        left, right = (min(w, _MAX_WINDOW) for w in window_bounds(window))
        if not isinstance(align, str):
            raise TypeError(f"align must be a str, got {type(align).__name__} {align!r}")
        if align not in ALIGNS:
            raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
        scale, softcap = score_factors(scale, softcap, head_dim)
        return cls(causal, left, right, align, scale, softcap, sink_tokens)

    def flat(self, schema: tuple | None = None) -> dict:
        """The op table's options (:data:`OP_SCHEMA`, or ``schema``: :data:`WINDOW_SCHEMA`)."""
        return {name: getattr(self, name) for name, _ in (OP_SCHEMA if schema is None else schema)}

    def user_keywords(self) -> dict:
        """The public keywords that give these options back."""
        unbounded = (lambda w: None if w == -1 else w)
        keywords = dict(
            causal=self.causal, window=(unbounded(self.window_left), unbounded(self.window_right)), align=self.align,
            scale=self.scale, softcap=self.softcap or None,
        )
        # Only the dense calls take sink_tokens; the others see it only when it was set.
        return {**keywords, "sink_tokens": self.sink_tokens} if self.sink_tokens else keywords

    @property
    def bottom_right(self) -> bool:
        return self.align == "bottom_right"

    def kernel_fields(self, seqlen_q: int, seqlen_k: int, packed: bool = False) -> dict:
        """The mask and score fields of AttnParams for sequences of ``seqlen_q`` query and
        ``seqlen_k`` key rows (packed: the totals, and the kernels place each sequence's diagonal
        from ``bottom_right``). Causal masking is the window's right bound at 0, and a bound
        that reaches past both sequences is unbounded (-1): the kernels add bounds to row and
        column indices in int32, so nothing larger than ``seqlen_q + seqlen_k`` reaches them,
        and a positive bound needs ``seqlen_q + seqlen_k < 2**30`` (a ValueError otherwise)."""
        left, right = self.window_left, self.window_right
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        reach = seqlen_q + seqlen_k
        left, right = (-1 if w > reach else w for w in (left, right))
        if max(left, right) > 0 and 2 * reach >= 2**31:
            raise ValueError(f"window bounds over {seqlen_q} query and {seqlen_k} key positions are not supported: the kernels add "
                             "them to positions in int32 (at most 2**30 positions together)")
        return dict(
            window_left=left, window_right=right, diagonal_offset=0 if packed else diagonal_offset(seqlen_q, seqlen_k, self.align),
            scale=self.scale, softcap=self.softcap, exp2_scale=LOG2E * (1.0 if self.softcap else self.scale),
        )

    def key_pieces(self, seqlen_q: int, seqlen_k: int) -> list[KeyPiece]:
        """The key ranges the kernels visit, each with its mask fields (:meth:`kernel_fields`
        moved to the range's first key). One range, except when sink tokens sit outside a
        window's left bound: then the sink tokens (masked on the right only) and the rest
        (masked by the window), disjoint, whose union is the mask; their partial results merge
        exactly by their lse."""
        fields = self.kernel_fields(seqlen_q, seqlen_k)
        sinks = min(self.sink_tokens, seqlen_k)
        if sinks == 0 or fields["window_left"] < 0:
            return [KeyPiece(0, seqlen_k, fields)]
        unbounded_left = {**fields, "window_left": -1}
        if sinks == seqlen_k:
            return [KeyPiece(0, seqlen_k, unbounded_left)]
        return [KeyPiece(0, sinks, unbounded_left), KeyPiece(sinks, seqlen_k, shifted(fields, sinks))]


@dataclasses.dataclass(frozen=True)
class KeyPiece:
    """Keys ``start .. stop - 1`` and the mask fields of a kernel that sees only them."""

    start: int
    stop: int
    fields: dict


def shifted(fields: dict, start: int) -> dict:
    """Mask fields for a kernel whose key 0 is key ``start`` of the sequence: the diagonal moves
    by ``-start``; window bounds are relative to it and stay."""
    return {**fields, "diagonal_offset": fields["diagonal_offset"] - start}


def check_sink_tokens(sink_tokens) -> int:
    if isinstance(sink_tokens, (bool, np.bool_)) or not isinstance(sink_tokens, (int, np.integer)):
        raise TypeError(f"sink_tokens must be an int, got {type(sink_tokens).__name__} {sink_tokens!r}")
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
    return min(int(sink_tokens), _MAX_WINDOW)  # past any sequence: every key (fits the ops' int64)


OP_SCHEMA = tuple((f.name, f.type) for f in dataclasses.fields(AttnOptions))  # (name, "bool" | "int" | "str" | "float")
WINDOW_SCHEMA = tuple(f for f in OP_SCHEMA if f[0] != "sink_tokens")  # the ops without sink tokens (varlen, decode)


def window_bounds(window) -> tuple[int, int]:
    """``window`` checked, as (left, right) with -1 for an unbounded side."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be (left, right), got {window!r}")
    left, right = (-1 if w is None else _window_bound(w, window) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window bounds must be >= 0, or -1 / None for unbounded; got {window!r}")
    return left, right


def _window_bound(w, window) -> int:
    if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
        raise TypeError(f"window bounds must be integers (or None), got {window!r}")
    return int(w)


def score_factors(scale, softcap, head_dim: int) -> tuple[float, float]:
    """(scale, softcap) as the kernels take them (float32; softcap 0 means none), checked in
    that precision: each, and the factors the kernels form from them, must be a normal
    positive float32 (the kernels flush denormals to zero). A softcap of None or 0 is none
    (FlashAttention's default is 0)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _real("scale", scale)
    _check_float32("scale", scale, scale)
    _check_float32("scale", scale * LOG2E, scale)
    softcap = None if softcap is None else _real("softcap", softcap)
    if softcap is None or softcap == 0:
        return float(np.float32(scale)), 0.0
    _check_float32("softcap", softcap, softcap)
    _check_float32("scale / softcap", scale / softcap, (scale, softcap))
    return float(np.float32(scale)), float(np.float32(softcap))


def _real(name: str, x) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    return float(x)


def _check_float32(name: str, value: float, given) -> None:
    if not (_FLOAT32_NORMAL[0] <= value <= _FLOAT32_NORMAL[1]):
        raise ValueError(
            f"{name} must be positive, finite and a normal float32 (the kernels compute in float32), got {given!r}"
        )


# Packed rows: a grid of row blocks (at most 256 rows each) sized from a bound on the lengths
# counts its rows in int32 (grid_covers in common/seq_layout.cuh), so bounds and totals stay a
# block below 2**31.
MAX_PACKED_ROWS = 2**31 - 256


def check_max_seqlen(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (or None), got {type(value).__name__} {value!r}")
    if not 0 <= value <= MAX_PACKED_ROWS:
        raise ValueError(f"{name} must be in [0, 2**31 - 256], got {value}")
    return int(value)


# Bounds on packed sequence lengths (attention_varlen) in the op table; -1 derives them as the
# core API does.
SEQLEN_SCHEMA = (("max_seqlen_q", "int"), ("max_seqlen_k", "int"))


def flat_seqlen_bounds(max_seqlen_q=None, max_seqlen_k=None) -> dict:
    """The public ``max_seqlen_*`` as the op table's options (-1 for None), checked."""
    bounds = dict(max_seqlen_q=check_max_seqlen("max_seqlen_q", max_seqlen_q), max_seqlen_k=check_max_seqlen("max_seqlen_k", max_seqlen_k))
    return {name: -1 if value is None else value for name, value in bounds.items()}


def user_seqlen_bounds(max_seqlen_q: int, max_seqlen_k: int) -> dict:
    return dict(max_seqlen_q=None if max_seqlen_q < 0 else max_seqlen_q, max_seqlen_k=None if max_seqlen_k < 0 else max_seqlen_k)
