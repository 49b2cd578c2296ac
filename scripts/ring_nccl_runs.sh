#!/bin/bash
# Ring attention's multi-GPU runs on one host of 4 GPUs, in two parts that each fit one device
# call: `tests` (the process-group tests, W = 2 and 4 over NCCL, then bench_ring at
# W = 4) and `examples` (bench_ring at W = 2, the torchrun training example on 4 ranks and the
# JAX example on every GPU). Logs and CSVs go to $OUT.
set -o pipefail
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cache/cupy} PYTHONPATH=.
OUT=${OUT:-results}
mkdir -p "$OUT"
failed=0
bench() {
  timeout "$2" torchrun --nproc_per_node "$1" benchmarks/bench_ring.py --repeat 3 --queued 3 --csv "$OUT/ring_nccl_w$1.csv" 2>&1 \
    | grep -v -i warn | tail -8 | tee "$OUT/ring_nccl_w$1.txt" || failed=1
}
case "$1" in
  tests)
    nvidia-smi -L | tee "$OUT/gpus.txt"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ring_process_group.py 2>&1 | tail -5 | tee "$OUT/ring-process-tests.txt" || failed=1
    bench 4 240 ;;
  examples)
    bench 2 200
    timeout 180 torchrun --nproc_per_node 4 examples/train_ring_torch.py --steps 30 2>&1 | grep -v -i warn | tail -5 | tee "$OUT/train_ring_4gpu.txt" || failed=1
    timeout 150 python3 examples/ring_attention_jax.py --seqlen 32768 2>&1 | grep -v -i warn | tail -6 | tee "$OUT/jax_ring_4gpu.txt" || failed=1 ;;
  *) echo "usage: $0 tests|examples" >&2; exit 2 ;;
esac
exit $failed
