"""GPU tests (H200, sm_90a): the FP8 grouped GEMM kernels against the emulated reference, and the
MoE layer's native FP8 path against bf16.

Native and emulated multiply the same quantized values (the emulated path dequantizes them and
runs the bf16 GEMM), so they differ only by accumulation order and output rounding.
Run on the device machine: ``python -m pytest -q tests/kernels/test_fp8_grouped_gpu.py -m gpu``.
"""

import math

import pytest
import torch

import te_dist as td
from te_dist import kernels as K
from te_dist import recipe as R
from te_dist import support as S
from te_dist.quantization import make_quantizer

pytestmark = pytest.mark.gpu

RECIPES = {
    "block": lambda: R.Float8BlockScaling(),
    "block_hybrid": lambda: R.Float8BlockScaling(fp8_format=R.Format.HYBRID),
    "current": lambda: R.Float8CurrentScaling(),
    "delayed": lambda: R.DelayedScaling(),
}
# (E, K, N, sizes): empty experts, ragged sizes (multiples of 128: the wgrad blocks), a long contraction
CASES = [
    (4, 256, 384, [128, 0, 384, 256]),
    (3, 1024, 512, [0, 0, 640]),
    (8, 512, 256, [256, 128, 0, 1024, 128, 0, 384, 128]),
    (2, 16384, 256, [256, 128]),
]


@pytest.fixture(scope="module", autouse=True)
def _sm90():
    if torch.cuda.is_available():
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the FP8 grouped kernels are sm_90a only")
        assert S.fp8_kernels_why_not(torch.device("cuda")) is None, S.fp8_kernels_unavailable_reason()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _operands(recipe, E, Kin, N, sizes, device):
    T = sum(sizes)
    x = torch.randn(T, Kin, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kin, device=device, dtype=torch.bfloat16) / math.sqrt(Kin)
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
    xq = qi(x, rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(qw(w, rowwise=True, columnwise=True))
    dyq = qg(dy, rowwise=True, columnwise=True)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    return xq, wq, dyq, offs


def _dq(q, usage):
    q = getattr(q, "source", q)
    return q.dequantize(torch.float32, usage=usage) if hasattr(q, "rowwise") else q.dequantize(torch.float32)


def _reference(direction, xq, wq, dyq, sizes):
    """float32 per-expert GEMMs of the dequantized operands: exactly what the kernels multiply."""
    out, start = [], 0
    for e, s in enumerate(sizes):
        rows = slice(start, start + s)
        if direction == "fwd":
            out.append(_dq(xq, "rowwise")[rows] @ _dq(wq, "rowwise")[e].t())
        elif direction == "dgrad":
            out.append(_dq(dyq, "rowwise")[rows] @ _dq(wq, "columnwise")[e])
        else:
            out.append((_dq(dyq, "columnwise")[rows].t() @ _dq(xq, "columnwise")[rows]).unsqueeze(0))
        start += s
    return torch.cat(out, 0)


# per-tensor scales: groups start on 16-row boundaries (the TMA's 16 bytes), not 128
CASES_16 = [(4, 256, 384, [48, 0, 16, 208]), (3, 384, 128, [0, 1024 + 32, 96])]


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}_K{c[1]}_N{c[2]}")
def test_native_matches_the_quantized_reference(cuda_device, name, case):
    """Against float32 GEMMs of the same quantized values: within bf16 output rounding. Against the
    emulated path (bf16 GEMM of the dequantized values) within 1e-3 where those values are exact in
    bf16 (power-of-two block scales); per-tensor current scales are not, so there the emulated path
    is itself ~2e-3 off and only the float32 reference is compared."""
    _check_native(cuda_device, name, case)


@pytest.mark.parametrize("name", ["current", "delayed"])
@pytest.mark.parametrize("case", CASES_16, ids=lambda c: f"E{c[0]}_K{c[1]}_N{c[2]}")
def test_per_tensor_native_on_16_row_groups(cuda_device, name, case):
    """The tensor-scaled kernels on groups that start on 16-row (not 128-row) boundaries."""
    _check_native(cuda_device, name, case)


