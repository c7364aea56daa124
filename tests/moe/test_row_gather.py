"""The experts taking the dispatch's expand gather at EP size 1 (te_dist.ops.RowGather): fc1 reads
its rows from x_TH instead of a copy, and fc2 sums its rows back into token order (the combine).

On the native FP8 path the quantizer makes the gathered rows without their bf16 copy
(Quantizer.gathered: per-tensor recipes quantize x_TH, and the combine's output gradient, and gather
FP8 bytes; 1x128 blocks cast through the index); everywhere else the rows are copied as before. Either way the values and
gradients must be those of the copied rows, bit for bit: the FP8 operand is the same bytes with the
same scale (same amax: every token is gathered). On CPU the native branch is forced (on a GPU the
predicate decides) and its GEMMs run on the emulated backend, which multiplies the same quantized
values the kernels read; the last test runs the real path on the GPU.
"""

import pytest
import torch

import te_dist as td
from te_dist import recipe as R
from te_dist.moe import MoELayer
from te_dist.moe.permutation import expand_rows, expand_tokens, sort_by_expert
from te_dist.moe.transports.all_to_all import AllToAllDispatcher
from te_dist.ops import GroupedLinear, GroupSplits, OperationFuser, RowGather, ScaledSwiGLU
from te_dist.quantization import make_quantizer

PER_TENSOR = [R.Float8CurrentScaling(), R.DelayedScaling()]
RECIPES = [None, R.Float8BlockScaling(), *PER_TENSOR]


def _name(recipe):
    return "bf16" if recipe is None else type(recipe).__name__


