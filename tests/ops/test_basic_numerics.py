"""Every basic op, forward and backward, against a float64 reference, for no recipe and each recipe."""

import pytest
import torch

import te_dist
from te_dist import ops
from ops_reference import (
    RECIPE_NAMES,
    _GradQuant,
    assert_close,
    fq,
    make_recipe,
    ref_grouped_linear,
    ref_linear,
    ref_swiglu,
    st_quant,
)

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
RECIPES = [pytest.param(n, id=n) for n in RECIPE_NAMES]


def leaf64(t):
    return t.detach().double().requires_grad_(True)


def run_op(op, x, extra, recipe, dy):
    with te_dist.autocast(recipe=recipe):
        y = op(x, *extra)
    y.backward(dy)
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_basic_linear(recipe_name, dtype):
    torch.manual_seed(0)
    recipe = make_recipe(recipe_name)
    op = ops.BasicLinear(128, 128, dtype=dtype)
    x = torch.randn(2, 8, 128, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 8, 128, dtype=dtype)
    y = run_op(op, x, (), recipe, dy)
    x64, w64 = leaf64(x), leaf64(op.weight)
    y64 = ref_linear(x64.reshape(16, 128), w64, recipe, dtype).reshape(2, 8, 128)
    y64.backward(dy.double())
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(op.weight.grad, w64.grad, dtype, "dw")
    if recipe is not None:
        assert op.quantizers.input.settings_key == str(recipe)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_grouped_linear(recipe_name, dtype, bias):
    torch.manual_seed(1)
    recipe = make_recipe(recipe_name)
    op = ops.GroupedLinear(3, 128, 128, bias=bias, dtype=dtype)
    if bias:
        with torch.no_grad():
            op.bias.normal_()
    splits = torch.tensor([5, 0, 11])  # an expert with zero rows is legal
    x = torch.randn(16, 128, dtype=dtype, requires_grad=True)
    dy = torch.randn(16, 128, dtype=dtype)
    y = run_op(op, x, (splits,), recipe, dy)
    x64, w64 = leaf64(x), leaf64(op.weight)
    b64 = leaf64(op.bias) if bias else None
    y64 = ref_grouped_linear(x64, w64, b64, splits, recipe, dtype)
    y64.backward(dy.double())
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(op.weight.grad, w64.grad, dtype, "dw")
    assert torch.count_nonzero(op.weight.grad[1]) == 0  # no rows -> zero weight gradient
    if bias:
        assert_close(op.bias.grad, b64.grad, dtype, "db")
        assert torch.count_nonzero(op.bias.grad[1]) == 0


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_quantize_op(recipe_name):
    torch.manual_seed(2)
    recipe = make_recipe(recipe_name)
    op = ops.Quantize()
    x = torch.randn(4, 128, requires_grad=True)
    dy = torch.randn(4, 128)
    y = run_op(op, x, (), recipe, dy)
    torch.testing.assert_close(y, fq(x, recipe, "input").float(), rtol=0, atol=0)
    x64 = leaf64(x)
    _GradQuant.apply(st_quant(x64, recipe, "input", torch.float32), recipe, torch.float32).backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=0)
    if recipe is not None:
        assert not torch.equal(y, x), "a recipe must actually quantize"


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias(dtype, recipe_name):
    torch.manual_seed(3)
    recipe = make_recipe(recipe_name)  # no GEMM operand: the recipe must not change anything
    op = ops.Bias(6, dtype=dtype)
    with torch.no_grad():
        op.bias.normal_()
    x = torch.randn(2, 3, 6, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 3, 6, dtype=dtype)
    y = run_op(op, x, (), recipe, dy)
    x64, b64 = leaf64(x), leaf64(op.bias)
    (x64 + b64).backward(dy.double())
    assert_close(y, x64 + b64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(op.bias.grad, b64.grad, dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "make_op, ref",
    [
        (lambda: ops.GELU(), lambda t: torch.nn.functional.gelu(t)),
        (lambda: ops.GELU(approximate="tanh"), lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
        (lambda: ops.ReLU(), torch.relu),
        (lambda: ops.SwiGLU(), ref_swiglu),
        (lambda: ops.SwiGLU(limit=0.5), lambda t: ref_swiglu(t, 0.5)),
    ],
    ids=["gelu", "gelu_tanh", "relu", "swiglu", "swiglu_limit"],
)
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_elementwise(make_op, ref, dtype, recipe_name):
    torch.manual_seed(4)
    recipe = make_recipe(recipe_name)  # no GEMM operand: the recipe must not change anything
    op = make_op()
    x = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    y_shape = ref(x.detach().double()).shape
    dy = torch.randn(y_shape, dtype=dtype)
    y = run_op(op, x, (), recipe, dy)
    x64 = leaf64(x)
    y64 = ref(x64)
    y64.backward(dy.double())
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [None, 0.7])
def test_scaled_swiglu(dtype, limit, recipe_name):
    torch.manual_seed(5)
    recipe = make_recipe(recipe_name)
    op = ops.ScaledSwiGLU(limit=limit)
    x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    probs = torch.rand(6, dtype=torch.float32, requires_grad=True)  # router probs stay fp32
    dy = torch.randn(6, 4, dtype=dtype)
    y = run_op(op, x, (probs,), recipe, dy)
    x64, p64 = leaf64(x), leaf64(probs)
    y64 = ref_swiglu(x64, limit) * p64[:, None]
    y64.backward(dy.double())
    assert y.dtype == dtype and probs.grad.dtype == torch.float32
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(probs.grad, p64.grad, dtype, "dprobs")


def test_swiglu_limit_zeroes_clamped_gradients():
    op = ops.SwiGLU(limit=1.0)
    x = torch.tensor([[2.0, 0.5, 3.0, -3.0]], requires_grad=True)  # gate=[2, .5], up=[3, -3]: clamped
    op(x).sum().backward()
    assert x.grad[0, 0] == 0 and x.grad[0, 2] == 0 and x.grad[0, 3] == 0
    assert x.grad[0, 1] != 0


def test_grouped_linear_rejects_bad_split_sizes():
    op = ops.GroupedLinear(2, 4, 4)
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="sum to 4 but the input has 5 rows"):
        op(x, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="non-negative"):
        op(x, torch.tensor([6, -1]))
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        op(x, torch.tensor([5]))
    with pytest.raises(TypeError, match="int64 or int32"):
        op(x, torch.tensor([2.0, 3.0]))
    with pytest.raises(TypeError, match="dtype"):
        op(x.double(), torch.tensor([2, 3]))


