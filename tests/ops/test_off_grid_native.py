"""Expert features off the 128 grid on the native FP8 path (``te_dist.settings.fp8_pad_off_grid``).

On CPU the native branch is forced (on a GPU the predicate decides) and its GEMMs run on the quantized
entry points' emulated backend, which multiplies the same quantized operands the kernels read. The
padded layer is the zero-padded on-grid problem computed by the same functions, so it is compared
with that problem bit for bit; against the emulated (unpadded) path it is compared with a tolerance:
that is other math (the emulated path fake-quantizes every operand along its last dim; the native one
quantizes wgrad operands along the tokens). With the switch off nothing changes: the emulated path.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import te_dist as td
from te_dist import recipe as R
from te_dist import support as S
from te_dist.moe import MoELayer
from te_dist.moe.transports.all_to_all import AllToAllDispatcher
from te_dist.ops import GroupedLinear, OperationFuser, ScaledSwiGLU
from te_dist.ops.basic import grouped_linear
from te_dist.ops.basic.feature_padding import GRID

RECIPES = [R.Float8CurrentScaling, R.DelayedScaling, R.Float8BlockScaling]
SHAPES = {"320to200": (320, 200), "gptoss_like": (360, 360), "n_off_only": (256, 200)}  # gpt-oss 2880 / 8


def _name(recipe_type):
    return recipe_type.__name__


def _sizes(recipe_type):
    """Ragged splits with an empty expert, aligned as the native path needs (block: 128 rows, else 16)."""
    return (128, 0, 256, 128) if recipe_type is R.Float8BlockScaling else (48, 0, 112, 32)


def _up(n):
    return -(-n // GRID) * GRID


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.fixture
def forced_native(monkeypatch):
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)


@pytest.fixture
def pad_on():
    with td.settings.override(fp8_pad_off_grid=True):
        yield


def _layer(E, K_, N, seed=0, bias=True):
    torch.manual_seed(seed)
    op = GroupedLinear(E, K_, N, bias=bias, dtype=torch.bfloat16)
    if bias:
        with torch.no_grad():
            op.bias.normal_()
    return op


def _run(op, x, g, sizes, recipe):
    """Forward and backward of a lone GroupedLinear; (y, dx, dW, db)."""
    x = x.detach().clone().requires_grad_(True)
    with td.autocast(recipe=recipe):
        y = OperationFuser([op])(x, torch.tensor(sizes))
    y.backward(g)
    return y.detach(), x.grad, op.weight.grad, None if op.bias is None else op.bias.grad


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_padded_layer_equals_the_padded_on_grid_problem(forced_native, pad_on, copies, recipe_type, shape):
    """Output, dx, dW and dbias of the off-grid layer == the on-grid layer holding the zero-padded weight
    and bias, given the zero-padded input and output gradient, sliced back: bit for bit (the same
    quantized operands in the same GEMMs). The copy is cast from the padded weight; the gradients have
    the parameters' shapes and are contiguous."""
    K_, N = SHAPES[shape]
    Kp, Np = _up(K_), _up(N)
    sizes, E = _sizes(recipe_type), 4
    op = _layer(E, K_, N)
    ref = GroupedLinear(E, Kp, Np, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(F.pad(op.weight, (0, Kp - K_, 0, Np - N)))
        ref.bias.copy_(F.pad(op.bias, (0, Np - N)))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), K_, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(sum(sizes), N, dtype=torch.bfloat16, generator=g)
    for step in range(2):  # DelayedScaling: the second step casts with the first one's amax
        op.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        y, dx, dw, db = _run(op, x, dy, sizes, recipe_type())
        y_r, dx_r, dw_r, db_r = _run(ref, F.pad(x, (0, Kp - K_)), F.pad(dy, (0, Np - N)), sizes, recipe_type())
        assert y.shape == (sum(sizes), N) and y.is_contiguous()
        assert torch.equal(y, y_r[:, :N]), step
        assert dx.shape == x.shape and torch.equal(dx, dx_r[:, :K_]), step
        assert dw.shape == op.weight.shape and dw.is_contiguous() and torch.equal(dw, dw_r[:, :N, :K_]), step
        assert db.shape == op.bias.shape and torch.equal(db, db_r[:, :N]), step
        assert dw[1].abs().max() == 0  # the empty expert
    assert op.has_native_weight_copy
    assert copies == [(E, Np, Kp)] * 4  # each forward casts (no micro-batch flag): the padded shape


