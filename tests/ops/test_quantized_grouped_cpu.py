"""The quantized grouped path on CPU: routing by the support predicates, operand layouts, the
weight's FP8 copy, expert-row padding, and the quantized GEMM entry points (emulated backend).

The CUDA kernels themselves are tested on the H200 (tests/kernels/test_fp8_grouped_gpu.py); here
everything around them runs, with the emulated backend standing in for the kernel: it multiplies
the same quantized values the kernel reads.
"""

import itertools
import math

import pytest
import torch

import te_dist as td
from te_dist import kernels as K
from te_dist import recipe as R
from te_dist import support as S
from te_dist.moe.padding import pad_expert_rows, padded_sizes
from te_dist.ops import GroupedLinear, OperationFuser, ScaledSwiGLU
from te_dist.ops.basic import grouped_linear as gl
from te_dist.quantization import make_quantizer

RECIPES = [R.Float8BlockScaling(), R.Float8CurrentScaling(), R.DelayedScaling()]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def test_host_split_alignment():
    f = gl.host_split_alignment
    assert f(None) is None
    assert f((0, 0)) is None
    assert f((128, 256, 0)) == 128
    assert f((512, 1024)) == 128  # capped: a few predicate cache entries whatever the sizes
    assert f((48, 16)) == 16
    assert f((3, 6)) == 1


def test_padding_round_trip_and_gradients():
    torch.manual_seed(0)
    sizes = (3, 0, 130, 128)
    x = torch.randn(sum(sizes), 8, requires_grad=True)
    probs = torch.rand(sum(sizes))
    padded = pad_expert_rows(x, probs, sizes, 128)
    assert padded.splits.sizes == padded_sizes(sizes, 128) == (128, 0, 256, 128)
    assert padded.splits.offsets.tolist() == [128, 128, 384, 512]
    assert padded.x_PH.shape == (512, 8)
    # each expert's rows start its padded group, the rest is zeros (and zero probability)
    assert torch.equal(padded.x_PH[0:3], x[0:3].detach()) and padded.x_PH[3:128].abs().sum() == 0
    assert torch.equal(padded.x_PH[128:258], x[3:133].detach()) and padded.probs_P[258:384].abs().sum() == 0
    y = padded.unpad(padded.x_PH * 2.0)
    assert torch.equal(y, x.detach() * 2.0)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    # already aligned: no copy, no map
    same = pad_expert_rows(x, None, (128, 0), 128) if x.shape[0] == 128 else pad_expert_rows(x[:256], None, (128, 128), 128)
    assert same.row_map_N is None
    with pytest.raises(ValueError, match="sum to"):
        pad_expert_rows(x, probs, (1, 2), 128)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        pad_expert_rows(x[:2], None, (3, -1), 128)


