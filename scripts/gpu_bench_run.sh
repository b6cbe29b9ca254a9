# one scripts.bench_save run on the GPU machine (after the TE build, or without TE for gpu_bench_loop.sh p;
# PYTHONPATH set): bash scripts/gpu_bench_run.sh TAG LAYERS MODES
# writes $OUT/TAG.md, .jsonl, the log's tail and each finished mode's summary line (TAG.modes: kept when a later mode
# ends the run); BENCH_TIMEOUT (s, default 340) bounds the run, BENCH_REPEATS (default 3) its measured saves a mode;
# the scratch folder is emptied
tag=$1; layers=$2; modes=$3; S=/tmp/scratch
rm -rf $S /tmp/o/$tag
timeout ${BENCH_TIMEOUT:-340} torchrun --standalone --nproc_per_node=1 -m scripts.bench_save --out /tmp/o/$tag --scratch $S \
  --layers $layers --repeats ${BENCH_REPEATS:-3} --modes $modes > /tmp/o_$tag.log 2>&1
echo "== $tag rc=$?"
grep -E '^[a-hs]-[a-z0-9-]+( [{]|: skipped)' /tmp/o_$tag.log > $OUT/$tag.modes
cp /tmp/o/$tag/bench_save.md $OUT/$tag.md; cp /tmp/o/$tag/bench_save.jsonl $OUT/$tag.jsonl; tail -c 3000 /tmp/o_$tag.log > $OUT/$tag.log
grep -E "^\| (a-|c-|f-|g-|h-|s-)|^- \[" $OUT/$tag.md | cut -c1-100
rm -rf $S
