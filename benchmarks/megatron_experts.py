"""Megatron MoELayer forward+backward: te_dist GroupedExperts vs Megatron's SequentialMLP.

Both layers are built from the same TransformerConfig, get the same router and expert weights,
and see the same tokens; the table reports time per step (forward + backward of the whole
MoELayer: router, dispatch, experts, combine) and our speed-up over SequentialMLP in this run.

    # DeepSeek-V3-like layer as one EP8 rank holds it (32 local experts, H=7168, F=2048, top-8), H200:
    python benchmarks/megatron_experts.py --preset deepseek
    # tiny shape for the CPU box:
    python benchmarks/megatron_experts.py --preset tiny

Runs single-process (world size 1). On a CPU-only machine it applies the test-suite workarounds
from tests/megatron/mcore_helpers.py (Megatron assumes CUDA in its router and RNG tracker).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import timing

PRESETS = {
    # tokens = sequence x batch entering the layer; experts = the experts one rank computes.
    "deepseek": dict(hidden_size=7168, moe_ffn_hidden_size=2048, num_moe_experts=32, moe_router_topk=8,
                     seq=4096, batch=1, dtype=torch.bfloat16),
    "mixtral": dict(hidden_size=4096, moe_ffn_hidden_size=14336, num_moe_experts=8, moe_router_topk=2,
                    seq=4096, batch=1, dtype=torch.bfloat16),
    "tiny": dict(hidden_size=64, moe_ffn_hidden_size=32, num_moe_experts=8, moe_router_topk=2,
                 seq=128, batch=2, dtype=torch.float32),
}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_step(layer, x, dy, warmup: int, iters: int) -> list:
    times = []
    for i in range(warmup + iters):
        xi = x.detach().requires_grad_(True)
        _sync()
        start = time.perf_counter()
        y, _ = layer(xi)
        y.backward(dy)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
    return times


def _helpers():
    """tests/megatron/mcore_helpers.py (imports Megatron), with this folder off the path: it holds scripts
    named like packages Megatron imports (grouped_gemm.py)."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(timing.REPO / "tests" / "megatron"))
    sys.path.insert(0, str(timing.REPO))
    import mcore_helpers

    return mcore_helpers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dispatcher", choices=["allgather", "alltoall"], default="alltoall")
    parser.add_argument("--recipe", default="none", help="te_dist recipe name for our experts (default none)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    timing.add_json_option(parser)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    H = _helpers()
    shape = dict(PRESETS[args.preset])
    seq, batch, dtype = shape.pop("seq"), shape.pop("batch"), shape.pop("dtype")
    if args.dispatcher == "alltoall" and not torch.cuda.is_available():
        parser.error("--dispatcher alltoall needs CUDA (Megatron creates a CUDA stream); use allgather on CPU")

    H.apply_cpu_workarounds()
    H.init_megatron(ep_size=1)
    torch.manual_seed(0)
    config = H.make_config(params_dtype=dtype, bf16=dtype == torch.bfloat16, moe_token_dispatcher_type=args.dispatcher,
                           ffn_hidden_size=shape["moe_ffn_hidden_size"], moe_router_dtype="fp32", **shape)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    x = torch.randn(seq, batch, config.hidden_size, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    seq_layer = H.build_moe_layer(config, "sequential")
    results = {"SequentialMLP": _time_step(seq_layer, x, dy, args.warmup, args.iters)}
    ours = H.build_moe_layer(config, "te_dist", recipe=args.recipe)
    H.copy_moe_layer(seq_layer, ours)
    results[f"te_dist GroupedExperts ({args.recipe})"] = _time_step(ours, x, dy, args.warmup, args.iters)
    with torch.no_grad():  # the two layers compute the same function (up to rounding / the recipe)
        y_ref, y = seq_layer(x)[0].float(), ours(x)[0].float()
    rel_err = ((y - y_ref).norm() / y_ref.norm()).item()

    hw = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"Megatron MoELayer fwd+bwd, preset={args.preset} {shape} tokens={seq * batch} {dtype} "
          f"dispatcher={args.dispatcher} on {hw}")
    base = statistics.median(results["SequentialMLP"])
    print(f"relative L2 difference of the outputs: {rel_err:.2e}")
    print(f"{'experts':36s} {'median ms':>10s} {'min ms':>8s} {'speed-up':>9s}")
    rows = []
    for name, times in results.items():
        med = statistics.median(times)
        rows.append(dict(experts=name, median_ms=med * 1e3, min_ms=min(times) * 1e3, speedup=base / med))
        print(f"{name:36s} {med * 1e3:10.3f} {min(times) * 1e3:8.3f} {base / med:8.2f}x")
    H.destroy_megatron()
    timing.write_json(args.json, rows, preset=args.preset, dispatcher=args.dispatcher, rel_l2_difference=rel_err,
                      benchmark="megatron_experts")


if __name__ == "__main__":
    main()
