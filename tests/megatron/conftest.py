"""Megatron test setup: megatron-core must be installed (CI installs the `megatron` extra).

Fixtures initialise Megatron's parallel_state for world size 1 and apply the documented CPU
workarounds of mcore_helpers (only on machines without a GPU, undone after each test).
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'te_dist[megatron]'")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import mcore_helpers`

import mcore_helpers  # noqa: E402


@pytest.fixture
def megatron_world1():
    """Megatron parallel_state at world size 1 (gloo on CPU, NCCL on GPU), EP=1."""
    import torch

    mcore_helpers.apply_cpu_workarounds()
    mcore_helpers.init_megatron(ep_size=1)
    torch.manual_seed(1234)
    try:
        yield
    finally:
        mcore_helpers.destroy_megatron()
        mcore_helpers.undo_cpu_workarounds()

# Megatron's own tests run through upstream_suite.py (their own plugin and process), never in this pytest process.
collect_ignore = ["upstream", "upstream_0_19"]
