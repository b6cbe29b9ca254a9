#!/usr/bin/env bash
# Issue 59's measurement on one GPU (TE built: ../shared/gpu/README.md; the wheels of scripts/gpu_wheels.sh carried in
# .gpu/wheels), in device calls of under 10 minutes each, from the repository root, most needed first (a session's 30
# device-minutes hold the six part calls and cases 1-3; or the six, build and t, 10 and 9: the rows issue 59 still
# lacks):
#     bash scripts/gpu_bench_loop.sh 1   # after the six part calls: TE's build, the wheels, every mode at 4.43 GB
#     bash scripts/gpu_bench_loop.sh build && bash scripts/gpu_bench_loop.sh t   # TE's build and the wheels alone,
#                                        # then another case first (each of 2-8 and t needs them once on the machine)
#     bash scripts/gpu_bench_loop.sh t   # tests/gpu alone (also the end of case 3)
#     bash scripts/gpu_bench_loop.sh 2   # 17.7 GB: the recipe and Automodel, thread and writer process
#     bash scripts/gpu_bench_loop.sh 3   # 17.7 GB: torchtitan, thread and writer process; tests/gpu
#     bash scripts/gpu_bench_loop.sh 4   # 17.7 GB: the anchors (TE's class; torch_checkpointing)
#     bash scripts/gpu_bench_loop.sh 5   # 4.43 GB: budgets that fit the whole save, written by writer processes,
#                                        # beside the unbudgeted writer process
#     bash scripts/gpu_bench_loop.sh 6   # the same at 17.7 GB, torchtitan
#     bash scripts/gpu_bench_loop.sh 7   # the same at 17.7 GB, the recipe
#     bash scripts/gpu_bench_loop.sh 8   # 17.7 GB: budgets that fit the whole save, written by threads
#     bash scripts/gpu_bench_loop.sh 9   # 4.43 GB, 5 saves a mode: the stager in a plain DCP loop (thread, writer
#                                        # process, with the finite check) beside the recipe's and torchtitan's
#                                        # writer processes
#     bash scripts/gpu_bench_loop.sh 10  # 17.7 GB: the stager's writer process without and with the finite check,
#                                        # beside the recipe's (what of the recipe's loss its check and its
#                                        # checksums hold)
#     bash scripts/gpu_bench_loop.sh p   # no TE (no part calls; .gpu/deps and .gpu/wheels carried), one call: tests/gpu
#                                        # (what runs without TE), then ours at 17.7 GB with PortableFusedAdam, TE's
#                                        # bitwise twin (its slower step flatters a save's loss: not for the ratios)
# Cases 2-8 and t carry .gpu/wheels only (the machine kept warm since case 1 or build: TE stays installed). Each
# bench_save run is one of scripts/gpu_bench_run.sh (a mode that ends its run loses only that run's table; the
# finished modes' lines stay in $OUT/TAG.modes); its limit is about 1.3x the run's time on an H100 on 2026-12-07,
# measured with 3 baseline steps a save (now 8: 20 steps more a mode, 3 s at 17.7 GB). Results go to $OUT.
# tests/gpu runs verbose: each test's outcome is in $OUT/pytest_gpu.log as it ends, so a run cut short by its limit
# (95-100 s on a warm H100; more than 150 s once, right after TE's build) still names what failed.
set -u
export PYTHONPATH="$PWD:/tmp/site" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
run() { BENCH_TIMEOUT=$1 bash scripts/gpu_bench_run.sh "$2" "$3" "$4"; }
gpu_tests() {
  timeout 240 python3 -m pytest -v -p no:cacheprovider tests/gpu > "$OUT/pytest_gpu.log" 2>&1
  tail -n 5 "$OUT/pytest_gpu.log"
}
install_te_and_wheels() {  # fails where TE's build does (its log's tail shown either way)
  local log
  log=$(bash .gpu/install.sh build 2>&1) || { echo "$log" | tail -20; return 1; }
  echo "$log" | tail -2
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/wheels/*.whl
}
case "${1:-}" in
  build) install_te_and_wheels ;;
  1)
    install_te_and_wheels || exit 1
    run 470 l22 22 c-ours,c-ours-process,f-titan-ours,f-titan-ours-process,g-automodel-ours,g-automodel-ours-process,a-te-async-pinned,f-titan-te,g-automodel-te,h-checkpointing-te,f-titan-ours-budget-all,c-ours-budget-all ;;
  2)
    run 240 l88c 88 c-ours,c-ours-process
    run 280 l88g 88 g-automodel-ours,g-automodel-ours-process ;;
  3)
    run 330 l88f 88 f-titan-ours,f-titan-ours-process
    gpu_tests ;;
  t) gpu_tests ;;
  4) run 420 l88a 88 f-titan-te,h-checkpointing-te ;;  # 270 s ran out in the second mode on 2026-12-08
  8) run 260 l88b 88 f-titan-ours-budget-all,c-ours-budget-all ;;
  5)
    run 240 l22p 22 f-titan-ours-process,f-titan-ours-process-budget-all,c-ours-process,c-ours-process-budget-all ;;
  6) run 380 l88p 88 f-titan-ours-process,f-titan-ours-process-budget-all ;;
  7) run 300 l88q 88 c-ours-process,c-ours-process-budget-all ;;
  9) BENCH_REPEATS=5 run 420 l22s 22 s-stager,s-stager-process,s-stager-process-finite,c-ours-process,f-titan-ours-process ;;
  10) run 480 l88s 88 s-stager-process,s-stager-process-finite,c-ours-process ;;
  p)
    python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site .gpu/wheels/*.whl \
      .gpu/deps/hydra_core-* .gpu/deps/omegaconf-* .gpu/deps/antlr4-* 2>&1 | tail -2
    timeout 220 python3 -m pytest -v -p no:cacheprovider tests/gpu > "$OUT/pytest_gpu.log" 2>&1; tail -n 8 "$OUT/pytest_gpu.log"
    run 300 p88 88 c-ours,f-titan-ours ;;
  *) echo "usage: bash scripts/gpu_bench_loop.sh build|t|1|2|3|4|5|6|7|8|9|10|p" >&2; exit 2 ;;
esac
