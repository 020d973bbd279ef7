#!/usr/bin/env bash
# The GPU check of trainer pools (spec/pools.md §6-7), for a machine with CUDA: the nccl equivalence tests of
# tests/backends/test_pool_cuda.py (DDP, FSDP2 and, with 2 GPUs, pipeline pools against one GPU), then
# bench/pool.py's memory mode on CUDA (per-rank torch.cuda.max_memory_allocated / model size for ddp, fsdp
# and pipeline, one rank per GPU, 2 and 4 ranks where there are as many GPUs, else one).
# Usage, from anywhere: bench/pool_cuda_check.sh [HIDDEN]   (PYTHON picks the interpreter; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
if ! "$PYTHON" -c 'import peerloom.adapters.pool' 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .   # peerloom's folders as peerloom.*
fi
"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.device_count(), "GPU(s):", torch.cuda.get_device_name(0))'
"$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/backends/test_pool_cuda.py
"$PYTHON" bench/pool.py --memory --backend nccl --mem-hidden "${1:-2048}" --mem-ranks-list 2,4
