#!/usr/bin/env bash
# Fills .gpu/wheels/ (ignored by git) with the wheels a GPU machine (torch 2.11 image, Python 3.12, TE from
# ../shared/gpu, no network) lacks for tests/integrations and for bench_save's framework modes (f-titan-*,
# g-automodel-*, h-checkpointing-te): the pinned frameworks of tests/integrations/requirements.txt (the one list of
# their versions, torch_checkpointing's too) and the two the image lacks from optim-factory's own dependencies
# (xxhash: the recipe's checksums, c-ours; tqdm: huggingface_hub imports it). Run on a CPU machine with PyPI, from
# anywhere inside the checkout:
#     bash scripts/gpu_wheels.sh
# Carry .gpu/wheels to the GPU machine (its size is printed; a transfer holds at most 64 MiB), then there:
#     python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/wheels/*.whl
#     export PYTHONPATH="$PWD:/tmp/site"
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXTRA=(xxhash==4.1.0 tqdm==4.70.1)
out=.gpu/wheels
rm -rf "$out" && mkdir -p "$out"
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' tests/integrations/requirements.txt | grep -v '^$')
python3 -m pip download -q --no-deps --only-binary=:all: -d "$out" --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any "${pins[@]}" "${EXTRA[@]}" 2>&1 | grep -v '^WARNING' || true  # the count below checks it
expected=$(( ${#pins[@]} + ${#EXTRA[@]} ))
found=$(find "$out" -name '*.whl' | wc -l)
[ "$found" -eq "$expected" ] || { echo "gpu_wheels.sh: $found wheels in $out, expected $expected" >&2; exit 1; }
ls "$out"
echo "ready: $out ($(du -sh "$out" | cut -f1), $found wheels)"
