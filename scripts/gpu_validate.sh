#!/usr/bin/env bash
# GPU validation on a machine with CUDA and Transformer Engine, from the repository root.
#   bash scripts/gpu_validate.sh single   # one-GPU tests + export benchmark over every case (BENCH=0: tests only)
#   bash scripts/gpu_validate.sh twin     # PortableFusedAdam vs TE: the compare_backends table (--bitwise)
#   bash scripts/gpu_validate.sh first    # first export without a pinned pool: 1 GPU, then 2 concurrent ranks
#   bash scripts/gpu_validate.sh save     # 2 GPUs: bench_save (the save path side by side), bench_recipe_overhead
#   bash scripts/gpu_validate.sh multi    # 2-GPU tests (torchrun) incl. the recipe
#   bash scripts/gpu_validate.sh floors   # 1 GPU: a resume's peak (bench_resume), the loss to the loop against its
#                                         # floor (bench_save: a, c, d)
#   bash scripts/gpu_validate.sh writes   # durable writes against dd: synthetic 4 GB and the 805M recipe (bench_write)
#   bash scripts/gpu_validate.sh frameworks  # 1 GPU: bench_save's torchtitan and Automodel modes beside (a) and (c)
#                                         # (LAYERS=88: 4x the state; MODES=... to split a run; GC=automatic:
#                                         # bench_save --gc automatic, not frozen; the wheels of
#                                         # scripts/gpu_wheels.sh installed, their folder on PYTHONPATH)
#   bash scripts/gpu_validate.sh stream   # streaming export acceptance: 2 GiB of BF16 states and one 1.07e9-element
#                                         # state, every mode, fresh processes (first export, host memory over 10)
# Logs and results go to ${OUT:-gpu-out}/ (pytest logs, gpu_results.jsonl, bench.md, bench_peak.png).
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" GPU_RESULTS="$out/gpu_results.jsonl"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
$py -c "import torch, transformer_engine as te; print('torch', torch.__version__, 'te', te.__version__, 'gpus', torch.cuda.device_count())"
case "${1:-single}" in
  single)
    start=$(date +%s)
    timeout 300 $py -m pytest -q -rs -p no:cacheprovider tests/gpu/test_te_fused_adam.py tests/gpu/test_streaming_cuda.py tests/gpu/test_te_empty_shards.py tests/gpu/test_kernel_math_cuda.py tests/gpu/test_host_copies_cuda.py tests/gpu/test_stop_signal_cuda.py > "$out/pytest_single.log" 2>&1
    echo "pytest single rc=$? in $(( $(date +%s) - start )) s"; tail -n 25 "$out/pytest_single.log"
    [ "${BENCH:-1}" = 0 ] && exit 0
    start=$(date +%s)
    png=""; $py -c "import matplotlib" 2>/dev/null && png="--png $out/bench_peak.png"
    # every benchmark case: GPU peak and GB/s of the default, per-state and chunked exports (64 MiB chunks)
    timeout ${BENCH_TIMEOUT:-300} $py -m scripts.bench_export --repeats ${REPEATS:-3} --dtypes ${DTYPES:-bf16,fp8} \
      --modes ${MODES:-default,default+cpu,offload,chunked,chunked+reuse} \
      --out "$out/bench.md" --jsonl "$out/bench.jsonl" $png > "$out/bench.log" 2>&1
    echo "bench rc=$? in $(( $(date +%s) - start )) s"; cat "$out/bench.md" 2>/dev/null || tail -n 30 "$out/bench.log" ;;
  stream)
    start=$(date +%s)
    timeout 400 $py -m scripts.bench_export --cases 64x4M,1x1G --dtypes bf16 --repeats 5 --fresh 10 \
      --out "$out/bench_stream.md" --jsonl "$out/bench_stream.jsonl" > "$out/bench_stream.log" 2>&1
    echo "bench stream rc=$? in $(( $(date +%s) - start )) s"; cat "$out/bench_stream.md" 2>/dev/null || tail -n 30 "$out/bench_stream.log" ;;
  twin)
    start=$(date +%s)
    timeout 300 $py -m scripts.compare_backends --out "$out/compare_backends" --bitwise > "$out/compare_backends.log" 2>&1
    echo "compare_backends rc=$? in $(( $(date +%s) - start )) s"; cat "$out/compare_backends/compare.md" 2>/dev/null || tail -n 30 "$out/compare_backends.log" ;;
  first)
    start=$(date +%s)
    timeout 400 $py -m benchmarks.probes.bench_first_export --out "$out/first_export" > "$out/first_export.log" 2>&1
    echo "bench_first_export rc=$? in $(( $(date +%s) - start )) s"; cat "$out/first_export/first_export.md" 2>/dev/null || tail -n 30 "$out/first_export.log" ;;
  save)
    start=$(date +%s)
    mkdir -p "${SCRATCH:-/tmp/bench-save}"
    timeout 420 $py -m torch.distributed.run --standalone --nproc_per_node=2 -m scripts.bench_save --out "$out/bench_save" \
      --scratch "${SCRATCH:-/tmp/bench-save}" > "$out/bench_save.log" 2>&1
    echo "bench_save rc=$? in $(( $(date +%s) - start )) s"; cat "$out/bench_save/bench_save.md" 2>/dev/null || tail -n 40 "$out/bench_save.log"
    start=$(date +%s)
    timeout 300 $py -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.probes.bench_recipe_overhead \
      --out "$out/recipe_overhead" > "$out/recipe_overhead.log" 2>&1
    echo "bench_recipe_overhead rc=$? in $(( $(date +%s) - start )) s"; cat "$out/recipe_overhead/bench_recipe_overhead.md" 2>/dev/null || tail -n 40 "$out/recipe_overhead.log" ;;
  floors)
    start=$(date +%s)
    mkdir -p "${SCRATCH:-/tmp}"; scratch=$(mktemp -d "${SCRATCH:-/tmp}/floors.XXXX")  # deleted at the end, alone
    timeout 200 $py -m torch.distributed.run --standalone --nproc_per_node=1 -m scripts.bench_resume \
      --out "$out/bench_resume" --scratch "$scratch" > "$out/bench_resume.log" 2>&1
    echo "bench_resume rc=$? in $(( $(date +%s) - start )) s"; cat "$out/bench_resume/bench_resume.md" 2>/dev/null || tail -n 30 "$out/bench_resume.log"
    rm -rf "$scratch"/*; start=$(date +%s)
    timeout 300 $py -m torch.distributed.run --standalone --nproc_per_node=1 -m scripts.bench_save --out "$out/bench_save" \
      --scratch "$scratch" --repeats ${REPEATS:-3} --modes a-te-async-pinned,c-ours,d-ours-keep-bf16 > "$out/bench_save.log" 2>&1
    echo "bench_save rc=$? in $(( $(date +%s) - start )) s"; cat "$out/bench_save/bench_save.md" 2>/dev/null || tail -n 40 "$out/bench_save.log"
    rm -rf "$scratch" ;;
  writes)
    start=$(date +%s)
    mkdir -p "${SCRATCH:-/tmp}"; scratch=$(mktemp -d "${SCRATCH:-/tmp}/writes.XXXX")  # deleted at the end, alone
    timeout 150 $py -m scripts.bench_write --gb 4 --threads 1,2,4,8 --repeats 3 --scratch "$scratch" \
      --out "$out/bench_write_synthetic" > "$out/bench_write_synthetic.log" 2>&1
    echo "bench_write synthetic rc=$? in $(( $(date +%s) - start )) s"; tail -n 12 "$out/bench_write_synthetic.log"
    rm -rf "$scratch"/*; start=$(date +%s)
    recipe="model.d_model=2048 model.n_layers=16 model.n_heads=16 model.d_ff=8192 model.dtype=bf16 experiment=lowmem trainer.device=cuda"
    timeout 400 $py -m scripts.bench_write --recipe "$recipe" --threads ${THREADS:-1,2,4,8} --repeats 2 --every 5 \
      --scratch "$scratch" --out "$out/bench_write_recipe" > "$out/bench_write_recipe.log" 2>&1
    echo "bench_write recipe rc=$? in $(( $(date +%s) - start )) s"; tail -n 12 "$out/bench_write_recipe.log"
    rm -rf "$scratch" ;;
  frameworks)
    start=$(date +%s); layers=${LAYERS:-22}; name="frameworks_$layers${GC:+_$GC}"  # GC: bench_save's --gc
    mkdir -p "${SCRATCH:-/tmp}"; scratch=$(mktemp -d "${SCRATCH:-/tmp}/frameworks.XXXX")  # deleted at the end, alone
    timeout ${BENCH_TIMEOUT:-580} $py -m torch.distributed.run --standalone --nproc_per_node=1 -m scripts.bench_save \
      --out "$out/$name" --scratch "$scratch" --layers "$layers" --repeats ${REPEATS:-3} ${GC:+--gc "$GC"} \
      --modes ${MODES:-a-te-async-pinned,c-ours,f-titan-te,f-titan-ours,g-automodel-te,g-automodel-ours} \
      > "$out/$name.log" 2>&1
    echo "bench_save frameworks rc=$? in $(( $(date +%s) - start )) s"
    cat "$out/$name/bench_save.md" 2>/dev/null || grep -v ' - INFO - ' "$out/$name.log" | tail -n 40
    rm -rf "$scratch" ;;
  multi)
    mkdir -p /tmp/smoke
    timeout 120 $py -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.distributed.run_worker \
      save_for_reshard te fp32-params-fp32-states /tmp/smoke > "$out/smoke_multi.log" 2>&1
    echo "smoke rc=$?"; grep -vE "Warning|warn" "$out/smoke_multi.log" | tail -n 25
    start=$(date +%s)
    timeout 540 $py -m pytest -q -rs -p no:cacheprovider tests/gpu/test_te_distributed.py tests/gpu/test_te_empty_shards.py::test_fsdp2_one_element_bias_fp16_fp8_dcp_flatten_save_load_continue > "$out/pytest_multi.log" 2>&1
    echo "pytest multi rc=$? in $(( $(date +%s) - start )) s"; tail -n 60 "$out/pytest_multi.log" ;;
esac
