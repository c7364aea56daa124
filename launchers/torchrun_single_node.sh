#!/usr/bin/env bash
# Single-node launch with torchrun: one rank per GPU (NCCL), or NPROC CPU ranks (gloo) without GPUs.
#
#   launchers/torchrun_single_node.sh --config launchers/configs/tiny_cpu.yaml --steps 20
#   NPROC=8 launchers/torchrun_single_node.sh --config launchers/configs/deepseek_like.yaml
#
# Equivalent to `te-dist train --nproc $NPROC ...`; every argument is passed to launchers/train.py.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "${NPROC:-}" ]]; then
  NPROC="$(python3 -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)')"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --standalone: a local rendezvous on a free port; --max-restarts 0: a failing rank ends the job.
exec python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" --max-restarts 0 \
  "$HERE/train.py" "$@"
