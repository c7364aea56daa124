"""Per-tensor FP8: current scaling exact values, delayed scaling history, margin, NaN/Inf handling."""

import math

import pytest
import torch

from te_dist import recipe as R
from te_dist.quantization import CurrentScalingQuantizer, DelayedScalingQuantizer, Float8Tensor, make_quantizer


def mean_history(history):
    """A user amax algorithm (module level so the recipe string stays stable)."""
    return history.mean()


def _t(values, device, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=device)


def test_current_scaling_known_amax_known_scale(device):
    x = _t([2.0, -1.0, 0.5, 0.0], device, torch.bfloat16)
    q = make_quantizer(R.Float8CurrentScaling(fp8_format=R.Format.E4M3), "input")(x)
    assert isinstance(q, Float8Tensor) and q.data.dtype == torch.float8_e4m3fn
    assert q.data.float().cpu().tolist() == [448.0, -224.0, 112.0, 0.0]
    assert q.scale_inv.item() == pytest.approx(1 / 224, rel=1e-7)
    assert torch.equal(q.dequantize(), x)
    assert q.dequantize().dtype == torch.bfloat16


def test_current_scaling_power_2(device):
    x = _t([2.0, -1.0, 0.5, 0.0], device)
    q = make_quantizer(R.Float8CurrentScaling(use_power_2_scales=True), "weight")(x)
    assert q.data.float().cpu().tolist() == [256.0, -128.0, 64.0, 0.0]
    assert q.scale_inv.item() == 2.0**-7


def test_hybrid_uses_e5m2_for_gradients(device):
    x = _t([2.0, -1.0], device)
    recipe = R.Float8CurrentScaling()  # HYBRID
    assert make_quantizer(recipe, "input")(x).data.dtype == torch.float8_e4m3fn
    g = make_quantizer(recipe, "grad_output")(x)
    assert g.data.dtype == torch.float8_e5m2
    assert g.scale_inv.item() == pytest.approx(2 / 57344, rel=1e-7)
    assert g.data.float().cpu().tolist() == [57344.0, -28672.0]


def test_non_finite_inputs(device):
    x = _t([1.0, float("nan"), float("inf"), -float("inf"), 0.5], device)
    q = make_quantizer(R.Float8CurrentScaling(fp8_format=R.Format.E4M3), "input")(x)
    assert q.scale_inv.item() == 1.0  # non-finite amax: scale 1, never 0 or inf
    out = q.dequantize().cpu()
    assert math.isnan(out[1].item())
    assert out.tolist()[0] == 1.0 and out.tolist()[2:] == [448.0, -448.0, 0.5]  # Inf saturates


def test_delayed_scaling_is_one_step_behind(device):
    recipe = R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=4)
    quantizer = make_quantizer(recipe, "input")
    assert isinstance(quantizer, DelayedScalingQuantizer)
    x = _t([2.0, -1.0], device)
    q1 = quantizer(x)
    assert q1.scale_inv.item() == 1.0 and q1.data.float().cpu().tolist() == [2.0, -1.0]  # first step: scale 1
    assert quantizer.scale.item() == 224.0  # updated from x's amax for the next step
    q2 = quantizer(_t([1.0, 0.25], device))
    assert q2.data.float().cpu().tolist() == [224.0, 56.0]
    assert quantizer.amax_history.cpu().tolist() == [1.0, 2.0, 0.0, 0.0]
    assert quantizer.scale.item() == 224.0  # "max" over the history is still 2


def test_amax_history_roll_over(device):
    recipe = R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=3)
    quantizer = make_quantizer(recipe, "weight")
    for amax in [1.0, 2.0, 8.0, 4.0, 0.5]:
        quantizer.observe(_t([amax], device))
    assert quantizer.amax_history.cpu().tolist() == [0.5, 4.0, 8.0]
    assert quantizer.scale.item() == 56.0  # 448 / 8
    quantizer.observe(_t([0.5], device))
    quantizer.observe(_t([0.5], device))
    assert quantizer.amax_history.cpu().tolist() == [0.5, 0.5, 0.5]  # the 8 has rolled out
    assert quantizer.scale.item() == 896.0
    assert quantizer.num_updates == 7


@pytest.mark.parametrize(
    "algo, expected_scale",
    [("max", 448.0 / 8.0), ("most_recent", 448.0 / 2.0), (mean_history, 448.0 / ((2.0 + 8.0 + 2.0) / 3))],
)
def test_amax_compute_algo(device, algo, expected_scale):
    quantizer = make_quantizer(R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=3, amax_compute_algo=algo), "input")
    for amax in [2.0, 8.0, 2.0]:
        quantizer.observe(_t([amax], device))
    assert quantizer.scale.item() == pytest.approx(expected_scale, rel=1e-6)


def test_margin(device):
    quantizer = make_quantizer(R.DelayedScaling(fp8_format=R.Format.E4M3, margin=2), "input")
    quantizer.observe(_t([2.0], device))
    assert quantizer.scale.item() == 56.0


def test_non_finite_amax_keeps_previous_scale(device):
    quantizer = make_quantizer(R.DelayedScaling(fp8_format=R.Format.E4M3, amax_compute_algo="most_recent"), "input")
    quantizer.observe(_t([2.0], device))
    for bad in ([float("nan"), 1.0], [float("inf"), 1.0], [0.0, -0.0]):
        quantizer.observe(_t(bad, device))
        assert quantizer.scale.item() == 224.0


def test_bad_callable_leaves_state_unchanged(device):
    quantizer = make_quantizer(R.DelayedScaling(amax_compute_algo=lambda h: "oops", amax_history_len=2), "input")
    before = (quantizer.amax_history.clone(), quantizer.scale.clone(), quantizer.num_updates)
    with pytest.raises(TypeError, match="1-element tensor"):
        quantizer(_t([3.0], device))
    assert torch.equal(quantizer.amax_history.cpu(), before[0]) and quantizer.scale.item() == before[1].item()
    assert quantizer.num_updates == before[2]


def test_quantizer_snapshots_recipe_settings(device):
    recipe = R.DelayedScaling(fp8_format=R.Format.E4M3, margin=0)
    quantizer = make_quantizer(recipe, "input")
    key = str(recipe)
    assert quantizer.settings_key == key
    recipe.margin = 3
    assert quantizer.settings_key == key != str(recipe)
    quantizer.observe(_t([2.0], device))
    assert quantizer.scale.item() == 224.0  # built for margin=0; rebuild to follow the recipe
    assert make_quantizer(recipe, "input").settings_key == str(recipe)


def test_current_scaling_quantizer_type():
    assert isinstance(make_quantizer(R.Float8CurrentScaling(), "grad_output"), CurrentScalingQuantizer)