@pytest.mark.parametrize("name", ["current", "delayed"])
@pytest.mark.parametrize("Kin", [1024, 7168])
def test_tensor_scaled_forward_tiles_promoted_and_fast(cuda_device, name, Kin):
    """The rule's tensor-scaled fwd tiles on ragged groups with an empty one and N off every tile width: the
    promoted 128x192 one, and with settings.fp8_fprop_fast_accum the fast ones (ping-pong 128x128 at short K,
    128x256 at long K), each against float32 GEMMs of the same quantized values, and near each other."""
    torch.manual_seed(3)
    E, N, sizes = 3, 400, [512, 0, 768]
    xq, wq, _, offs = _operands(RECIPES[name](), E, Kin, N, sizes, cuda_device)
    reference, got = _reference("fwd", xq, wq, None, sizes), {}
    for fast in (False, True):
        with td.settings.override(fp8_fprop_fast_accum=fast):
            got[fast] = K.grouped_mm_quantized_forward(xq, wq, offs, backend="cutlass")
        assert torch.isfinite(got[fast]).all() and _rel(got[fast], reference) <= (6e-3 if fast else 2.5e-3), fast
    assert _rel(got[True], got[False]) <= 6e-3 and not torch.equal(got[True], got[False])


LOOP_CASES = [(name, case) for name in ("block", "current", "delayed")
              for case in CASES + [(2, 512, 1024, [256, 384])] + (CASES_16 if name != "block" else [])]


@pytest.mark.parametrize("name,case", LOOP_CASES,
                         ids=lambda v: v if isinstance(v, str) else f"E{v[0]}_K{v[1]}_N{v[2]}_{len(v[3])}")
def test_cublas_per_expert_matches_the_quantized_reference(cuda_device, name, case):
    """backend="loop" (torch._scaled_mm per expert, the group sizes on the host): the same checks
    (block scales on 128-row groups, as they need). Block-scaled fwd/dgrad with a contraction that
    is not a multiple of 512 are refused (cuBLAS returned wrong values there): the check is that
    they raise."""
    _check_native(cuda_device, name, case, backend="loop")


def _refused_by_the_loop(name, direction, Kin, N):
    contraction = {"fwd": Kin, "dgrad": N}.get(direction)
    return name.startswith("block") and contraction is not None and contraction % 512 != 0


def test_cublas_per_expert_refuses_what_it_cannot_run(cuda_device):
    xq, wq, dyq, offs = _operands(RECIPES["block_hybrid"](), 2, 256, 256, [128, 128], cuda_device)
    with pytest.raises(ValueError, match="e4m3 operands"):
        K.grouped_mm_quantized_dgrad(dyq, wq, offs, backend="loop", group_sizes=[128, 128])
    with pytest.raises(ValueError, match="group sizes on the host"):
        K.grouped_mm_quantized_forward(xq, wq, offs, backend="loop")
    assert K.grouped_mm_quantized_forward(xq, wq, offs, group_sizes=[128, 128]).shape == (256, 256)


def _check_native(cuda_device, name, case, backend="cutlass"):
    E, Kin, N, sizes = case
    torch.manual_seed(1)
    xq, wq, dyq, offs = _operands(RECIPES[name](), E, Kin, N, sizes, cuda_device)
    g = sizes if backend == "loop" else None
    for direction, call in {
        "fwd": lambda b: K.grouped_mm_quantized_forward(xq, wq, offs, backend=b, group_sizes=g),
        "dgrad": lambda b: K.grouped_mm_quantized_dgrad(dyq, wq, offs, backend=b, group_sizes=g),
        "wgrad": lambda b: K.grouped_mm_quantized_wgrad(xq, dyq, offs, num_groups=E, backend=b, group_sizes=g),
    }.items():
        if backend == "loop" and _refused_by_the_loop(name, direction, Kin, N):
            with pytest.raises(ValueError, match="multiple of 512"):
                call(backend)
            continue
        native = call(backend)
        assert torch.isfinite(native).all(), direction
        # fast accumulation (tensor-scaled fwd on our kernels, settings.fp8_fprop_fast_accum) keeps all of K in the
        # tensor cores' accumulator: its error grows with K (3.5e-3 at K 16384 on an H100), still ~20x under the
        # FP8 quantization's own
        fast = backend == "cutlass" and direction == "fwd" and not name.startswith("block") and \
            td.settings.current().fp8_fprop_fast_accum
        assert _rel(native, _reference(direction, xq, wq, dyq, sizes)) <= (6e-3 if fast else 2.5e-3), direction
        if name.startswith("block"):
            assert _rel(native, call("emulated")) <= 1e-3, direction
        if direction == "wgrad":
            for e, s in enumerate(sizes):
                if s == 0:
                    assert native[e].abs().max().item() == 0.0  # an empty expert's weight gradient is zero