@pytest.mark.parametrize("total_rows", [False, True], ids=["groups", "groups+total"])
@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_padding_plan_places_every_row_as_a_per_expert_walk_does(alignment, total_rows):
    """The plan's maps (built with whole-tensor ops) against a plain walk over the experts, on many
    expert counts with empty and already aligned experts; with pad_expert_total_rows the last expert
    also takes the zero rows that bring the total to a multiple of 128."""
    from te_dist import settings
    from te_dist.moe.padding import TOTAL_ROWS, needs_padding, plan_padding

    gen = torch.Generator().manual_seed(alignment)
    total = TOTAL_ROWS if total_rows else alignment
    for num_experts in (0, 1, 3, 64, 128):
        sizes = tuple(int(v) for v in torch.randint(0, 3, (num_experts,), generator=gen) * 67
                      + torch.randint(0, 2, (num_experts,), generator=gen) * 128)
        with settings.override(pad_expert_total_rows=total_rows):
            plan = plan_padding(sizes, alignment, "cpu")
            needed = needs_padding(sizes, alignment)
        row_map, pad_rows, start, pstart = [], [], 0, 0
        for e, s in enumerate(sizes):
            p = -(-s // alignment) * alignment
            if e == len(sizes) - 1:  # the last expert rounds the total up
                p += -(pstart + p) % total
            row_map += range(pstart, pstart + s)
            pad_rows += range(pstart + s, pstart + p)
            start, pstart = start + s, pstart + p
        assert sum(plan.splits.sizes) % total == 0 and all(p % alignment == 0 for p in plan.splits.sizes)
        assert plan.splits.sizes == padded_sizes(sizes, alignment, total)
        assert plan.splits.offsets.tolist() == list(itertools.accumulate(plan.splits.sizes))
        assert needed == any(s % alignment for s in sizes)  # the total alone never asks for padding
        if plan.row_map_N is None:
            assert plan.splits.sizes == sizes
            continue
        assert plan.row_map_N.tolist() == row_map and plan.pad_rows.tolist() == pad_rows
        src = plan.src_P.tolist()
        assert all(src[row_map[i]] == i for i in range(len(row_map)))  # each row read back from its slot


def test_padding_the_total_rows_keeps_the_layer_and_its_gradients():
    """pad_expert_total_rows on: the padded rows round trip (extra rows zero, zero probability) and the
    gradients are those of the unpadded rows; groups aligned already need no padding for their total alone
    (a caller pads them anyway here)."""
    from te_dist import settings
    from te_dist.moe.padding import needs_padding

    torch.manual_seed(0)
    sizes = (16, 0, 48)  # groups aligned to 16, total 64
    x = torch.randn(sum(sizes), 8, requires_grad=True)
    probs = torch.rand(sum(sizes))
    with settings.override(pad_expert_total_rows=True):
        assert not needs_padding(sizes, 16) and needs_padding((8, 56), 16)
        padded = pad_expert_rows(x, probs, sizes, 16)
    assert padded.splits.sizes == (16, 0, 112) and padded.x_PH.shape == (128, 8)
    assert torch.equal(padded.x_PH[:64], x.detach()) and not padded.x_PH[64:].any() and not padded.probs_P[64:].any()
    y = padded.unpad(padded.x_PH * 3.0)
    assert torch.equal(y, x.detach() * 3.0)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_padding_queued_from_device_counts_for_more_rows_is_the_plan_of_the_host_sizes():
    """A dispatcher queues the maps from the counts on the device for an upper bound of the rows
    (before its host read), then cuts them to the sizes the read brings: the same plan as from the
    host sizes. More rows than the bound is an error, not a short map."""
    from te_dist.moe.padding import plan_padding, queue_padding_plan

    from te_dist import settings

    sizes = (67, 0, 128, 3, 200)
    for alignment, total_rows in ((8, False), (128, False), (16, True)):
        with settings.override(pad_expert_total_rows=total_rows):
            queued = queue_padding_plan(torch.tensor(sizes), alignment, sum(sizes) + 250)
            got, want = queued.sized(sizes), plan_padding(sizes, alignment, "cpu")
        total = 128 if total_rows else alignment
        assert got.splits.sizes == want.splits.sizes == padded_sizes(sizes, alignment, total)
        assert got.splits.offsets.tolist() == want.splits.offsets.tolist()
        for name in ("row_map_N", "pad_rows", "src_P"):
            assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    with pytest.raises(ValueError, match="more than the 10"):
        queue_padding_plan(torch.tensor(sizes), 8, 10).sized(sizes)
    with pytest.raises(ValueError, match="int64 vector"):
        queue_padding_plan(torch.tensor(sizes, dtype=torch.int32), 8, 400)
    with settings.override(pad_expert_total_rows=False):
        aligned = queue_padding_plan(torch.tensor((16, 32)), 16, 48).sized((16, 32))
    assert aligned.row_map_N is None and aligned.splits.sizes == (16, 32)
    with settings.override(pad_expert_total_rows=True):  # aligned groups, the total off 128: padded
        assert queue_padding_plan(torch.tensor((16, 32)), 16, 48).sized((16, 32)).splits.sizes == (16, 112)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_entry_points_emulated_equal_dequantized_reference(recipe):
    torch.manual_seed(0)
    E, Kin, N, sizes = 3, 256, 384, [128, 0, 256]
    T = sum(sizes)
    x, dy = torch.randn(T, Kin, dtype=torch.bfloat16), torch.randn(T, N, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kin, dtype=torch.bfloat16) / math.sqrt(Kin)
    qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
    xq, dyq = qi(x, rowwise=True, columnwise=True), qg(dy, rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(qw(w, rowwise=True, columnwise=True))
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    assert K.select_quantized_backend(x.device, Kin, N) == "emulated"

    def dq(q, usage):
        return q.dequantize(torch.float32, usage=usage) if hasattr(q, "rowwise") else q.dequantize(torch.float32)

    y = K.grouped_mm_quantized_forward(xq, wq, offs, out_dtype=torch.float32)
    dx = K.grouped_mm_quantized_dgrad(dyq, wq, offs, out_dtype=torch.float32)
    dw = K.grouped_mm_quantized_wgrad(xq, dyq, offs, num_groups=E, out_dtype=torch.float32)
    bounds = [(0, 128), (128, 128), (128, 384)]
    xr, wr, dyr = dq(xq, "rowwise"), dq(wq.source, "rowwise"), dq(dyq, "rowwise")
    xc, dyc = dq(xq, "columnwise"), dq(dyq, "columnwise")
    assert _rel(y, torch.cat([xr[s:e] @ wr[i].t() for i, (s, e) in enumerate(bounds)])) < 1e-5
    assert _rel(dx, torch.cat([dyr[s:e] @ wr[i] for i, (s, e) in enumerate(bounds)])) < 1e-5
    assert _rel(dw, torch.stack([dyc[s:e].t() @ xc[s:e] for s, e in bounds])) < 1e-5
    assert dw[1].abs().max() == 0  # the empty expert
    # the operand layouts the kernels read
    assert wq.fwd_data.shape == (E, N, Kin) and wq.fwd_scale.shape == (E, Kin // 128, N // 128)
    assert wq.dgrad_data.shape == (E, Kin, N) and wq.dgrad_scale.shape == (E, N // 128, Kin // 128)


def test_entry_point_errors_name_what_was_expected():
    rec = R.Float8BlockScaling()
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    xq = make_quantizer(rec, "input")(x)
    wq = K.prepare_quantized_weight(make_quantizer(rec, "weight")(w, rowwise=True, columnwise=True))
    offs = torch.tensor([64, 128], dtype=torch.int32)
    with pytest.raises(TypeError, match="quantized tensor"):
        K.grouped_mm_quantized_forward(x, wq, offs)
    with pytest.raises(TypeError, match="int32"):
        K.grouped_mm_quantized_forward(xq, wq, offs.long())
    with pytest.raises(ValueError, match="K=256"):
        K.grouped_mm_quantized_forward(make_quantizer(rec, "input")(torch.randn(128, 128)), wq, offs)
    with pytest.raises(ValueError, match="backend='cutlass' cannot run"):
        K.grouped_mm_quantized_forward(xq, wq, offs, backend="cutlass")  # CPU tensors
    with pytest.raises(ValueError, match="columnwise copy missing"):
        K.grouped_mm_quantized_wgrad(xq, xq, offs, num_groups=2)  # rowwise-only operands
    with pytest.raises(ValueError, match="multiples of 128"):  # per-tensor: 16-byte FP8 rows at least
        K.prepare_quantized_weight(make_quantizer(R.Float8CurrentScaling(), "weight")(torch.randn(2, 96, 120)))
    assert K.prepare_quantized_weight(make_quantizer(R.Float8CurrentScaling(), "weight")(torch.randn(2, 96, 128))
                                      ).shape == (2, 96, 128)  # off the 128 grid, tensor-scaled: accepted


class _Spy:
    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, recipe, dtype, *, split_alignment=None, device=None):
        self.calls.append((type(recipe).__name__, dtype, split_alignment, device))
        return self.answer


def _mlp(E=3, H=256, F=128, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return OperationFuser([GroupedLinear(E, H, 2 * F, dtype=dtype), ScaledSwiGLU(), GroupedLinear(E, F, H, dtype=dtype)])


def test_each_forward_asks_the_predicate_once_with_the_tensor_device(monkeypatch):
    """Fused grouped MLP: the op-fuser predicate, once per forward; a lone GroupedLinear: the module one."""
    fuser_spy, module_spy = _Spy(False), _Spy(False)
    monkeypatch.setattr(S, "is_op_fuser_grouped_tensor_supported", fuser_spy)
    monkeypatch.setattr(S, "is_module_grouped_tensor_supported", module_spy)
    mlp = _mlp()
    sizes = (128, 0, 256)
    x = torch.randn(384, 256, dtype=torch.bfloat16)
    with td.autocast(recipe=R.Float8BlockScaling()):
        mlp(x, torch.tensor(sizes), torch.rand(384), torch.tensor(sizes))
        assert fuser_spy.calls == [("Float8BlockScaling", torch.bfloat16, 128, x.device)]
        assert module_spy.calls == []
        lone = GroupedLinear(3, 256, 128, dtype=torch.bfloat16)
        OperationFuser([lone])(x, torch.tensor((1, 2, 381)))
    assert module_spy.calls == [("Float8BlockScaling", torch.bfloat16, 1, x.device)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_native_path_plumbing_on_cpu(monkeypatch, recipe):
    """The native branch (forced here: on a GPU the predicate decides) against the emulated branch:
    same forward values and input gradient; the weight gradient reads the columnwise copies."""
    sizes = (128, 0, 256)
    x = torch.randn(384, 256, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(384)

    def run(native):
        monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: native)
        mlp = _mlp()
        x.grad = None
        with td.autocast(recipe=recipe):
            y = mlp(x, torch.tensor(sizes), probs, torch.tensor(sizes))
        y.float().square().sum().backward()
        return y.detach(), x.grad.clone(), mlp.basic_ops[0].weight.grad.clone(), mlp

    y_emu, dx_emu, dw_emu, _ = run(False)
    y_nat, dx_nat, dw_nat, mlp = run(True)
    assert mlp.basic_ops[0].has_native_weight_copy and mlp.basic_ops[2].has_native_weight_copy
    # DelayedScaling: the native path records the weight's amax before its one cast per weight version,
    # the emulated path's first cast uses the initial scale 1, so only there the first step differs more.
    tol = 0.15 if isinstance(recipe, R.DelayedScaling) else 1e-2
    assert _rel(y_nat, y_emu) < tol
    assert _rel(dx_nat, dx_emu) < max(tol, 5e-2)
    assert _rel(dw_nat, dw_emu) < max(tol, 0.1)


def test_per_tensor_transposed_copy_serves_wgrad_alone():
    """A per-tensor FP8 tensor whose cast wrote the transposed data: the wgrad copy keeps only that
    (the rowwise data served fprop and is freed), with x's shape, the same values, and the wgrad
    operand is that data as it is (no transpose)."""
    from te_dist.gemm.fp8_operands import columnwise_operand, copy_format, rowwise_operand
    from te_dist.quantization.tensors import Float8Tensor

    x = torch.randn(64, 256)
    q = make_quantizer(R.Float8CurrentScaling(), "input")(x)
    full = Float8Tensor(q.data, q.scale_inv, q.fmt, q.dtype, data_t=q.data.t().contiguous())
    wgrad = full.wgrad_copy()
    assert wgrad.data is None and wgrad.data_t is full.data_t and wgrad.shape == x.shape
    assert torch.equal(wgrad.dequantize(torch.float32), q.dequantize(torch.float32))
    data_t, scales = columnwise_operand(wgrad)
    assert data_t is full.data_t and scales.shape == (64 // 128 + 1, 256)
    assert copy_format(wgrad, "columnwise") == "e4m3"
    with pytest.raises(ValueError, match="rowwise copy missing"):
        rowwise_operand(wgrad)
    assert q.wgrad_copy() is q  # without transposed data the one copy serves both
    with pytest.raises(ValueError, match="needs its data"):
        Float8Tensor(None, q.scale_inv, q.fmt, q.dtype)


def test_split_alignment_is_remembered_exactly():
    """host_split_alignment's memo: a tuple asked again is answered from the memo, and the padding's
    remembered answer (from the OR of its sizes) equals the gcd rule."""
    for sizes in [(128, 0, 384, 256), (48, 16, 0), (0, 0), (512, 1024), (96, 160)]:
        t = tuple(sizes)
        expected = gl.host_split_alignment(list(sizes))  # a list is never memoised: the rule itself
        bits = 0
        for s in t:
            bits |= s
        gl.remember_split_alignment(t, bits)
        assert gl.host_split_alignment(t) == expected
    x = torch.randn(5, 8)
    padded = pad_expert_rows(x, None, (3, 0, 2), 16)
    assert gl.host_split_alignment(padded.splits.sizes) == 16


@pytest.fixture
def fake_fp8_library(monkeypatch):
    """cutlass_kernels' FP8 loader stood in for: each launch appends what reached it to the list returned."""
    from te_dist.gemm import cutlass_backend as cb

    calls = []

    class FakeLib:
        def workspace_bytes(self, groups, sms):
            return 256

        def run(self, a, b, d, sfa, sfb, scratch, offsets, groups, n, k, rows, *rest):
            calls[-1].update(d=d, sfa=sfa, sfb=sfb, scratch=scratch, n=n, k=k, rows=rows)
            return 0

    rule = {}  # what the last launch told the tile rule

    class FakeFp8Block:
        FP8_CONFIGS = dict.fromkeys(range(5))

        @staticmethod
        def choose_fp8_config(direction, rows, groups, sizes=None, *, forced=None, tensor_scales=False, fast=False,
                              contraction=0, columns=0):
            rule.update(direction=direction, tensor_scales=tensor_scales, fast=fast, contraction=contraction,
                        columns=columns)
            return 0 if forced is None else forced

        @staticmethod
        def load_fp8(direction, config, a_format, b_format, out_f32, tensor_scales, accumulate=False):
            calls.append(dict(direction=direction, config=config, formats=(a_format, b_format),
                              tensor_scales=tensor_scales, accumulate=accumulate, rule=dict(rule)))
            return FakeLib()

    class FakeKernels:
        fp8_block = FakeFp8Block

    monkeypatch.setattr(cb, "kernels_module", lambda: FakeKernels)
    monkeypatch.setattr(cb, "_sm_count", lambda index: 132)
    monkeypatch.setattr(cb, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return calls


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_kernel_launch_takes_the_recipes_scales_as_they_are(fake_fp8_library, recipe):
    """What reaches the kernel library per GEMM (a fake library records it): per-tensor recipes
    launch the tensor-scaled instances with each operand's one scale (no scale tables, no scratch);
    block scaling launches the block-scaled ones with its [T, K/128] / weight-block tables."""
    from te_dist.gemm import cutlass_backend as cb

    calls = fake_fp8_library
    E, Kin, N, sizes = 2, 256, 384, (128, 256)
    qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
    xq = qi(torch.randn(sum(sizes), Kin), rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(qw(torch.randn(E, N, Kin), rowwise=True, columnwise=True))
    dyq = qg(torch.randn(sum(sizes), N), rowwise=True, columnwise=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    cb.fp8_forward(xq, wq, offs)
    cb.fp8_dgrad(dyq, wq, offs)
    cb.fp8_wgrad(xq, dyq, offs, num_groups=E)
    per_tensor = not isinstance(recipe, R.Float8BlockScaling)
    assert [c["direction"] for c in calls] == ["fwd", "dgrad", "wgrad"]
    assert all(c["tensor_scales"] == per_tensor for c in calls)
    if per_tensor:  # the quantizers' own scale tensors: nothing was expanded or copied
        x_s, w_s, dy_s = xq.scale_inv.data_ptr(), wq.source.scale_inv.data_ptr(), dyq.scale_inv.data_ptr()
        assert [(c["sfa"], c["sfb"]) for c in calls] == [(x_s, w_s), (dy_s, w_s), (dy_s, x_s)]
        assert all(c["scratch"] is None for c in calls)
    else:
        assert all(c["sfa"] not in (None, 0) and c["sfb"] not in (None, 0) for c in calls)
        assert calls[0]["scratch"] is not None and calls[2]["scratch"] is None
        # one row of K 128: a block-scale table of one element is still a block-scaled call
        one = qi(torch.randn(1, 128), rowwise=True, columnwise=False)
        w1 = K.prepare_quantized_weight(qw(torch.randn(1, 128, 128), rowwise=True, columnwise=True))
        cb.fp8_forward(one, w1, torch.tensor([1], dtype=torch.int32))
        assert calls[-1]["direction"] == "fwd" and calls[-1]["tensor_scales"] is False


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("in_epilogue", [False, True])
def test_an_accumulating_wgrad_launches_into_the_gradient_given(fake_fp8_library, monkeypatch, recipe, in_epilogue):
    """accumulate_into on the kernels' path: with te_dist.settings.fp8_wgrad_accumulation on, the accumulating
    instance writes into the gradient itself (its pointer is the launch's output); off, the plain instance writes a
    new buffer and the add follows. Either way the gradient given is what comes back."""
    from te_dist import settings, support
    from te_dist.gemm import decide

    monkeypatch.setattr(decide, "choose_quantized", lambda *a, **k: "cutlass")
    monkeypatch.setattr(support, "fp8_kernels_available", lambda *a: True)
    calls = fake_fp8_library
    E, Kin, N, sizes = 2, 256, 384, (128, 256)
    xq = make_quantizer(recipe, "input")(torch.randn(sum(sizes), Kin), rowwise=True, columnwise=True)
    dyq = make_quantizer(recipe, "grad_output")(torch.randn(sum(sizes), N), rowwise=True, columnwise=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    grad = torch.zeros(E, N, Kin, dtype=torch.bfloat16)
    with settings.override(fp8_wgrad_accumulation=in_epilogue):
        out = K.grouped_mm_quantized_wgrad(xq, dyq, offs, num_groups=E, accumulate_into=grad)
    assert out is grad and len(calls) == 1
    assert calls[0]["direction"] == "wgrad" and calls[0]["accumulate"] is in_epilogue
    assert (calls[0]["d"] == grad.data_ptr()) is in_epilogue
    assert calls[0]["tensor_scales"] is not isinstance(recipe, R.Float8BlockScaling)


def test_the_fp8_tile_setting_reaches_every_launch(fake_fp8_library):
    """te_dist.settings.fp8_tile forces the tile of every FP8 launch; a tile that does not exist is
    refused before any launch, naming the setting."""
    from te_dist import settings
    from te_dist.gemm import cutlass_backend as cb

    recipe = R.Float8CurrentScaling()
    xq = make_quantizer(recipe, "input")(torch.randn(256, 128), rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(make_quantizer(recipe, "weight")(torch.randn(2, 128, 128), rowwise=True,
                                                                      columnwise=True))
    offs = torch.tensor([128, 256], dtype=torch.int32)
    cb.fp8_forward(xq, wq, offs)
    with settings.override(fp8_tile=3):
        cb.fp8_forward(xq, wq, offs)
        with pytest.raises(ValueError, match=r"te_dist.settings.fp8_tile=17 names no FP8 tile "
                                             r"\(set by te_dist.settings.fp8_tile=17\); the tiles are \[0, 1, 2, 3, 4\]"):
            with settings.override(fp8_tile=17):
                cb.fp8_forward(xq, wq, offs)
    cb.fp8_forward(xq, wq, offs)
    assert [c["config"] for c in fake_fp8_library] == [0, 3, 0]


def test_the_fp8_wgrad_tile_setting_reaches_the_wgrad_launches_alone(fake_fp8_library):
    """te_dist.settings.fp8_wgrad_tile forces the tile of the wgrad launches (the others keep the rule's); fp8_tile,
    where set, wins; a tile that does not exist is refused before any launch, naming the setting."""
    from te_dist import settings
    from te_dist.gemm import cutlass_backend as cb

    recipe = R.Float8CurrentScaling()
    xq = make_quantizer(recipe, "input")(torch.randn(256, 128), rowwise=True, columnwise=True)
    dyq = make_quantizer(recipe, "grad_output")(torch.randn(256, 128), rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(make_quantizer(recipe, "weight")(torch.randn(2, 128, 128), rowwise=True,
                                                                      columnwise=True))
    offs = torch.tensor([128, 256], dtype=torch.int32)
    with settings.override(fp8_wgrad_tile=2):
        cb.fp8_forward(xq, wq, offs)
        cb.fp8_wgrad(xq, dyq, offs, 2)
        with settings.override(fp8_tile=3):
            cb.fp8_wgrad(xq, dyq, offs, 2)
        with pytest.raises(ValueError, match=r"te_dist.settings.fp8_wgrad_tile=17 names no FP8 tile"):
            with settings.override(fp8_wgrad_tile=17):
                cb.fp8_wgrad(xq, dyq, offs, 2)
    cb.fp8_wgrad(xq, dyq, offs, 2)
    assert [(c["direction"], c["config"]) for c in fake_fp8_library] == [("fwd", 0), ("wgrad", 2), ("wgrad", 3),
                                                                         ("wgrad", 0)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_the_tile_rule_hears_the_scaling_the_contraction_and_the_fast_switch(fake_fp8_library, recipe):
    """What each launch tells the tile rule: its scaling, the fwd contraction (K), the output columns (fwd N,
    dgrad K) and settings.fp8_fprop_fast_accum as it stands."""
    from te_dist import settings
    from te_dist.gemm import cutlass_backend as cb

    qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
    xq = qi(torch.randn(256, 384), rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(qw(torch.randn(2, 128, 384), rowwise=True, columnwise=True))
    dyq = qg(torch.randn(256, 128), rowwise=True, columnwise=True)
    offs = torch.tensor([128, 256], dtype=torch.int32)
    for fast in (False, True):
        with settings.override(fp8_fprop_fast_accum=fast):
            cb.fp8_forward(xq, wq, offs)
            cb.fp8_dgrad(dyq, wq, offs)
            cb.fp8_wgrad(xq, dyq, offs, num_groups=2)
    per_tensor = not isinstance(recipe, R.Float8BlockScaling)
    rules = [c["rule"] for c in fake_fp8_library]
    assert [(r["direction"], r["fast"]) for r in rules] == [(d, f) for f in (False, True) for d in ("fwd", "dgrad", "wgrad")]
    assert all(r["tensor_scales"] == per_tensor for r in rules)
    assert rules[0]["contraction"] == 384
    assert (rules[0]["columns"], rules[1]["columns"]) == (128, 384)


def test_mixed_scalings_broadcast_the_per_tensor_scale():
    """A per-tensor operand beside a block-scaled one: only then its scale becomes a table."""
    from te_dist.gemm.fp8_operands import rowwise_operand, tensor_scales

    xq = make_quantizer(R.Float8CurrentScaling(), "input")(torch.randn(256, 256), rowwise=True, columnwise=True)
    wblock = K.prepare_quantized_weight(make_quantizer(R.Float8BlockScaling(), "weight")(
        torch.randn(2, 128, 256), rowwise=True, columnwise=True))
    wtensor = K.prepare_quantized_weight(make_quantizer(R.Float8CurrentScaling(), "weight")(
        torch.randn(2, 128, 256), rowwise=True, columnwise=True))
    assert tensor_scales(xq, wtensor) and not tensor_scales(xq, wblock)
    data, one = rowwise_operand(xq, scale_tables=False)
    assert one is xq.scale_inv and data is xq.data
    _, table = rowwise_operand(xq)
    assert table.shape == (256, 2) and torch.equal(table, xq.scale_inv.expand(256, 2))


def test_block_wgrad_operand_takes_the_scales_the_cast_laid_out():
    """A 1x128 columnwise copy that carries its scales M-major (``scale_inv_t``, written by the fused
    cast) is the wgrad operand as it is; without it the same layout is built: [R/128 + 1, C], the
    scales transposed, a zero last row."""
    from te_dist.gemm.fp8_operands import columnwise_operand
    from te_dist.quantization.tensors import BlockScaledData

    x = torch.randn(384, 256)
    q = make_quantizer(R.Float8BlockScaling(), "input")(x, rowwise=False, columnwise=True)
    data, built = columnwise_operand(q)
    assert data is q.columnwise.data and built.shape == (384 // 128 + 1, 256)
    assert torch.equal(built[:-1], q.columnwise.scale_inv.t()) and not built[-1].any()
    laid_out = built.clone()
    col = q.columnwise
    q.columnwise = BlockScaledData(col.data, laid_out[:-1].t(), col.block_rows, col.block_cols, transposed=True,
                                   scale_inv_t=laid_out)
    data2, scales2 = columnwise_operand(q)
    assert data2 is col.data and scales2 is laid_out
    assert torch.equal(q.dequantize(torch.float32, usage="columnwise"), q.dequantize(torch.float32))