def test_grouped_linear_takes_group_splits_as_given():
    """Offsets on the device plus host sizes (what the MoE dispatcher hands over) give the same
    result as split sizes, and the op uses the caller's offsets tensor itself (no copy)."""
    torch.manual_seed(3)
    op = ops.GroupedLinear(3, 8, 6, bias=True)
    x = torch.randn(16, 8, requires_grad=True)
    sizes = (5, 0, 11)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y_ref = op(x, torch.tensor(sizes))
    y = op(x, ops.GroupSplits(offsets, sizes))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    got_offsets, got_sizes = op.groups(ops.GroupSplits(offsets, list(sizes)), x)
    assert got_offsets is offsets and got_sizes == sizes
    y.sum().backward()
    assert torch.count_nonzero(op.weight.grad[1]) == 0


def test_grouped_linear_rejects_bad_group_splits():
    op = ops.GroupedLinear(2, 4, 4)
    x = torch.randn(5, 4)
    good = torch.tensor([2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="sum to 4 but the input has 5 rows"):
        op(x, ops.GroupSplits(good, (2, 2)))
    with pytest.raises(ValueError, match="non-negative"):
        op(x, ops.GroupSplits(good, (6, -1)))
    with pytest.raises(ValueError, match="2 entries"):
        op(x, ops.GroupSplits(good, (5,)))
    with pytest.raises(TypeError, match=r"int32 tensor of shape \[2\], got torch.int64"):
        op(x, ops.GroupSplits(good.long(), (2, 3)))
    with pytest.raises(TypeError, match="got list"):
        op(x, ops.GroupSplits([2, 5], (2, 3)))
    with pytest.raises(ValueError, match="on meta but the input is on cpu"):
        op(x, ops.GroupSplits(good.to("meta"), (2, 3)))


def test_linear_rejects_wrong_shape_and_dtype():
    op = ops.BasicLinear(4, 3)
    with pytest.raises(ValueError, match="last dim 4"):
        op(torch.randn(2, 5))
    with pytest.raises(TypeError, match="does not match weight dtype"):
        op(torch.randn(2, 4, dtype=torch.bfloat16))


def test_import_is_light():
    """`import te_dist.ops` must not pull in the kernels (GPU probing) or quantization modules."""
    import subprocess
    import sys

    code = "import sys, te_dist.ops; print(sorted(m for m in ('te_dist.kernels', 'te_dist.quantization') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
