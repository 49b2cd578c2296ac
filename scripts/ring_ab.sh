#!/bin/bash
# A/B of the ring over NCCL: library tree (old = _ab/old, new = .) x NCCL stream priority (default/high),
# alternated twice. WORLD (2), TOKENS (8192,16384), CONFIGS override. One CSV and one log in $OUT.
# "old" needs the old tree's package there: git archive <commit> cuattn cuda_src | tar -x -C _ab/old
set -o pipefail
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
OUT=${OUT:-results}
CONFIGS=${CONFIGS:-old:default new:default new:high old:high}
case " $CONFIGS" in *" old:"*) [ -d _ab/old/cuattn ] || { echo "_ab/old/cuattn is missing (see the header)" >&2; exit 2; } ;; esac
mkdir -p "$OUT"
nvidia-smi -L > $OUT/gpus.txt
run() {  # tree priority round
  local path=.; [ "$1" = old ] && path=_ab/old:.
  echo "== $1 $2 $3" >> $OUT/ring_ab.log
  PYTHONPATH=$path timeout ${RUN_TIMEOUT:-150} torchrun --nproc_per_node ${WORLD:-2} benchmarks/bench_ring.py --layouts zigzag \
    --tokens-per-rank ${TOKENS:-8192,16384} --repeat ${REPEAT:-5} --queued ${QUEUED:-4} --nccl-stream $2 --csv $TMP/ring_ab_$1_$2_$3.csv 2>&1 \
    | grep -v -i warn >> $OUT/ring_ab.log || { echo "FAILED $1 $2 $3" | tee -a $OUT/ring_ab.log; failed=1; }
}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failed=0
for round in 1 2; do
  for cfg in $CONFIGS; do run ${cfg%:*} ${cfg#*:} $round; done
done
TMP=$TMP python3 - <<'PY'
import csv, glob, os
out = os.environ.get("OUT", "results")
rows = []
for f in sorted(glob.glob(f"{os.environ['TMP']}/ring_ab_*.csv")):
    for r in csv.DictReader(open(f)):
        rows.append({"run": os.path.basename(f)[8:-4], **r})
        print(rows[-1]["run"].ljust(16), r["tokens_per_rank"], "eff", r["efficiency"], "queued", r["efficiency_queued"], "ring", r["ring_ms"], r["ring_queued_ms"], "single", r["single_gpu_ms"], r["single_gpu_queued_ms"])
if rows:
    with open(f"{out}/ring_ab.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
PY
exit $failed
