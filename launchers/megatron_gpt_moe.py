"""Megatron-Core GPT MoE training with te_dist's experts, one process per GPU under ``torchrun``:

    torchrun --nproc-per-node 2 launchers/megatron_gpt_moe.py --recipe block --steps 5 --micro-batches 4

Megatron's DDP and distributed optimizer (``--overlap``: overlapped grad reduce and param all-gather),
its schedule over several micro-batches, ``--save`` / ``--load`` distributed checkpoints. The code is
``te_dist/megatron/gpt_moe_example.py``; docs/megatron.md walks through it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout too

from te_dist.megatron.gpt_moe_example import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
