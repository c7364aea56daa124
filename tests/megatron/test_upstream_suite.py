"""The pinned Megatron-Core tests are Megatron's own, and a small slice of them passes with te_dist experts.

The whole target (both arms, 1 and 2 ranks) takes about 10 minutes on a shared 2-core machine, so it is
a documented command (docs/megatron.md, ``python tests/megatron/upstream_suite.py``), not a CI test.
"""

import hashlib
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("pinned", ["upstream", "upstream_0_19"])
def test_pinned_files_are_megatrons_unmodified(pinned):
    pinned = HERE / pinned
    table = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$", (pinned / "README.md").read_text(), re.M))
    on_disk = {str(p.relative_to(pinned)) for p in pinned.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.name not in ("README.md", "pytest.ini")}
    assert set(table) == on_disk
    for name, digest in table.items():
        assert hashlib.sha256((pinned / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.multiprocess
def test_megatron_moe_layer_and_checkpoint_tests_pass_with_te_dist_experts(tmp_path):
    sys.path.insert(0, str(HERE))
    import upstream_suite

    # A gated (SwiGLU) checkpoint round trip in both of Megatron's layouts through GroupedExperts,
    # and fp16 forward/backward of a Megatron MoELayer (default GELU experts) with them.
    selection = "(grouped and etp12) or (fp16 and 1-1-2-allgather)"
    files = [upstream_suite.FILES[3], upstream_suite.FILES[-1]]
    run = upstream_suite.run_arm("te_dist", 1, files, ["-k", selection], timeout=480)
    assert "crashed" not in run, run.get("crashed")
    outcomes = {test_id.split("::")[-1]: outcome for test_id, (outcome, _) in run["tests"].items()}
    assert sorted(outcomes.values()) == ["passed"] * 3, outcomes
