"""megatron-core 0.16's router GEMM without TransformerEngine: te_dist.megatron gives it the name it reads."""

import importlib.util

import pytest
import torch


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="TransformerEngine installed: Megatron binds te_general_gemm itself")
def test_router_gemm_runs_without_transformer_engine():
    import megatron.core.transformer.moe.moe_utils as moe_utils

    import te_dist.megatron.experts  # noqa: F401  (binds the missing name at import)

    assert "te_general_gemm" in vars(moe_utils) and moe_utils.te_general_gemm is None
    # Megatron's own router GEMM, forward and backward (0.16.1 raised NameError here without the name).
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    y = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(y, x @ w.t())
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_defining_the_name_keeps_an_existing_binding(monkeypatch):
    import megatron.core.transformer.moe.moe_utils as moe_utils

    from te_dist.megatron._compat import define_missing_te_general_gemm

    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    define_missing_te_general_gemm()
    assert moe_utils.te_general_gemm is sentinel
