"""te_dist.optim.AdamWWithFP8Copies: the weight copy written with the update is the cast the next forward would
make, and a forward takes it only under WeightCopy's rule.

Always (CI): the offer's rule in WeightCopy, which ops say yes, and the optimizer without its kernels (CPU, no
Triton) is torch's AdamW bit for bit. The kernel cases run in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1`` with triton installed, else skipped: CI has no Triton; conversions routed through torch,
tests/triton_interpreter.py) and on a GPU (``-m gpu``), where the forward takes the native path.
"""

from __future__ import annotations

import copy

import pytest
import torch

import te_dist as td
from te_dist import kernels as K
from te_dist import recipe as R
from te_dist import settings
from te_dist.ops import GroupedLinear, OperationFuser
from te_dist.ops.basic.weight_copy import WeightCopy
from te_dist.optim import AdamWWithFP8Copies
from te_dist.quantization.cast import (cast_fp8_blocks, cast_fp8_per_tensor, current_scaling_quantize,
                                      delayed_scale_update)
from triton_interpreter import needs_interpreter, patch_interpreter_conversions

SIZES = (128, 0, 128)
OFF_GRID = (208, 80)  # in and out features off the 128 grid (multiples of 16: per-tensor scales run unpadded)
RECIPES = [pytest.param(R.DelayedScaling(), id="delayed"), pytest.param(R.Float8BlockScaling(), id="block"),
           pytest.param(R.Float8CurrentScaling(), id="current")]  # current: under fp8_optimizer_copies_current


def _op(device, seed=0, features=(256, 128)):
    torch.manual_seed(seed)
    return GroupedLinear(3, *features, dtype=torch.bfloat16, device=device)


def _x(device, seed=1, in_features=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(SIZES), in_features, dtype=torch.bfloat16, generator=g).to(device)


def _train_forward(op, x, recipe):
    with td.autocast(recipe=recipe):
        y = OperationFuser([op])(x, torch.tensor(SIZES))
    y.float().square().mean().backward()
    return y


