"""Training entry for a plain ``torchrun`` (single node or Slurm): one process per rank.

    torchrun --nproc-per-node 2 launchers/train.py --config launchers/configs/tiny_cpu.yaml

Takes the same flags as ``te-dist train`` (except ``--nproc``: torchrun decides the ranks).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout too

from te_dist.train.worker import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