@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_padded_layer_is_close_to_the_emulated_off_grid_layer(monkeypatch, pad_on, recipe_type):
    """The padded native path against the emulated path of the same off-grid layer (its reference):
    other math (wgrad operands quantized along the tokens natively, along the features emulated), so a
    tolerance; power-of-two and per-tensor scales round the same elements alike here. The second
    step is compared (DelayedScaling's emulated first cast uses the initial scale)."""
    sizes = _sizes(recipe_type)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 320, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(sum(sizes), 200, dtype=torch.bfloat16, generator=g)
    results = {}
    for native in (True, False):
        monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, native=native, **k: native)
        op, recipe = _layer(4, 320, 200), recipe_type()
        for _ in range(2):
            op.zero_grad(set_to_none=True)
            results[native] = _run(op, x, dy, sizes, recipe)
        assert op.has_native_weight_copy == native
    for got, want in zip(results[True], results[False]):
        assert _rel(got, want) < 1e-3


@pytest.mark.parametrize("recipe_type", [R.Float8CurrentScaling, R.Float8BlockScaling], ids=_name)
def test_the_padded_copy_follows_the_micro_batch_protocol(forced_native, pad_on, copies, recipe_type):
    """is_first_microbatch True casts the padded copy once; False reuses it (same output as a fresh
    cast); an optimizer step ends the reuse."""
    sizes = _sizes(recipe_type)
    op = _layer(3, 320, 200, bias=False)
    x = torch.randn(sum(sizes[:3]), 320, dtype=torch.bfloat16)
    splits = torch.tensor(sizes[:3])

    def forward(layer):
        with td.autocast(recipe=recipe_type()), torch.no_grad():
            return OperationFuser([layer])(x, splits)

    def fresh():
        twin = GroupedLinear(3, 320, 200, dtype=torch.bfloat16)
        with torch.no_grad():
            twin.weight.copy_(op.weight)
        return forward(twin)

    op.is_first_microbatch = True
    first = forward(op)
    assert op.is_first_microbatch is False
    assert torch.equal(forward(op), first) and torch.equal(forward(op), first)
    assert copies == [(3, 256, 384)]  # one cast for three micro-batches
    assert torch.equal(first, fresh())
    opt = torch.optim.SGD([op.weight], lr=1.0)
    op.weight.grad = torch.randn_like(op.weight)
    opt.step()  # no version bump seen by the copy's key alone: the step count ends the reuse
    after = forward(op)
    assert not torch.equal(after, first) and torch.equal(after, fresh())
    assert copies == [(3, 256, 384)] * 4


def _mlp(E=4, H=360, F_=360, seed=0):
    torch.manual_seed(seed)
    return OperationFuser([GroupedLinear(E, H, 2 * F_, dtype=torch.bfloat16), ScaledSwiGLU(),
                           GroupedLinear(E, F_, H, dtype=torch.bfloat16)])


