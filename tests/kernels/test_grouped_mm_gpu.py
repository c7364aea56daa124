"""GPU tests (H200, sm_90a): every CUTLASS kernel and config against a float32 reference.

Run on the device machine: ``python -m pytest -q tests/kernels -m gpu``. Skipped without CUDA.
Shapes: the six ANCHORS.md shapes, plus ragged / zero-token / single-token splits.
"""

import pytest
import torch

from te_dist import kernels, settings
from te_dist.gemm import cutlass_backend, measure, torch_backend

pytestmark = pytest.mark.gpu

# (name, E, rows per expert, K, N) from docs ANCHORS.md
ANCHOR_SHAPES = [
    ("mixtral_fc1", 8, 4096, 4096, 28672),
    ("mixtral_fc2", 8, 4096, 14336, 4096),
    ("dsv3_fc1_ep8", 32, 1024, 7168, 4096),
    ("dsv3_fc2_ep8", 32, 1024, 2048, 7168),
    ("qwen3_fc1", 128, 256, 2048, 1536),
    ("small_m", 64, 128, 4096, 2048),
]
RAGGED = [0, 1, 517, 0, 3, 1, 64, 200, 0, 1]
CONFIGS = sorted(cutlass_backend.kernels_module().CONFIGS)


def _needs_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cutlass_kernels are sm_90a only; this GPU is not SM 9.0")


@pytest.fixture(scope="module", autouse=True)
def _sm90():
    if torch.cuda.is_available():
        _needs_sm90()
        assert cutlass_backend.is_available(torch.device("cuda")), "nvcc / CUTLASS headers missing on the GPU host"


@pytest.fixture(autouse=True)
def _static_rule():
    """These tests check the static rule's picks: no measured entry may override them."""
    measure.reset()
    with settings.override(tune=False):
        yield
    measure.reset()


def _offsets(splits, device):
    return torch.tensor(splits, device=device, dtype=torch.int64).cumsum(0).to(torch.int32)


def _ref_fwd(x, w_EKN, splits, bias=None, scale=None):
    out = torch.empty(x.shape[0], w_EKN.shape[2], device=x.device, dtype=torch.float32)
    start = 0
    for e, n in enumerate(splits):
        acc = x[start:start + n].float() @ w_EKN[e].float()
        if scale is not None:
            acc = acc * scale[start:start + n].float()[:, None]
        if bias is not None:
            acc = acc + bias[e].float()
        out[start:start + n] = acc
        start += n
    return out


def _ref_wgrad(x, dy, splits):
    E = len(splits)
    dw = torch.zeros(E, dy.shape[1], x.shape[1], device=x.device, dtype=torch.float32)
    start = 0
    for e, n in enumerate(splits):
        dw[e] = dy[start:start + n].float().t() @ x[start:start + n].float()
        start += n
    return dw.transpose(1, 2)


def _close(got, ref, out_dtype):
    """Relative Frobenius error + elementwise bound scaled by the reference's magnitude."""
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all()
    denom = ref.norm().clamp_min(1e-6)
    rel = ((got - ref).norm() / denom).item()
    limit = 1e-2 if out_dtype == torch.bfloat16 else 2e-3
    assert rel < limit, f"relative error {rel:.3e} >= {limit}"
    scale = ref.abs().amax().clamp_min(1e-6)
    assert ((got - ref).abs().amax() / scale).item() < 4 * limit


