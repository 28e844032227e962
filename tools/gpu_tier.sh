#!/usr/bin/env bash
# The GPU tier, as run on a lent CUDA machine (the device tool; CI has no GPU). Runs from the repository
# root with the machine's own python3/torch; writes logs under ${OUT:-.tmp/gpu}. Each part is bounded and
# independent, so one failure does not hide the others.
set -u
OUT=${OUT:-.tmp/gpu}; mkdir -p "$OUT" .tmp
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1 TMPDIR=$PWD/.tmp
PY=${PY:-python3}
{ nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"; } 2>&1 | tee "$OUT/device.txt"
part() {  # part NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - start))s: $(tail -n 1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
}
PYTEST=($PY -m pytest -q -p no:cacheprovider --basetemp=$PWD/.tmp/pytest -o addopts="-ra --strict-markers -p hasten.testing.pytest_plugin")
part contract_cuda 160 "${PYTEST[@]}" tests/strategies/test_contract_cuda.py
part cuda_single 120 "${PYTEST[@]}" tests/strategies/test_cuda_single.py
# Forked gloo ranks cannot follow CUDA autograd in the same process ("autograd's threading in combination
# with fork"): the files with forked multi-rank tests run in a pytest process of their own.
part forked_ranks 100 "${PYTEST[@]}" tests/precision/test_precision_accumulation.py
part device_aware 100 "${PYTEST[@]}" --maxfail=20 tests/accelerate_compat/test_accelerate_long_tail.py tests/base/test_memory.py tests/precision/test_fp8.py tests/big_modeling/test_big_modeling.py
part hasten_env 20 $PY -m hasten.commands.main env
cat "$OUT/summary.txt"