@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_fused_mlp_off_grid_equals_the_unfused_ops(forced_native, pad_on, copies, recipe_type):
    """A gpt-oss-like expert MLP (H = F = 360: fc1 360 -> 720, fc2 360 -> 360, all off the grid) on the
    padded native path: the fused grouped MLP == the basic ops one by one, bit for bit (output, input,
    probability and weight gradients); fc2's input (the SwiGLU output) is padded to fc2's Kp."""
    sizes = _sizes(recipe_type)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(sum(sizes), 360, dtype=torch.bfloat16, generator=g)
    p0 = torch.rand(sum(sizes), generator=g)
    splits = torch.tensor(sizes)
    results = []
    for fused in (True, False):
        mlp = _mlp()
        x, probs = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        recipe = recipe_type()
        recipe.enable_fused_grouped_mlp = fused
        for _ in range(2):
            x.grad = probs.grad = None
            mlp.zero_grad(set_to_none=True)
            with td.autocast(recipe=recipe):
                y = mlp(x, splits, probs, splits)
            y.float().square().sum().backward()
        assert ("GroupedMLP" in mlp.plan.describe()) == fused
        fc1, fc2 = mlp.basic_ops[0], mlp.basic_ops[2]
        assert fc1.has_native_weight_copy and fc2.has_native_weight_copy
        results.append((y.detach(), x.grad, probs.grad, fc1.weight.grad, fc2.weight.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert set(copies) == {(4, 768, 384), (4, 384, 384)}  # fc1 [E, 2F->768, H->384], fc2 [E, H->384, F->384]


@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_lean_copies_change_no_bit(forced_native, pad_on, recipe_type):
    """settings.fp8_pad_lean_copies (margins zeroed instead of a whole zero fill; the weight gradient
    handed back as a view of the padded one): the padded MLP's output and every gradient, accumulated
    over three micro-batches, equal the F.pad path's bit for bit, and the accumulated weight gradients
    are contiguous tensors of the weights' shapes."""
    from te_dist.ops.basic.feature_padding import zero_padded

    t = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    with td.settings.override(fp8_pad_lean_copies=True):
        assert torch.equal(zero_padded(t, 3, 2), F.pad(t, (0, 3, 0, 2)))
        assert torch.equal(zero_padded(t[0], 11), F.pad(t[0], (0, 11)))
    sizes = _sizes(recipe_type)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(sum(sizes), 360, dtype=torch.bfloat16, generator=g) for _ in range(3)]
    probs = torch.rand(sum(sizes), generator=g)
    splits = torch.tensor(sizes)
    results = []
    for lean in (False, True):
        mlp, recipe, outs = _mlp(), recipe_type(), []
        with td.settings.override(fp8_pad_lean_copies=lean):
            for x0 in xs:  # gradients accumulate: the view is added into .grad in place after the first
                x = x0.clone().requires_grad_(True)
                with td.autocast(recipe=recipe):
                    y = mlp(x, splits, probs, splits)
                y.float().square().sum().backward()
                outs += [y.detach(), x.grad]
        fc1, fc2 = mlp.basic_ops[0], mlp.basic_ops[2]
        assert fc1.has_native_weight_copy and fc2.has_native_weight_copy
        for w in (fc1.weight, fc2.weight):
            assert w.grad.shape == w.shape and w.grad.is_contiguous()
        results.append(outs + [fc1.weight.grad, fc2.weight.grad])
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_unpadded_tensor_scales_take_the_operands_as_they_are(forced_native, pad_on, copies, recipe_type):
    """settings.fp8_unpadded_tensor_scales: an MLP off the grid (H = F = 368, multiples of 16) under a per-tensor
    recipe casts its weight copies unpadded ([E, 2F, H], [E, H, F]) and its output and gradients agree with the padded run's (zeros change no
    per-tensor scale, so the FP8 values are the same; the sums run over fewer zeros); under block scales the
    switch changes nothing (their kernels tile K and N by the 128 scale block)."""
    sizes = _sizes(recipe_type)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(sum(sizes), 368, dtype=torch.bfloat16, generator=g)
    probs = torch.rand(sum(sizes), generator=g)
    splits = torch.tensor(sizes)
    results = {}
    for unpadded in (False, True):
        copies.clear()
        mlp, recipe, x = _mlp(H=368, F_=368), recipe_type(), x0.clone().requires_grad_(True)
        with td.settings.override(fp8_unpadded_tensor_scales=unpadded), td.autocast(recipe=recipe):
            y = mlp(x, splits, probs, splits)
        y.float().square().sum().backward()
        fc1, fc2 = mlp.basic_ops[0], mlp.basic_ops[2]
        assert fc1.has_native_weight_copy and fc2.has_native_weight_copy
        results[unpadded] = [y.detach(), x.grad, fc1.weight.grad, fc2.weight.grad]
        block = recipe_type is R.Float8BlockScaling
        assert set(copies) == ({(4, 768, 384), (4, 384, 384)} if block or not unpadded else
                               {(4, 736, 368), (4, 368, 368)})
    for name, got, want in zip(("y", "dx", "dW1", "dW2"), results[True], results[False]):
        assert got.shape == want.shape, name
        if recipe_type is R.Float8BlockScaling:
            assert torch.equal(got, want), name
        else:
            assert _rel(got, want) < 1e-3, (name, _rel(got, want))


def _expand(T, E, H, alignment):
    """x_TH and the dispatch's GroupSplits whose rows_in is the expand gather (padded to ``alignment``)."""
    g = torch.Generator().manual_seed(3)
    indices = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    probs = torch.rand(T, 2, generator=g)
    x = torch.randn(T, H, dtype=torch.bfloat16, generator=g)
    _, _, probs_N, state = AllToAllDispatcher(E).dispatch(x, probs, indices, probs_in_expert=True,
                                                          row_alignment=alignment, gather_in_experts=True)
    return x, state.group_splits(), probs_N, state


@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_source_rows_off_grid_equal_their_copy(forced_native, pad_on, recipe_type):
    """rows_in / rows_out (te_dist.ops.RowGather) on the padded path: fc1 quantizes the padded source's
    gathered rows, fc2 sums its sliced rows back and quantizes its padded output gradient's gathered
    rows; the same output and gradients as the copied rows, bit for bit."""
    alignment = 128 if recipe_type is R.Float8BlockScaling else 16
    x_src, splits, probs, state = _expand(96, 3, 360, alignment)
    rows = splits.rows_in
    plain = splits._replace(rows_in=None)

    def run(x, fc1_splits, fc2_splits):
        mlp = _mlp(E=3)
        x = x.clone().requires_grad_(True)
        with td.autocast(recipe=recipe_type()):
            y = mlp(x, fc1_splits, probs, fc2_splits)
            if fc2_splits.rows_out is None:  # the copied rows: the dispatcher's combine sums them back
                y = AllToAllDispatcher(3).combine(y, state)
        y.float().square().sum().backward()
        return y.detach(), x.grad, mlp.basic_ops[0].weight.grad, mlp.basic_ops[2].weight.grad

    y_src, dx_src, dw1_src, dw2_src = run(x_src, splits, plain._replace(rows_out=rows))
    y_cp, dx_cp, dw1_cp, dw2_cp = run(rows.take(x_src), plain, plain)
    assert y_src.shape == x_src.shape
    assert torch.equal(y_src, y_cp)
    assert torch.equal(dx_src, rows.sum_back(dx_cp))
    assert torch.equal(dw1_src, dw1_cp) and torch.equal(dw2_src, dw2_cp)


def test_moe_layer_off_grid_takes_the_gather_in_the_experts_alike(monkeypatch, pad_on):
    """MoELayer with gpt-oss-like features on the padded native path (forced; alignment 16): the same
    output and gradients whether the experts take the dispatch's gather or the dispatcher copies."""
    monkeypatch.setattr(MoELayer, "_native_row_alignment", lambda self, x, r: None if r is None else 16)
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)
    results = []
    for gather in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(360, 360, 4, 2, dtype=torch.bfloat16)
        x = torch.randn(64, 360, dtype=torch.bfloat16, requires_grad=True)
        with td.autocast(recipe=R.Float8CurrentScaling()), td.settings.override(gather_in_experts=gather):
            y = layer(x)
        y.float().square().sum().backward()
        assert layer.fc1.has_native_weight_copy and layer.fc2.has_native_weight_copy
        results.append((y.detach(), x.grad, layer.fc1.weight.grad, layer.fc2.weight.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)


class _Spy:
    def __init__(self):
        self.calls = 0

    def __call__(self, recipe, dtype, *, split_alignment=None, device=None):
        self.calls += 1
        return True


@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_switch_off_keeps_the_emulated_path(monkeypatch, copies, recipe_type):
    """Off (the default): an off-grid layer never asks the predicates (even one that says yes) and
    runs the emulated path; on: it asks them, as an on-grid layer does. On CPU the answer stays the
    emulated path either way (the native path needs CUDA)."""
    module_spy, fuser_spy = _Spy(), _Spy()
    monkeypatch.setattr(S, "is_module_grouped_tensor_supported", module_spy)
    monkeypatch.setattr(S, "is_op_fuser_grouped_tensor_supported", fuser_spy)
    sizes = _sizes(recipe_type)
    x = torch.randn(sum(sizes), 360, dtype=torch.bfloat16)
    for on, asked in ((False, 0), (True, 1)):
        lone, mlp = _layer(4, 360, 200), _mlp()
        with td.settings.override(fp8_pad_off_grid=on), td.autocast(recipe=recipe_type()):
            assert lone.native_shape_ok == on and mlp.basic_ops[2].native_shape_ok == on
            OperationFuser([lone])(x, torch.tensor(sizes))
            mlp(x, torch.tensor(sizes), torch.rand(sum(sizes)), torch.tensor(sizes))
        assert (module_spy.calls, fuser_spy.calls) == (asked, asked)
        module_spy.calls = fuser_spy.calls = 0
        assert not lone.has_native_weight_copy and copies == []
    with td.settings.override(fp8_pad_off_grid=False):
        assert _layer(4, 384, 256).native_shape_ok  # on the grid: whatever the switch


def test_the_emulated_warning_names_the_switch_and_follows_it():
    """The once-per-reason warning of an emulated FP8 forward (said on GPUs; called directly here):
    off, it names the features and the switch, once; on, the predicates' reason instead."""
    grouped_linear._said_emulated.clear()
    op, x = _layer(2, 320, 200), torch.randn(4, 320, dtype=torch.bfloat16)
    with td.autocast(recipe=R.Float8CurrentScaling()):
        OperationFuser([op])(x, torch.tensor((4, 0)))  # builds the op's recipe state
    said = []
    for on in (False, False, True, True):
        with td.settings.override(fp8_pad_off_grid=on), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            op._say_emulated(x)
        said.append([str(w.message) for w in caught])
    assert len(said[0]) == 1 and "not multiples of 128" in said[0][0] and "fp8_pad_off_grid" in said[0][0]
    assert said[1] == [] and said[3] == []
    assert len(said[2]) == 1 and "not multiples of 128" not in said[2][0] and "cpu" in said[2][0]


# ---------------------------------------------------------------------- GPU (later sessions)

GPU_RECIPES = {"current": R.Float8CurrentScaling, "delayed": R.DelayedScaling, "block": R.Float8BlockScaling}


@pytest.mark.gpu
@pytest.mark.parametrize("name, unpadded", [(n, False) for n in GPU_RECIPES] + [("current", True), ("delayed", True)],
                         ids=lambda v: {True: "unpadded", False: "padded"}.get(v, v) if isinstance(v, bool) else v)
def test_off_grid_layer_native_on_a_gpu_matches_the_emulated_path(cuda_device, copies, name, unpadded):
    """Switch on: an off-grid GroupedLinear (320 -> 200, bias) and a gpt-oss-like MoELayer (360 / 360)
    run the native kernels (the predicate decides), with no emulated-path warning, and their forward
    and backward agree with the emulated path (switch off) of the same layer on the same input. The
    third step is compared (DelayedScaling's scales are set from then on). ``unpadded``: features that
    are multiples of 16 (320 -> 208, 368 / 368) under settings.fp8_unpadded_tensor_scales, the weight
    copies cast as they are."""
    recipe_type = GPU_RECIPES[name]
    n_out, hidden = (208, 368) if unpadded else (200, 360)
    sizes = (256, 0, 384, 128)
    g = torch.Generator(device=cuda_device).manual_seed(1)
    x = torch.randn(sum(sizes), 320, dtype=torch.bfloat16, device=cuda_device, generator=g)
    dy = torch.randn(sum(sizes), n_out, dtype=torch.bfloat16, device=cuda_device, generator=g)
    h = torch.randn(512, hidden, dtype=torch.bfloat16, device=cuda_device, generator=g)
    results = {}
    for on in (True, False):
        torch.manual_seed(0)
        op = GroupedLinear(4, 320, n_out, bias=True, dtype=torch.bfloat16, device=cuda_device)
        layer = MoELayer(hidden, hidden, 8, 2, dtype=torch.bfloat16, device=cuda_device)
        recipe = recipe_type()
        copies.clear()
        with td.settings.override(fp8_pad_off_grid=on, fp8_unpadded_tensor_scales=unpadded), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                op.zero_grad(set_to_none=True)
                layer.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_(True)
                with td.autocast(recipe=recipe):
                    y = OperationFuser([op])(xi, torch.tensor(sizes))
                y.backward(dy)
                hi = h.clone().requires_grad_(True)
                with td.autocast(recipe=recipe):
                    out = layer(hi)
                out.float().square().mean().backward()
        native = [op.has_native_weight_copy, layer.fc1.has_native_weight_copy, layer.fc2.has_native_weight_copy]
        assert native == [on] * 3
        if on:
            assert set(copies) == ({(4, n_out, 320), (8, 2 * hidden, hidden), (8, hidden, hidden)} if unpadded else
                                   {(4, 256, 384), (8, 768, 384), (8, 384, 384)})
        if on:
            assert [str(w.message) for w in caught if "run the emulated path" in str(w.message)] == []
        results[on] = [y.detach(), xi.grad, op.weight.grad, op.bias.grad,
                       out.detach(), hi.grad, layer.fc1.weight.grad, layer.fc2.weight.grad]
    names = ["y", "dx", "dW", "db", "moe out", "moe dx", "moe dW1", "moe dW2"]
    # One GEMM's output and the bias gradient within 2%; the layer's output has passed two GEMMs and, natively,
    # an FP8 copy of the SwiGLU input (the emulated path keeps it in bf16), so it is held to the gradients' bound:
    # 5% where the gradients are E4M3, twice that where the recipe casts them to E5M2 (HYBRID: one mantissa bit
    # fewer, twice the rounding step), as the two paths round different intermediate values.
    grad_bound = 1e-1 if recipe.fp8_format == R.Format.HYBRID else 5e-2
    for label, got, want in zip(names, results[True], results[False]):
        assert torch.isfinite(got).all() and got.shape == want.shape, label
        assert _rel(got, want) < (2e-2 if label in ("y", "db") else grad_bound), label
