"""Expert features off the block grid (gpt-oss's 2880 under 128-wide blocks): a layer's forward and
backward never raise; the emulated path pads to the grid with zeros and equals the padded reference.
The native path's padding (te_dist.settings.fp8_pad_off_grid): test_off_grid_native.py."""

import pytest
import torch
import torch.nn.functional as F

import te_dist as td
from te_dist import recipe as R
from te_dist.moe import MoELayer
from te_dist.ops import GroupedLinear, OperationFuser
from te_dist.quantization import make_quantizer

RECIPES = [R.Float8BlockScaling(), R.MXFP8BlockScaling(), R.Float8CurrentScaling()]


def _padded_fake_quantize(t, recipe, role):
    """Quantize the zero-padded tensor, dequantize, slice: what an exact tiling of the real elements gives."""
    q = make_quantizer(recipe, role)
    br, bc = q.block_shape
    rows, cols = t.shape[-2], t.shape[-1]
    padded = F.pad(t, (0, -cols % bc, 0, -rows % br))
    return q(padded).dequantize()[..., :rows, :cols]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_grouped_linear_off_grid_equals_the_padded_reference(recipe):
    torch.manual_seed(0)
    op = GroupedLinear(2, 200, 136, dtype=torch.float32)
    sizes = (37, 91)
    x = torch.randn(sum(sizes), 200, requires_grad=True)
    with td.autocast(recipe=recipe):
        y = OperationFuser([op])(x, torch.tensor(sizes))
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(op.weight.grad).all()
    xq = _padded_fake_quantize(x.detach(), recipe, "input")
    wq = _padded_fake_quantize(op.weight.detach(), recipe, "weight")
    parts = torch.split(xq, sizes)
    ref = torch.cat([p @ wq[e].T for e, p in enumerate(parts)])
    assert torch.allclose(y.detach(), ref, rtol=1e-5, atol=1e-5)


def test_moe_layer_with_gpt_oss_like_features_trains_under_block_scaling():
    """A forward + backward of H 2880-like (here 160) experts under Float8BlockScaling: no ValueError."""
    torch.manual_seed(0)
    layer = MoELayer(160, 96, 4, 2, dtype=torch.float32)
    x = torch.randn(64, 160, requires_grad=True)
    with td.autocast(recipe=R.Float8BlockScaling()):
        y = layer(x)
    y.square().mean().backward()
    assert y.shape == x.shape and torch.isfinite(layer.fc1.weight.grad).all()


@pytest.mark.gpu
def test_an_emulated_fp8_path_on_a_gpu_is_said_once(cuda_device):
    """On a GPU, an FP8 recipe that cannot run the native kernels warns once per process and reason,
    naming the path and why: off-grid features (te_dist.settings.fp8_pad_off_grid off), and MXFP8
    before SM 10.0."""
    import warnings

    from te_dist.ops.basic import grouped_linear

    grouped_linear._said_emulated.clear()
    layer = MoELayer(160, 96, 4, 2, dtype=torch.bfloat16, device=cuda_device)
    x = torch.randn(64, 160, dtype=torch.bfloat16, device=cuda_device)
    with warnings.catch_warnings(record=True) as caught, td.settings.override(fp8_pad_off_grid=False):
        warnings.simplefilter("always")
        for _ in range(3):
            with td.autocast(recipe=R.Float8CurrentScaling()):
                layer(x)
    said = [str(w.message) for w in caught if "run the emulated path" in str(w.message)]
    assert len(said) == 1 and "not multiples of 128" in said[0], said
    square = MoELayer(256, 128, 4, 2, dtype=torch.bfloat16, device=cuda_device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.autocast(recipe=R.MXFP8BlockScaling()):
            square(torch.randn(64, 256, dtype=torch.bfloat16, device=cuda_device))
    said = [str(w.message) for w in caught if "MXFP8BlockScaling expert GEMMs" in str(w.message)]
    assert len(said) == 1 and "SM 10.0" in said[0], said


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [R.Float8BlockScaling(), R.Float8CurrentScaling()], ids=lambda r: type(r).__name__)
def test_off_grid_layer_trains_on_a_gpu(cuda_device, recipe):
    """gpt-oss-like features (here 160 / 96) under an FP8 recipe on a GPU: forward and backward run."""
    torch.manual_seed(0)
    layer = MoELayer(160, 96, 4, 2, dtype=torch.bfloat16, device=cuda_device)
    x = torch.randn(256, 160, dtype=torch.bfloat16, device=cuda_device, requires_grad=True)
    with td.autocast(recipe=recipe):
        y = layer(x)
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.fc2.weight.grad).all()
