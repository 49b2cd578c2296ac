# The GPU suite on one machine: every kernel variant compiled into the disk cache first (one
# process, all cores), then the tests in $SHARDS shards side by side (CUATTN_TEST_SHARD) with the
# background warm-up off, each stopping new tests after $DL seconds. Shards compiling from an
# empty cache each start a warm-up of their own and crowd the cores: on a 16-core H100 machine
# three such shards got through 515 of ~1650 tests in 420 s; warmed first (143 s), three shards
# ran them all in 324-409 s (2026-11-27).
#   bash scripts/gpu_suite.sh            (logs: $OUT/suite-<i>.txt, or ./suite-<i>.txt)
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cache/cupy}
export CUATTN_TEST_DEADLINE_S=${DL:-430} CUATTN_TEST_WARMUP=0 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
SHARDS=${SHARDS:-3}
LOGS=${OUT:-.}
start=$(date +%s)
python3 -m cuattn warmup --all --jobs "$(nproc)" > "$LOGS/warmup.txt" 2>&1 || { tail -20 "$LOGS/warmup.txt"; exit 1; }
echo "warm-up: $(tail -1 "$LOGS/warmup.txt") in $(( $(date +%s) - start )) s"
for i in $(seq 1 "$SHARDS"); do
  CUATTN_TEST_SHARD=$i/$SHARDS python3 -m pytest -q -p no:cacheprovider > "$LOGS/suite-$i.txt" 2>&1 &
done
wait
for i in $(seq 1 "$SHARDS"); do echo "shard $i: $(tail -1 "$LOGS/suite-$i.txt")"; done