def _inputs(E, m, K, N, device, splits=None, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    splits = splits or [m] * E
    T = sum(splits)
    x = torch.randn(T, K, device=device, generator=g).bfloat16()
    w_EKN = (torch.randn(E, N, K, device=device, generator=g) / K ** 0.5).bfloat16().transpose(1, 2)
    return splits, x, w_EKN


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", ANCHOR_SHAPES, ids=[s[0] for s in ANCHOR_SHAPES])
def test_anchor_shapes_all_directions(shape, config):
    _, E, m, K, N = shape
    dev = torch.device("cuda")
    splits, x, w = _inputs(E, m, K, N, dev)
    off = _offsets(splits, dev)
    bias = torch.randn(E, N, device=dev)
    scale = torch.rand(x.shape[0], device=dev)
    y = cutlass_backend.forward(x, w, off, bias, scale, torch.bfloat16, config=config)
    _close(y, _ref_fwd(x, w, splits, bias, scale), torch.bfloat16)
    del y
    dy = torch.randn(x.shape[0], N, device=dev).bfloat16()
    dx = cutlass_backend.dgrad(dy, w, off, scale, torch.bfloat16, config=config)
    _close(dx, _ref_fwd(dy, w.transpose(1, 2), splits, None, scale), torch.bfloat16)
    del dx
    dw = cutlass_backend.wgrad(x, dy, off, E, torch.bfloat16, config=config)
    assert dw.shape == (E, K, N) and dw.transpose(1, 2).is_contiguous()
    _close(dw, _ref_wgrad(x, dy, splits), torch.bfloat16)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias,with_scale", [(False, False), (True, False), (False, True), (True, True)])
def test_ragged_zero_and_single_token_experts(config, out_dtype, with_bias, with_scale):
    dev = torch.device("cuda")
    E, K, N = len(RAGGED), 256, 512
    splits, x, w = _inputs(E, 0, K, N, dev, splits=RAGGED, seed=1)
    off = _offsets(splits, dev)
    bias = torch.randn(E, N, device=dev).bfloat16() if with_bias else None
    scale = torch.rand(x.shape[0], device=dev) if with_scale else None
    y = cutlass_backend.forward(x, w, off, bias, scale, out_dtype, config=config)
    assert y.dtype == out_dtype
    _close(y, _ref_fwd(x, w, splits, bias, scale), out_dtype)
    dy = torch.randn(x.shape[0], N, device=dev).bfloat16()
    dx = cutlass_backend.dgrad(dy, w, off, scale, out_dtype, config=config)
    _close(dx, _ref_fwd(dy, w.transpose(1, 2), splits, None, scale), out_dtype)
    # wgrad: experts without rows must come back exactly zero (dw is torch.empty inside, so an
    # unwritten expert would hold stale memory)
    dw = cutlass_backend.wgrad(x, dy, off, E, out_dtype, config=config)
    ref = _ref_wgrad(x, dy, splits)
    _close(dw, ref, out_dtype)
    for e, n in enumerate(splits):
        if n == 0:
            assert torch.count_nonzero(dw[e]) == 0


def test_all_experts_empty_and_no_rows():
    dev = torch.device("cuda")
    splits, x, w = _inputs(4, 0, 64, 64, dev, splits=[0, 0, 0, 0])
    off = _offsets(splits, dev)
    assert cutlass_backend.forward(x, w, off).shape == (0, 64)
    dw = cutlass_backend.wgrad(x, torch.zeros(0, 64, device=dev, dtype=torch.bfloat16), off, 4)
    assert torch.count_nonzero(dw) == 0


def test_static_rule_on_sm90_picks_torch_plain_and_cutlass_for_a_fused_epilogue():
    dev = torch.device("cuda")
    _, x, w = _inputs(8, 512, 1024, 2048, dev)
    assert kernels.select_backend("fwd", x, w) == "torch"
    assert kernels.select_backend("fwd", x, w, epilogue=True) == "cutlass"
    assert kernels.select_backend("fwd", x, w, out_dtype=torch.float32) == "cutlass"
    assert "cutlass" in kernels.available_backends(dev)


def test_host_group_sizes_pick_cublas_per_expert_for_few_large_groups_and_match_reference():
    """Mixtral-like ragged groups with a long contraction and the sizes on the host: a call with a
    row-scale epilogue runs cuBLAS per expert then the epilogue (forward and dgrad); a plain call runs
    torch's kernel (the default); all match the float32 reference."""
    dev = torch.device("cuda")
    splits = [700, 512, 0, 900]
    _, x, w = _inputs(4, 0, 8192, 256, dev, splits=splits, seed=4)
    off = _offsets(splits, dev)
    scale = torch.rand(x.shape[0], device=dev)
    assert kernels.select_backend("fwd", x, w, group_sizes=splits, epilogue=True) == "loop"
    assert kernels.select_backend("fwd", x, w, epilogue=True) == "cutlass"
    assert kernels.select_backend("fwd", x, w, group_sizes=splits) == "torch"
    y = kernels.grouped_mm_forward(x, w, off, row_scale_T=scale, group_sizes=splits)
    _close(y, _ref_fwd(x, w, splits, None, scale), torch.bfloat16)
    dy_long = torch.randn(x.shape[0], 8192, device=dev).bfloat16()
    w_dgrad = (torch.randn(4, 8192, 256, device=dev) / 90).bfloat16().transpose(1, 2)  # [E, K=256, N=8192]
    assert kernels.select_backend("dgrad", dy_long, w_dgrad, group_sizes=splits, epilogue=True) == "loop"
    dx = kernels.grouped_mm_dgrad(dy_long, w_dgrad, off, row_scale_T=scale, group_sizes=splits)
    _close(dx, _ref_fwd(dy_long, w_dgrad.transpose(1, 2), splits, None, scale), torch.bfloat16)
    assert kernels.select_backend("wgrad", x, w, group_sizes=splits) == "torch"


def test_ragged_host_group_sizes_pick_tile_config_10_and_match_reference(monkeypatch):
    """DeepSeek-like ragged groups (~225 rows, 32 experts) with the sizes on the host: forward (with
    bias and row scale) and dgrad (row scale) run on our kernels with config 10, which the tile table picks only
    because the sizes are given and unequal; the results match the float32 reference."""
    dev = torch.device("cuda")
    ck = cutlass_backend.kernels_module()
    picked = []
    real = ck.choose_config
    monkeypatch.setattr(ck, "choose_config", lambda *a, **kw: picked.append(real(*a, **kw)) or picked[-1])
    splits = [147, 372, 246, 219, 0, 301, 260, 255] * 4
    _, x, w = _inputs(32, 0, 1024, 512, dev, splits=splits, seed=5)
    off = _offsets(splits, dev)
    bias = torch.randn(32, 512, device=dev)
    scale = torch.rand(x.shape[0], device=dev)
    y = kernels.grouped_mm_forward(x, w, off, bias_EN=bias, row_scale_T=scale, group_sizes=splits)
    _close(y, _ref_fwd(x, w, splits, bias, scale), torch.bfloat16)
    dy = torch.randn(x.shape[0], 512, device=dev).bfloat16()
    dx = kernels.grouped_mm_dgrad(dy, w, off, row_scale_T=scale, group_sizes=splits)
    _close(dx, _ref_fwd(dy, w.transpose(1, 2), splits, None, scale), torch.bfloat16)
    kernels.grouped_mm_forward(x, w, off, bias_EN=bias, row_scale_T=scale)  # no sizes: the equal-split table
    assert picked == [10, 10, real("fwd", x.shape[0], 512, 1024, 32)] and picked[-1] != 10


@pytest.mark.parametrize("with_bias,with_scale", [(False, False), (True, True), (False, True)])
def test_autograd_through_cutlass_matches_fp32_reference(with_bias, with_scale):
    dev = torch.device("cuda")
    E, K, N = len(RAGGED), 256, 384
    splits, x, w = _inputs(E, 0, K, N, dev, splits=RAGGED, seed=2)
    off = _offsets(splits, dev)
    w_ENK = w.transpose(1, 2).clone().requires_grad_()
    x = x.clone().requires_grad_()
    bias = torch.randn(E, N, device=dev, requires_grad=True) if with_bias else None
    scale = torch.rand(x.shape[0], device=dev, requires_grad=True) if with_scale else None
    y = kernels.grouped_mm(x, w_ENK.transpose(1, 2), off, bias_EN=bias, row_scale_T=scale, backend="cutlass")
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = [t for t in (x, w_ENK, bias, scale) if t is not None]
    refs = [t.detach().float().requires_grad_() for t in leaves]
    it = iter(refs)
    rx, rw = next(it), next(it)
    rb = next(it) if with_bias else None
    rs = next(it) if with_scale else None
    _ref_fwd(rx, rw.transpose(1, 2), splits, rb, rs).backward(dy.float())
    for got, ref in zip(leaves, refs):
        _close(got.grad, ref.grad, torch.bfloat16)


def test_cuda_graph_capture_and_replay():
    dev = torch.device("cuda")
    E, K, N = 8, 512, 1024
    splits, x, w = _inputs(E, 0, K, N, dev, splits=[100, 0, 28, 1, 300, 7, 0, 76], seed=3)
    off = _offsets(splits, dev)
    bias = torch.randn(E, N, device=dev)
    scale = torch.rand(x.shape[0], device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (builds/loads the kernels) outside capture
        kernels.grouped_mm_forward(x, w, off, bias_EN=bias, row_scale_T=scale, backend="cutlass")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = kernels.grouped_mm_forward(x, w, off, bias_EN=bias, row_scale_T=scale)
    # new routing and new data, written in place: the replay must follow the device-side offsets
    new_splits = [0, 250, 1, 60, 0, 100, 101, 0]
    off.copy_(_offsets(new_splits, dev))
    x.copy_(torch.randn_like(x, dtype=torch.float32).bfloat16())
    scale.copy_(torch.rand_like(scale))
    graph.replay()
    torch.cuda.synchronize()
    _close(y_static, _ref_fwd(x, w, new_splits, bias, scale), torch.bfloat16)


def test_cutlass_matches_torch_grouped_mm_bitwise_shape_and_close():
    dev = torch.device("cuda")
    splits, x, w = _inputs(16, 256, 1024, 2048, dev, seed=4)
    off = _offsets(splits, dev)
    a = cutlass_backend.forward(x, w, off)
    b = torch_backend.forward(x, w, off)
    _close(a, b, torch.bfloat16)
