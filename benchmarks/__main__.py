"""``python -m benchmarks [suite]``: the benchmark suite (benchmarks/run.py); ``paper``: the
Rabe & Staats memory tables; ``accuracy``: the accuracy table; ``overhead``: per-call host time of every adapter next to its
framework's attention (benchmarks/bench_overhead.py); ``varlen``: packed variable-length
batches next to dense, padded and PyTorch's nested tensors (benchmarks/bench_varlen.py); ``decode``: KV-cache decoding
next to SDPA (benchmarks/bench_decode.py); ``block_sparse``: block-sparse time against density
(benchmarks/bench_block_sparse.py); ``readme``: README.md's
performance summary and language-model paragraph, and docs/performance.md, from the result
files (benchmarks/readme.py)."""

import importlib
import sys

COMMANDS = {
    "suite": "run", "paper": "paper", "accuracy": "accuracy", "overhead": "bench_overhead", "varlen": "bench_varlen", "decode": "bench_decode",
    "block_sparse": "bench_block_sparse", "readme": "readme",
}
argv = sys.argv[1:]
if argv[:1] in (["-h"], ["--help"]):
    print(f"python -m benchmarks [{' | '.join(COMMANDS)}] [options]   (each command's --help lists its options)\n\n{__doc__}\n")
command = argv.pop(0) if argv and argv[0] in COMMANDS else "suite"
importlib.import_module(f"benchmarks.{COMMANDS[command]}").main(argv)
