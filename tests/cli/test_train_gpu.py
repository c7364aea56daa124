"""`te-dist train` with NCCL, one rank per GPU (run on the device machine; skipped without CUDA)."""

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _losses(out_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def test_one_gpu_rank(run_cli, tmp_path):
    result = run_cli("train", "--nproc", 1, "--steps", 5, "--log-every", 1).check()
    assert "1 ranks (nccl, cuda)" in result.output
    losses = _losses(tmp_path / "te_dist_out" / "latest")
    assert losses[5] < losses[1]


@pytest.mark.parametrize("recipe", ["block", "current", "delayed"])
def test_fp8_recipes_run_the_native_expert_path(run_cli, tmp_path, recipe):
    """On an H200 every FP8 recipe's expert MLPs take the native grouped kernels (the default
    model's features are multiples of 128), and training still lowers the loss."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the native FP8 grouped kernels are sm_90a only")
    result = run_cli("train", "--nproc", 1, "--steps", 5, "--log-every", 1, "--recipe", recipe).check()
    assert "[te-dist] expert MLPs: native (CUTLASS SM90 FP8 grouped GEMMs" in result.output
    losses = _losses(tmp_path / "te_dist_out" / "latest")
    assert losses[5] < losses[1]


@pytest.mark.parametrize("recipe", ["block", "current"])
def test_fp8_dense_linears_run_native_with_the_switch_on(run_cli, tmp_path, monkeypatch, recipe):
    """model.fp8_dense with te_dist.settings.fp8_dense_native on: the attention projections and the
    LM head take the FP8 grouped kernels as one group, and training still lowers the loss."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the native FP8 grouped kernels are sm_90a only")
    monkeypatch.setenv("TE_DIST_FP8_DENSE_NATIVE", "1")
    result = run_cli("train", "--nproc", 1, "--steps", 5, "--log-every", 1, "--recipe", recipe,
                     "--model.fp8_dense", "true", "--model.vocab_size", 128).check()  # the head on the grid
    assert "[te-dist] dense linears (attention, LM head): native" in result.output
    losses = _losses(tmp_path / "te_dist_out" / "latest")
    assert losses[5] < losses[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_resume(run_cli, tmp_path):
    # Unquantized, as the CPU test of resuming at another EP size: per-tensor FP8 scales are taken
    # over what a rank holds, so a quantized model is a slightly different function at another EP size.
    common = ("train", "--nproc", 2, "--steps", 6, "--ckpt-every", 3, "--recipe", "none")
    run_cli(*common, "--out", "straight").check()
    result = run_cli(*common, "--out", "resumed", "--resume", "straight/checkpoints/step_000003", "--ep", 1).check()
    assert "2 ranks (nccl, cuda) | ep=1" in result.output
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert resumed[4] == pytest.approx(straight[4], rel=1e-4)
