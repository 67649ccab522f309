#!/usr/bin/env bash
# Multi-GPU parity check: one torchrun rank per GPU, NCCL, contiguous and load-balanced.
set -euo pipefail
n=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
for layout in contiguous load_balanced; do
  torchrun --standalone --nproc-per-node "$n" -m hp_cp_torch.cli demo --launcher torchrun --layout "$layout"
done
