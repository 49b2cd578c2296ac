"""Benchmark cases: one attention problem in one mode, with its FLOP and byte counts."""

from __future__ import annotations

import dataclasses

MODES = ("fwd", "bwd", "fwdbwd", "decode")
# Head-dim buckets between the Hopper tiles (64, 128, 256), forward and backward rows.
MIDDLE_HEAD_DIMS = (96, 160, 192, 224)
_MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5, "decode": 1.0}


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"

    @property
    def flops(self) -> float:
        """FlashAttention's convention: 4 * batch * heads * seqlen_q * seqlen_k * head_dim,
        halved when causal, x2.5 for the backward, x3.5 for forward + backward."""
        dense = 4 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        return dense / (2 if self.causal else 1) * _MODE_FLOPS[self.mode]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V, what a decode step must read."""
        return 2 * self.batch * self.seqlen_k * self.heads_kv * self.head_dim * 2

    @property
    def input_bytes(self) -> int:
        q_like = self.batch * self.seqlen_q * self.heads_q * self.head_dim * 2
        return self.kv_bytes + (2 if self.mode != "fwd" else 1) * q_like

    def rate(self, ms: float) -> float:
        """TFLOP/s, or GB/s of K/V read for decode."""
        return self.kv_bytes / ms / 1e6 if self.mode == "decode" else self.flops / ms / 1e9

    @property
    def unit(self) -> str:
        return "GB/s" if self.mode == "decode" else "TFLOP/s"


def default_grid(quick: bool = False) -> list[Case]:
    """Training modes: head_dim 64 / 128 / 256, seqlen 512, 1k, 4k, 16k, 32k at 16k tokens per batch
    (heads = 2048 / head_dim), causal or not, bf16; GQA (16 query heads on 2) and fp16 rows;
    forward and backward at the middle head dims 96 / 160 / 192 / 224 (seqlen 1k and 16k);
    decode: one query per sequence against a KV cache of 512 .. 32k (batch 16, 32 heads on 8).
    ``quick``: head_dim 128, seqlen 4k."""
    head_dims = (128,) if quick else (64, 128, 256)
    seqlens = (4096,) if quick else (512, 1024, 4096, 16384, 32768)
    cases = []
    for mode in ("fwd", "bwd", "fwdbwd"):
        for d in head_dims:
            for s in seqlens:
                for causal in (False, True):
                    cases.append(Case(mode, max(1, 16384 // s), s, s, 2048 // d, 2048 // d, d, causal))
    if not quick:
        for mode in ("fwd", "bwd"):
            for s in (1024, 4096, 16384):
                cases.append(Case(mode, 16384 // s, s, s, 16, 2, 128, True))
                cases.append(Case(mode, 16384 // s, s, s, 16, 16, 128, False, "float16"))
            for d in MIDDLE_HEAD_DIMS:
                for s in (1024, 16384):
                    for causal in (False, True):
                        cases.append(Case(mode, 16384 // s, s, s, 2048 // d, 2048 // d, d, causal))
    for s in ((4096,) if quick else seqlens):
        cases.append(Case("decode", 16, 1, s, 32, 8, 128, False))
    return cases


def label(case: Case) -> str:
    gqa = f" gqa{case.heads_q}/{case.heads_kv}" if case.heads_q != case.heads_kv else ""
    causal = " causal" if case.causal else ""
    return f"{case.mode} d{case.head_dim} s{case.seqlen_k} b{case.batch}{gqa}{causal} {case.dtype}"


def case_of(row: dict) -> Case:
    """The case a result row (CSV / JSON) was measured on."""
    return Case(**{f: row[f] for f in Case.__dataclass_fields__})