def _torch_step():
    """A torch optimizer step somewhere in the process (what the global step hook counts)."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    torch.optim.SGD([p], lr=0.1).step()


@pytest.mark.parametrize("case", ["taken", "none", "version", "another_step", "settings"])
def test_an_offered_copy_goes_to_the_next_driven_forward_under_its_key(case):
    copies, w = WeightCopy(), torch.zeros(4, 4)
    copies.offer(w, "recipe", "offered")
    _torch_step()  # the step that offered it ends (the hook counts it)
    flag, key = (None if case == "none" else True), ("other" if case == "settings" else "recipe")
    if case == "version":
        w.add_(1)  # an in-place write autograd sees
    if case == "another_step":
        _torch_step()
    got = copies.get(w, key, lambda: "cast", flag)
    assert got == ("offered" if case == "taken" else "cast")
    assert copies.offers_taken == (case == "taken") and copies.casts == (case != "taken")
    assert copies.get(w, key, lambda: "cast", False) == ("cast" if case == "none" else got)  # kept, or cast anew


def test_only_a_driven_op_on_the_native_path_under_a_copy_recipe_asks_for_the_copy(monkeypatch):
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)
    x = _x("cpu")
    for recipe, flag, current, wanted in ((R.DelayedScaling(), True, False, True),
                                          (R.DelayedScaling(), None, False, False),
                                          (R.Float8CurrentScaling(), True, False, False),
                                          (R.Float8CurrentScaling(), True, True, True),
                                          (R.Float8BlockScaling(), True, False, True)):
        op = _op("cpu")
        op.is_first_microbatch = flag
        _train_forward(op, x, recipe)
        with settings.override(fp8_optimizer_copies_current=current):
            q = op.optimizer_copy_quantizer()
        assert (q is op._quantizers.weight) if wanted else q is None, (recipe, flag, current)
    for padded in (False, True):  # off the 128 grid: block's padded copy under its switch; delayed's unpadded one
        for recipe, wanted in ((R.Float8BlockScaling(), padded), (R.DelayedScaling(), True)):
            op = _op("cpu", features=OFF_GRID)
            op.is_first_microbatch = True
            _train_forward(op, _x("cpu", in_features=OFF_GRID[0]), recipe)
            with settings.override(fp8_optimizer_copies_padded=padded):
                q = op.optimizer_copy_quantizer()
            assert (q is op._quantizers.weight) if wanted else q is None, (recipe, padded)


def _steps_against_adamw(device, recipe, steps: int):
    """An op trained by AdamWWithFP8Copies and its twin by torch's AdamW, every step's forward driven (True); no
    copy may be offered, so each forward casts. Returns (ours, theirs)."""
    ours, theirs = _op(device), _op(device)
    x = _x(device)
    opts = [AdamWWithFP8Copies(ours.parameters(), lr=1e-2, copies_of=[ours]),
            torch.optim.AdamW(theirs.parameters(), lr=1e-2)]
    for step in range(steps):
        for op, opt in zip((ours, theirs), opts):
            op.is_first_microbatch = True
            _train_forward(op, x, recipe)
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert ours._weight_copy._offered is None and ours._weight_copy.casts == step + 1
    return ours, theirs


def test_without_its_kernels_the_optimizer_is_torch_adamw(monkeypatch):
    """CPU tensors without forced Triton casts: the op asks for its copy, but no kernel writes it, and every
    parameter takes AdamW's own step: the same bits as torch's."""
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)
    with settings.override(fp8_optimizer_copies=True):
        ours, theirs = _steps_against_adamw("cpu", R.DelayedScaling(), 3)
        assert ours.optimizer_copy_quantizer() is not None
    assert torch.equal(ours.weight, theirs.weight)


@pytest.fixture(params=[pytest.param("cpu", marks=needs_interpreter), pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """A device the kernel runs on: Triton's interpreter (conversions through torch, the native path assumed)
    or the GPU (the predicate's answer)."""
    if request.param == "cpu":
        patch_interpreter_conversions(monkeypatch)
        monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)
        with settings.override(fused_casts=True):
            yield torch.device("cpu")
        return
    yield torch.device("cuda")


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_update_writes_the_cast_the_forward_would_make(device, recipe, monkeypatch):
    """Three optimizer steps at one micro-batch each: after each, the offered copy is the cast of the updated weight
    the forward would have made (delayed: with the scale it would have used, the quantizer rolled as that cast rolls
    it; block: both 128x128 copies and their scales), and the next forward takes it (one cast in all: the first's)."""
    prepared = []
    real = K.prepare_quantized_weight
    monkeypatch.setattr(K, "prepare_quantized_weight", lambda q: prepared.append(q) or real(q))
    op, x = _op(device), _x(device)
    opt = AdamWWithFP8Copies(op.parameters(), lr=1e-2, weight_decay=0.1, copies_of=[op])
    with settings.override(fp8_optimizer_copies=True, fp8_optimizer_copies_current=True):
        for step in range(3):
            op.is_first_microbatch = True
            _train_forward(op, x, recipe)
            assert op._weight_copy.casts == 1 and op._weight_copy.offers_taken == step
            q = op._quantizers.weight
            before = (q.scale.clone(), q.amax_history.clone()) if isinstance(recipe, R.DelayedScaling) else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            _check_copy(prepared[-1], op.weight.detach(), q, before, recipe)
    assert op._weight_copy.offers_taken == 2  # the third step's copy waits for a fourth forward


def _check_copy(copy, w, q, before, recipe):
    """``copy`` is q's cast of w, bit for bit (``before``: a delayed quantizer's scale and history at the step)."""
    def same(a, b):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(
            torch.uint8) if b.element_size() == 1 else b)

    if isinstance(recipe, R.Float8CurrentScaling):  # the scale from the updated weight's own amax
        data, scale_inv = current_scaling_quantize(w, q.fp8_dtype, q.fmt_max, q.use_power_2_scales)
        same(copy.data, data)
        same(copy.data_t, data.transpose(1, 2).contiguous())
        same(copy.scale_inv.reshape(()), scale_inv.reshape(()))
        return
    if before is None:  # 128x128 blocks: each copy is the cast of w along its own last dim
        for got, x in ((copy.rowwise, w), (copy.columnwise, w.transpose(1, 2))):
            data, scale_inv = cast_fp8_blocks(x, 128, 128, q.fp8_dtype, q.fmt_max, q.use_power_2_scales)
            same(got.data, data)
            same(got.scale_inv, scale_inv)
        return
    scale, history = before
    expected = cast_fp8_per_tensor(w, scale, q.fp8_dtype, q.fmt_max)
    same(copy.data, expected)
    same(copy.data_t, expected.transpose(1, 2).contiguous())
    same(copy.scale_inv.reshape(()), (1.0 / scale).reshape(()))
    want = delayed_scale_update(w.float().abs().amax(), history, scale, q.fmt_max, q.margin, q.amax_compute_algo)
    for got, ref in zip((q.amax_history, q.scale, q.scale_inv), want):
        same(got.reshape(-1), ref.reshape(-1))