@pytest.mark.parametrize("name", ["block", "current"])
def test_bias_and_row_scale_epilogue(cuda_device, name):
    """Block scales: row scale and bias after the mainloop's scaling; tensor scales: after alpha."""
    torch.manual_seed(2)
    E, Kin, N, sizes = 3, 256, 256, [128, 0, 256]
    xq, wq, _, offs = _operands(RECIPES[name](), E, Kin, N, sizes, cuda_device)
    bias = torch.randn(E, N, device=cuda_device, dtype=torch.bfloat16)
    scale = torch.rand(sum(sizes), device=cuda_device)
    native = K.grouped_mm_quantized_forward(xq, wq, offs, bias_EN=bias, row_scale_T=scale, backend="cutlass")
    expert = torch.repeat_interleave(torch.arange(E, device=cuda_device), torch.tensor(sizes, device=cuda_device))
    reference = _reference("fwd", xq, wq, None, sizes) * scale[:, None] + bias.float()[expert]
    assert _rel(native, reference) <= 2.5e-3
    if name == "block":
        emulated = K.grouped_mm_quantized_forward(xq, wq, offs, bias_EN=bias, row_scale_T=scale, backend="emulated")
        assert _rel(native, emulated) <= 2e-3


def test_forced_native_where_it_cannot_run_raises(cuda_device):
    xq, wq, _, offs = _operands(R.Float8BlockScaling(), 2, 256, 256, [128, 128], cuda_device)
    with pytest.raises(ValueError, match="out_dtype"):
        K.grouped_mm_quantized_forward(xq, wq, offs, out_dtype=torch.float16, backend="cutlass")


