"""Sizes worked out from the config (te_dist.train.estimate) and the memory check before a launch."""

import pytest

from te_dist.train.config import ConfigError, JobConfig, ModelConfig, config_from_dict, load_config
from te_dist.train.estimate import (GiB, fp8_flops_share, flops_per_token, memory_estimate, model_size,
                                     speedup_ceiling, speedup_needed)
from te_dist.train.preflight import LaunchPlan, memory_report

from conftest import REPO_ROOT


@pytest.mark.parametrize(
    "model",
    [{}, {"activation": "gelu", "expert_bias": True, "num_experts": 6, "top_k": 3, "vocab_size": 50},
     {"dtype": "bfloat16", "num_layers": 3, "hidden_size": 256, "num_heads": 8}],
)
def test_parameter_counts_match_the_built_model(model):
    from te_dist.train.model import build_model

    cfg = ModelConfig(**model)
    built = build_model(cfg, seed=0)
    size = model_size(cfg)
    assert size.total == sum(p.numel() for p in built.parameters())
    assert size.router == sum(p.numel() for n, p in built.named_parameters() if "router" in n)
    assert size.per_rank(2) == size.total - size.expert // 2


def test_flops_per_token_by_hand():
    m = ModelConfig()  # V=64 H=128 F=128 E=4 k=2 L=2, swiglu
    per_layer = 4 * 128 * 128 + 4 * 128 + 2 * (128 * 256 + 128 * 128)
    active = 2 * per_layer + 64 * 128
    assert flops_per_token(m, 32) == 6 * active + 12 * 2 * 128 * 32


def test_fp8_share_by_hand_and_its_ceiling():
    m = ModelConfig()  # V=64 H=128 F=128 E=4 k=2 L=2, swiglu
    expert = 6 * 2 * 2 * (128 * 256 + 128 * 128)
    dense = 6 * (2 * 4 * 128 * 128 + 64 * 128)  # attention projections and the LM head
    assert fp8_flops_share(m, 32) == pytest.approx(expert / flops_per_token(m, 32))
    assert fp8_flops_share(ModelConfig(fp8_dense=True), 32) == pytest.approx((expert + dense) / flops_per_token(m, 32))
    share = fp8_flops_share(m, 32)
    assert speedup_ceiling(share, 1.0) == pytest.approx(1.0)
    assert 1.0 < speedup_ceiling(share, 1.5) < 1.5  # the rest of the step does not speed up
    assert speedup_ceiling(1.0, 1.5) == pytest.approx(1.5)
    assert speedup_ceiling(share, speedup_needed(share, 1.1)) == pytest.approx(1.1)
    assert speedup_needed(0.1, 1.25) == float("inf")  # the other 90% alone take longer than 1/1.25


def test_estimate_grows_with_the_job_and_shrinks_with_ep():
    small = memory_estimate(JobConfig(), 2, device_type="cpu")
    bigger = memory_estimate(config_from_dict({"data": {"global_batch_size": 64}}), 2, device_type="cpu")
    assert bigger.activations > small.activations and bigger.params == small.params
    ep1 = memory_estimate(config_from_dict({"parallel": {"ep": 1}}), 2, device_type="cpu")
    assert ep1.params > small.params  # every rank holds every expert


def test_a_cpu_job_that_cannot_fit_is_refused_with_the_estimate_and_a_hint():
    cfg = load_config(REPO_ROOT / "launchers" / "configs" / "deepseek_like.yaml")
    plan = LaunchPlan(nproc=8, device="cpu", nproc_given=True)
    with pytest.raises(ConfigError) as exc:
        memory_report(cfg, plan, available=16 * GiB)
    text = str(exc.value)
    assert "8 ranks x" in text and "but the machine has 16.00 GiB available" in text
    assert "params" in text and "optimizer" in text and "activations" in text
    assert "fewer ranks (--nproc)" in text and "--skip-memory-check" in text
    # The same job is reported, not refused, when the check is skipped or the memory is there.
    assert "memory per rank (estimate)" in memory_report(cfg, plan, enforce=False, available=16 * GiB)
    assert "of 1024.0 GiB available" in memory_report(cfg, plan, available=1024 * GiB)


def test_refusal_from_the_command_line_before_any_rank_starts(run_cli):
    result = run_cli("train", "--config", REPO_ROOT / "launchers" / "configs" / "deepseek_like.yaml",
                     "--device", "cpu", "--nproc", 8, "--data.global_batch_size", 8192, timeout=60)
    assert result.returncode == 2
    assert result.output.startswith("[te-dist] train: 8 ranks (gloo, cpu)")  # what was asked, first
    assert "te-dist train: error: this job needs about" in result.output
    assert "use fewer ranks (--nproc)" in result.output
    assert "torch.distributed" not in result.output  # no rank was started