def _routing(T=96, E=3, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return indices, torch.rand(T, K, generator=g)


def _padded_dispatch(x, indices, probs, E, alignment, gather_in_experts):
    return AllToAllDispatcher(E).dispatch(x, probs, indices, probs_in_expert=True, row_alignment=alignment,
                                          gather_in_experts=gather_in_experts)


@pytest.mark.parametrize("recipe", PER_TENSOR, ids=_name)
def test_fp8_rows_of_the_source_are_the_quantized_rows(recipe):
    """Quantize, then gather the bytes == gather, then quantize: same data, scale and transposed copy."""
    torch.manual_seed(0)
    x = torch.randn(40, 64, dtype=torch.bfloat16) * 3
    index = torch.randint(0, 40, (72,))
    index[:40] = torch.randperm(40)  # every source row at least once
    zero_rows = torch.tensor([3, 41, 71])
    copy = x.index_select(0, index).index_fill_(0, zero_rows, 0)
    want = make_quantizer(recipe, "input")(copy)
    got = make_quantizer(recipe, "input")(x).take_rows(index, zero_rows, transposed=True)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale_inv, want.scale_inv)
    assert torch.equal(got.data_t.view(torch.uint8), want.data.view(torch.uint8).t())
    assert torch.equal(got.data[zero_rows].view(torch.uint8), torch.zeros(3, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rowwise data of a 2-D tensor"):
        got.wgrad_copy().take_rows(index)


@pytest.mark.parametrize("recipe", [*PER_TENSOR, R.Float8BlockScaling(), R.MXFP8BlockScaling(), R.NVFP4BlockScaling()],
                         ids=_name)
@pytest.mark.parametrize("usage", [(True, False), (True, True), (False, True)], ids=["row", "row+col", "col"])
@pytest.mark.parametrize("covers", [True, False], ids=["covering", "partial"])
def test_quantizer_gathered_equals_quantizing_the_copy(recipe, usage, covers):
    """Quantizer.gathered(source, index, zero_rows) == quantizer(the gathered copy), every copy asked
    for, for every recipe (per-tensor: the bytes gathered when the index covers the source; 1x128 blocks:
    the fused cast through the index where Triton runs; the rest: the copy). A partial gather of a
    per-tensor source takes the copy (its amax is not the source's)."""
    rowwise, columnwise = usage
    torch.manual_seed(0)
    source = torch.randn(96, 256, dtype=torch.bfloat16) * torch.logspace(-2, 2, 96).to(torch.bfloat16)[:, None]
    index = torch.cat([torch.randperm(96), torch.randint(0, 96, (160,))]) if covers else torch.randint(0, 48, (256,))
    zero_rows = torch.tensor([0, 100, 255])
    copy = source.index_select(0, index).index_fill_(0, zero_rows, 0)
    role = "input"
    want = make_quantizer(type(recipe)(), role)(copy, rowwise=rowwise, columnwise=columnwise)
    got = make_quantizer(type(recipe)(), role).gathered(source, index, zero_rows, rowwise=rowwise,
                                                        columnwise=columnwise, covers_source=covers)
    assert got.shape == want.shape == copy.shape and type(got) is type(want)
    usages = [u for u, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]
    for u in usages:
        kw = {} if isinstance(recipe, (R.Float8CurrentScaling, R.DelayedScaling)) else {"usage": u}
        assert torch.equal(got.dequantize(torch.float32, **kw), want.dequantize(torch.float32, **kw)), u
    with pytest.raises(ValueError, match="2-D source"):
        make_quantizer(type(recipe)(), role).gathered(source[None], index)


def _expand(T, E, alignment, seed=0):
    """x_TH, the GroupSplits with its expand as rows_in (padded to ``alignment``), the permuted probs
    and the dispatch state."""
    indices, probs = _routing(T, E, seed=seed)
    x = torch.randn(T, 256, dtype=torch.bfloat16)
    _, _, probs_N, state = _padded_dispatch(x, indices, probs, E, alignment, True)
    return x, state.group_splits(), probs_N, state


@pytest.mark.parametrize("combine", [False, True], ids=["rows_in", "rows_in+out"])
@pytest.mark.parametrize("recipe, native", [(r, False) for r in RECIPES] + [(r, True) for r in RECIPES[1:]],
                         ids=lambda v: v if isinstance(v, bool) else _name(v))
def test_mlp_on_source_rows_equals_mlp_on_their_copy(monkeypatch, recipe, native, combine):
    """The fused grouped MLP (and the unfused ops) given x_TH and rows_in == given the copied rows;
    with ``combine`` fc2 also sums its rows back (rows_out) == the dispatcher's combine of the copy's
    output: output, input gradient (back through the gather's fixed-order sum) and weight gradients.
    ``native``: the quantized path (forced), else the emulated one (bf16: the plain GEMMs)."""
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: native)
    x_src, splits, probs, state = _expand(96, 3, 128 if isinstance(recipe, R.Float8BlockScaling) else 16)
    rows = splits.rows_in
    assert isinstance(rows, RowGather) and rows.zero_rows is not None
    plain = splits._replace(rows_in=None)

    def run(x, fc1_splits, fc2_splits, fused):
        torch.manual_seed(0)
        mlp = OperationFuser([GroupedLinear(3, 256, 256, dtype=torch.bfloat16), ScaledSwiGLU(),
                              GroupedLinear(3, 128, 256, dtype=torch.bfloat16)])
        x = x.clone().requires_grad_(True)
        recipe_now = None if recipe is None else type(recipe)()
        if recipe_now is not None:
            recipe_now.enable_fused_grouped_mlp = fused
        with td.autocast(recipe=recipe_now, enabled=recipe_now is not None):
            y = mlp(x, fc1_splits, probs, fc2_splits)
            if combine and fc2_splits.rows_out is None:
                y = AllToAllDispatcher(3).combine(y, state)
        y.float().square().sum().backward()
        return y.detach(), x.grad, mlp.basic_ops[0].weight.grad, mlp.basic_ops[2].weight.grad

    for fused in ([True, False] if recipe is not None else [True]):
        y_src, dx_src, dw1_src, dw2_src = run(x_src, splits, plain._replace(rows_out=rows if combine else None), fused)
        y_cp, dx_cp, dw1_cp, dw2_cp = run(rows.take(x_src), plain, plain, fused)
        assert y_src.shape[0] == (96 if combine else rows.num_rows)
        assert torch.equal(y_src, y_cp)
        assert torch.equal(dw1_src, dw1_cp) and torch.equal(dw2_src, dw2_cp)
        # the copy's input gradient, summed back over each token's copies, is the source's
        assert dx_src.shape == x_src.shape
        assert torch.equal(dx_src, rows.sum_back(dx_cp))


def test_dispatcher_leaves_the_expand_to_the_experts_only_where_asked():
    torch.manual_seed(0)
    indices, probs = _routing(96, 3)
    x = torch.randn(96, 32)
    x_cp, sizes_cp, probs_cp, state_cp = _padded_dispatch(x, indices, probs, 3, 16, False)
    x_src, sizes_src, probs_src, state_src = _padded_dispatch(x, indices, probs, 3, 16, True)
    assert state_cp.rows is None and state_cp.group_splits().rows_in is None
    assert state_src.group_splits().rows_in is state_src.rows
    assert x_src is x and torch.equal(state_src.rows.take(x), x_cp)
    assert torch.equal(probs_src, probs_cp) and torch.equal(sizes_src, sizes_cp)
    assert state_src.group_splits().sizes == state_cp.group_splits().sizes
    # combine is unchanged: the experts' output rows come home the same way
    y = torch.randn(x_cp.shape)
    assert torch.equal(AllToAllDispatcher(3).combine(y, state_src), AllToAllDispatcher(3).combine(y, state_cp))
    # without an alignment (no native FP8 path) the dispatch copies the rows as before
    x_plain, _, _, state_plain = _padded_dispatch(x, indices, probs, 3, None, True)
    assert state_plain.rows is None and x_plain.shape[0] == 96 * 2
    perm = sort_by_expert(x, indices, 3)
    assert torch.equal(expand_rows(perm).take(x), expand_tokens(x, perm).detach())


def test_group_splits_rows_are_checked_before_any_gemm():
    op = GroupedLinear(2, 16, 16)
    fuser = OperationFuser([op])
    x = torch.randn(5, 16)
    rows = RowGather(torch.tensor([0, 1, 2, 3, 4, 0]), None, lambda g: g[:5] + torch.cat([g[5:], 0 * g[:4]]), True)
    offsets = torch.tensor([3, 6], dtype=torch.int32)
    assert fuser(x, GroupSplits(offsets, (3, 3), rows_in=rows)).shape == (6, 16)  # sizes count the gathered rows
    assert fuser(x, GroupSplits(offsets, (3, 3), rows_in=rows, rows_out=rows)).shape == (5, 16)  # summed back
    with pytest.raises(ValueError, match="sum to 5 but the input has 6 rows"):
        fuser(x, GroupSplits(offsets, (3, 2), rows_in=rows))
    with pytest.raises(TypeError, match="rows_in.index must be a 1-D int64"):
        fuser(x, GroupSplits(offsets, (3, 3), rows_in=rows._replace(index=rows.index.int())))
    with pytest.raises(TypeError, match="rows_in must be a RowGather or None"):
        fuser(x, GroupSplits(offsets, (3, 3), rows_in=(rows.index,)))
    with pytest.raises(ValueError, match="rows_out gathers 6 rows but the split has 5"):
        fuser(x, GroupSplits(offsets, (3, 2), rows_out=rows))
    # the grouped MLP: rows_in is fc1's, rows_out fc2's
    mlp = OperationFuser([GroupedLinear(2, 16, 32), ScaledSwiGLU(), GroupedLinear(2, 16, 16)])
    splits = GroupSplits(offsets, (3, 3), rows_in=rows)
    probs = torch.rand(6)
    assert mlp(x, splits, probs, splits._replace(rows_in=None, rows_out=rows)).shape == (5, 16)
    with pytest.raises(ValueError, match="rows_in on fc2"):
        mlp(x, splits, probs, splits)
    with pytest.raises(ValueError, match="rows_out on fc1"):
        mlp(x, splits._replace(rows_out=rows), probs, splits._replace(rows_in=None))


@pytest.mark.parametrize("recipe", PER_TENSOR + [R.Float8BlockScaling()], ids=_name)
def test_layer_at_ep1_is_the_same_with_the_gather_in_the_experts(monkeypatch, recipe):
    """MoELayer with the native path forced on CPU (alignment 16 or 128): the dispatch leaves its expand
    to the experts (fc1 reads x_TH's rows, fc2 sums its rows back) or not, same output and gradients,
    bit for bit."""
    alignment = 128 if isinstance(recipe, R.Float8BlockScaling) else 16
    monkeypatch.setattr(MoELayer, "_native_row_alignment", lambda self, x, r: None if r is None else alignment)
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)
    real = AllToAllDispatcher.dispatch
    results = []
    for defer in (True, False):
        seen = []

        def dispatch(self, *args, defer=defer, **kwargs):
            kwargs["gather_in_experts"] = kwargs["gather_in_experts"] and defer
            out = real(self, *args, **kwargs)
            seen.append(out[3].rows is not None)
            return out

        monkeypatch.setattr(AllToAllDispatcher, "dispatch", dispatch)
        torch.manual_seed(0)
        layer = MoELayer(256, 128, 4, 2, dtype=torch.bfloat16)
        x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
        with td.autocast(recipe=type(recipe)()):
            y = layer(x)
        y.float().square().sum().backward()
        assert seen == [defer]
        results.append((y.detach(), x.grad, layer.fc1.weight.grad, layer.fc2.weight.grad, layer.router.weight.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", PER_TENSOR + [R.Float8BlockScaling()], ids=_name)
def test_layer_on_the_gpu_is_the_same_with_the_gather_in_the_experts(monkeypatch, recipe):
    """On the GPU the predicate picks the native path itself: fc1 quantizes the token rows without the
    bf16 copy (per-tensor: FP8 bytes gathered; block: the cast reads through the index), as does fc2's
    backward with its output gradient, with the same output and gradients as the dispatcher's copy,
    bit for bit, and the native kernels ran; the same with the gathered FP8 bytes written in both layouts in
    one pass (fp8_gather_transposed)."""
    from te_dist.quantization.tensors import Float8Tensor

    from te_dist.quantization import triton_casts

    taken = []  # gathers that skipped the bf16 copy: FP8 bytes (per-tensor) or the cast through the index (block)
    real = Float8Tensor.take_rows
    monkeypatch.setattr(Float8Tensor, "take_rows", lambda self, *a, **k: taken.append(1) or real(self, *a, **k))
    real_cast = triton_casts.cast_fp8_blocks
    monkeypatch.setattr(triton_casts, "cast_fp8_blocks", lambda *a, **k: (
        taken.append(1) if k.get("gather") is not None else None) or real_cast(*a, **k))
    results = []
    for gather_in_experts, one_pass in ((True, False), (False, False), (True, True)):
        torch.manual_seed(0)
        layer = MoELayer(256, 128, 8, 2, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(512, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        out = []
        for _ in range(2):  # DelayedScaling: the second step casts with the first one's amax
            x.grad = None
            layer.zero_grad(set_to_none=True)
            with td.autocast(recipe=type(recipe)()), td.settings.override(gather_in_experts=gather_in_experts,
                                                                           fp8_gather_transposed=one_pass):
                y = layer(x)
                y.float().square().sum().backward()
            out.append((y.detach(), x.grad, layer.fc1.weight.grad, layer.fc2.weight.grad))
        assert layer.fc1.has_native_weight_copy and layer.fc2.has_native_weight_copy
        results.append(out)
    # per step: x_TH's rows for fc1 and the combine's output gradient for fc2, only where the experts took the gather
    assert len(taken) == 8
    for copied, gathered, one_pass in zip(results[1], results[0], results[2]):
        for a, b, c in zip(gathered, copied, one_pass):
            assert torch.equal(a, b) and torch.equal(c, b)
