# A/B of the decode kernel against an old tree (_ab/old: git archive <commit> cuattn cuda_src | tar -x -C _ab/old), GB/s by
# scripts/tune_decode.py (dependent launches: $PDL, default "0,1"; extra arguments: $TUNE_ARGS), trees alternated twice;
# the decode family's GPU tests first ($TESTS, default tests/test_decode.py).
# Run on the device: bash scripts/decode_ab.sh (writes $OUT/tune_{old,new}{1,2}.txt).
export CUPY_CACHE_DIR=/tmp/cc
cp -r scripts benchmarks _ab/old/
ROWS=${ROWS:-1x32768,4x8192,1x8192,1x1024,4x1024,16x8192,64x1024,1x131072}
PDL=${PDL:-0,1}
(PYTHONPATH=. timeout 300 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_decode.py} 2>&1 | tail -3) > $OUT/decode_tests.txt &
TP=$!
(cd _ab/old && timeout 200 python3 scripts/tune_decode.py --rows 1x1024 > /dev/null 2>&1)  # compile the old tree's kernels meanwhile
wait $TP
for r in 1 2; do
  (cd _ab/old && timeout 200 python3 scripts/tune_decode.py --rows $ROWS --pdl $PDL $TUNE_ARGS 2>&1 | grep -v -i warn) > $OUT/tune_old$r.txt
  timeout 200 python3 scripts/tune_decode.py --rows $ROWS --pdl $PDL $TUNE_ARGS 2>&1 | grep -v -i warn > $OUT/tune_new$r.txt
done
nvidia-smi -L > $OUT/gpus.txt
cat $OUT/decode_tests.txt; for f in $OUT/tune_*.txt; do echo "== $f"; cat $f; done