@pytest.mark.parametrize("name", ["block", "current", "delayed"])
def test_layer_native_fp8_close_to_bf16(cuda_device, name):
    """MoELayer forward+backward on the native path: outputs and gradients near bf16's."""
    torch.manual_seed(0)
    layer = td.moe.MoELayer(512, 384, 8, 2, dtype=torch.bfloat16, device=cuda_device)
    x = torch.randn(1000, 512, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    y_ref = layer(x)
    y_ref.float().square().mean().backward()  # gradients ~1e-7: a real check of the gradient scaling
    ref_grads = [x.grad.clone(), layer.fc1.weight.grad.clone(), layer.fc2.weight.grad.clone()]
    recipe = RECIPES[name]()
    # DelayedScaling warms up: each gradient's scale comes from the previous steps' amax, so the first
    # backward casts dy with the initial scale 1 (it underflows), and fc1's dh does once more, since
    # it was all zeros the step before. From the third step on every scale is set.
    for _ in range(3):
        x.grad = layer.fc1.weight.grad = layer.fc2.weight.grad = None
        with td.autocast(recipe=recipe):
            y = layer(x)
        y.float().square().mean().backward()
    assert layer.fc1.has_native_weight_copy and layer.fc2.has_native_weight_copy  # the native path ran
    assert _rel(y, y_ref) < 0.1
    for got, want in zip([x.grad, layer.fc1.weight.grad, layer.fc2.weight.grad], ref_grads):
        assert torch.isfinite(got).all() and _rel(got, want) < 0.2


@pytest.mark.parametrize("name", ["block", "current"])
def test_layer_keeps_the_swiglu_input_in_fp8(cuda_device, name):
    """On the native path the SwiGLU input is held as E4M3 (one byte per element, not two) unless the
    recipe says fp8_swiglu_input = False; against the bf16 layer, the gradients then move by little
    more than the FP8 GEMMs already move them."""
    torch.manual_seed(0)
    layer = td.moe.MoELayer(512, 384, 8, 2, dtype=torch.bfloat16, device=cuda_device)
    x = torch.randn(1000, 512, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)

    def held_bytes():
        # the bytes asked for, not the allocator's blocks: a block of a few MiB may come whole from a larger
        # free one depending on what ran before, which made the difference below move by ~0.5 MB between runs
        stats = torch.cuda.memory_stats(cuda_device)
        return stats.get("requested_bytes.all.current", torch.cuda.memory_allocated(cuda_device))

    def step(recipe):
        x.grad = layer.fc1.weight.grad = layer.fc2.weight.grad = None
        torch.cuda.synchronize()
        base = held_bytes()
        with td.autocast(recipe=recipe):
            y = layer(x)
        held = held_bytes() - base
        y.float().square().mean().backward()
        return held, [x.grad.clone(), layer.fc1.weight.grad.clone(), layer.fc2.weight.grad.clone()]

    _, grads_ref = step(None)
    fp8_kept, bf16_kept = RECIPES[name](), RECIPES[name]()
    bf16_kept.fp8_swiglu_input = False
    step(fp8_kept), step(bf16_kept)  # weight copies cast, kernels loaded
    held_fp8, grads_fp8 = step(fp8_kept)
    held_bf16, grads_bf16 = step(bf16_kept)
    rows_by_width = 1000 * 2 * 384 * 2  # at least T * top-k rows of h [*, 2F]
    # one byte saved per element, less what the FP8 form holds beside its bytes (block: a float32 scale
    # per 128 elements) and the allocator's rounding; a bf16 h would save nothing
    assert held_bf16 - held_fp8 >= 0.85 * rows_by_width, (held_fp8, held_bf16)
    for got, kept_bf16, ref in zip(grads_fp8, grads_bf16, grads_ref):
        assert torch.isfinite(got).all() and _rel(got, kept_bf16) < 0.1
        assert _rel(got, ref) <= 1.5 * _rel(kept_bf16, ref) + 0.02, (_rel(got, ref), _rel(kept_bf16, ref))


@pytest.mark.parametrize("name", ["block", "block_hybrid", "current", "delayed"])
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"E{c[0]}_K{c[1]}_N{c[2]}")
@pytest.mark.parametrize("in_epilogue", [False, True], ids=["add_after", "in_epilogue"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "main_grad_f32"])
def test_accumulating_wgrad_adds_into_the_gradient(cuda_device, name, case, in_epilogue, dtype):
    """``accumulate_into``: the returned tensor is the one given, holding the old values plus dw (an empty expert's
    rows untouched); in the epilogue (te_dist.settings.fp8_wgrad_accumulation) one rounding of acc + the old value,
    after the GEMM autograd's add of the rounded dw: both within bf16 rounding of the float32 sum (a float32
    gradient, Megatron's main_grad, takes the float32 instances)."""
    E, Kin, N, sizes = case
    torch.manual_seed(2)
    xq, wq, dyq, offs = _operands(RECIPES[name](), E, Kin, N, sizes, cuda_device)
    old = torch.randn(E, N, Kin, device=cuda_device, dtype=dtype)
    grad = old.clone()
    with td.settings.override(fp8_wgrad_accumulation=in_epilogue):
        out = K.grouped_mm_quantized_wgrad(xq, dyq, offs, num_groups=E, accumulate_into=grad)
    assert out is grad
    expected = old.float() + _reference("wgrad", xq, wq, dyq, sizes)
    assert _rel(out, expected) <= 5e-3
    for e, s in enumerate(sizes):
        if s == 0:
            assert torch.equal(out[e], old[e])
