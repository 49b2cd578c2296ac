"""The chunked-prefill row of `python -m benchmarks decode` alone, twice: a 2k chunk on a 32k
cache (d128, GQA 32:8, bf16), contiguous and with pages of 16, against the dense forward.

    PYTHONPATH=. python scripts/chunked_prefill_probe.py <tag>
"""

import sys

from benchmarks.bench_decode import chunked_prefill

if __name__ == "__main__":
    for _ in range(2):
        print(sys.argv[1], chunked_prefill(), flush=True)