def test_an_off_grid_block_weight_gets_the_padded_cast(device, monkeypatch):
    """Features off the 128 grid under block scaling: the update writes the cast of the weight zero padded to the grid
    (the bytes the forward's pad-then-cast makes: 128x128 blocks of both layouts and their scales), the next forward
    takes it, and its output is the output of a forward that cast the padded weight itself."""
    prepared = []
    real = K.prepare_quantized_weight
    monkeypatch.setattr(K, "prepare_quantized_weight", lambda q: prepared.append(q) or real(q))
    recipe, (k, n) = R.Float8BlockScaling(), OFF_GRID
    op, x = _op(device, features=OFF_GRID), _x(device, in_features=k)
    opt = AdamWWithFP8Copies(op.parameters(), lr=1e-2, copies_of=[op])
    with settings.override(fp8_optimizer_copies=True, fp8_optimizer_copies_padded=True):
        for step in range(2):
            op.is_first_microbatch = True
            _train_forward(op, x, recipe)
            opt.step()
            opt.zero_grad(set_to_none=True)
            w = torch.nn.functional.pad(op.weight.detach(), (0, 128 - k % 128, 0, 128 - n % 128))
            q, copy_ = op._quantizers.weight, prepared[-1]
            assert tuple(copy_.shape) == (3, 128, 256)
            for got, xw in ((copy_.rowwise, w), (copy_.columnwise, w.transpose(1, 2))):
                data, scale_inv = cast_fp8_blocks(xw, 128, 128, q.fp8_dtype, q.fmt_max, q.use_power_2_scales)
                assert torch.equal(got.data.view(torch.uint8), data.view(torch.uint8))
                assert torch.equal(got.scale_inv, scale_inv)
        outputs = []
        for _ in range(2):  # the offered copy, then (no offer left) the forward's own cast of the padded weight
            op.is_first_microbatch = True
            with torch.no_grad(), td.autocast(recipe=recipe):
                outputs.append(OperationFuser([op])(x, torch.tensor(SIZES)))
        assert op._weight_copy.offers_taken == 2 and op._weight_copy.casts == 2
    assert torch.equal(*outputs)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_update_is_adamws(device, recipe):
    """The same gradients into AdamWWithFP8Copies and torch's AdamW: the same weights to within a tenth of a step
    (the kernel computes in float32; torch's CPU loop in the parameter's dtype), also across a step whose forward
    did not drive the protocol (None: no copy kept, so AdamW's own step takes the weight, and the kernel's next step
    counts it)."""
    ours, theirs = _op(device), _op(device)
    x = _x(device)
    opts = [AdamWWithFP8Copies(ours.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, copies_of=[ours]),
            torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)]
    with settings.override(fp8_optimizer_copies=True, fp8_optimizer_copies_current=True):
        for step in range(4):
            ours.is_first_microbatch = None if step == 1 else True
            _train_forward(ours, x, recipe)
            theirs.weight.grad = ours.weight.grad.clone()
            theirs.weight.data.copy_(ours.weight.data)
            for opt in reversed(opts):  # ours last: a torch step after it would void its offer
                opt.step()
            torch.testing.assert_close(ours.weight.float(), theirs.weight.float(), rtol=1.6e-2, atol=1e-3)
            ours.weight.grad = None
    assert ours._weight_copy.offers_taken == 1 and ours._weight_copy.casts == 3  # step 3 took step 2's copy
    assert opts[0].state[ours.weight]["step"].item() == 4


def test_switched_off_the_forward_casts_and_the_optimizer_is_adamw(device):
    """``fp8_optimizer_copies=False``: no copy offered, every step's first forward casts, the update AdamW's own."""
    with settings.override(fp8_optimizer_copies=False):
        ours, theirs = _steps_against_adamw(device, R.Float8BlockScaling(), 2)
    assert torch.equal(ours.weight, theirs.weight)


def test_a_loaded_state_sets_the_step_count(device):
    """After ``load_state_dict`` the kernel's bias correction counts from the loaded step, not the steps taken since."""
    recipe = R.Float8BlockScaling()
    op, x = _op(device), _x(device)
    opt = AdamWWithFP8Copies(op.parameters(), lr=1e-2, copies_of=[op])
    with settings.override(fp8_optimizer_copies=True):
        for step in range(3):
            op.is_first_microbatch = True
            _train_forward(op, x, recipe)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 0:
                saved = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(saved)
        op.is_first_microbatch = True
        _train_forward(op, x, recipe)
        opt.step()
    assert opt.state[op.weight]["step"].item() == 2 and opt._host_steps[id(op.weight)] == 2
