"""CPU overhead of the fuser: plan lookup, a 4-op Sequential and the grouped expert MLP.

Tiny tensors so Python overhead dominates; every figure is compared with the same computation
written as plain torch modules, measured in the same run (ratios, since these machines are noisy).

    python benchmarks/fuser_overhead.py [--iters N] [--repeats R] [--recipe NAME] [--device cuda]

With ``--device cuda`` the tensors live on the GPU in bfloat16 (split sizes too, as in the MoE layer)
and the figures are the CPU time spent issuing the work (the GPU runs asynchronously; each repeat
ends with a synchronize).

Goals (issue 4): plan lookup <= 1 us per call; Sequential <= 1.5x plain torch; grouped MLP
forward+backward <= 300 us of CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import te_dist
from te_dist import ops
from te_dist.recipe import recipe_from_name


FACTORY = {"device": "cpu", "dtype": torch.float32}  # set by main(); used by every tensor and module below


def _sync():
    if FACTORY["device"] != "cpu":
        torch.cuda.synchronize()


def bench(fn, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean process CPU time per call, in microseconds.

    ``time.process_time`` counts only this process's CPU time, so other jobs on a shared machine
    inflate it far less than wall time (run with one torch thread so it equals the work done)."""
    for _ in range(max(3, iters // 10)):
        fn()
    _sync()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(iters):
            fn()
        _sync()
        samples.append((time.process_time() - start) / iters * 1e6)
    return statistics.median(samples)


# ------------------------------------------------------------------ plan lookup
def plan_lookup_rows(iters, repeats, recipe):
    fuser = ops.OperationFuser([ops.BasicLinear(16, 16, **FACTORY), ops.Bias(16, **FACTORY), ops.GELU(),
                                ops.BasicLinear(16, 16, **FACTORY)])
    x = torch.randn(4, 16, **FACTORY)
    with te_dist.autocast(recipe=recipe):
        fuser(x)
        key = fuser.fusion_key
        get_plan = fuser.get_plan
        first_op = fuser.first_op_requiring_backward
        from te_dist.autocast import get_active_recipe, get_recipe_key

        def key_and_lookup():
            r = get_active_recipe()
            k = (get_recipe_key() if r is not None else None, first_op(x, ()))
            return get_plan(k, r)

        rows = [
            ("plan lookup: get_plan(key) hit", bench(lambda: get_plan(key, recipe), iters * 10, repeats)),
            ("key + lookup: recipe key, first_op, get_plan", bench(key_and_lookup, iters * 10, repeats)),
            ("dict.get baseline (floor)", bench(lambda: fuser._plans.get(key), iters * 10, repeats)),
        ]
    return rows


# ------------------------------------------------------------------ 4-op Sequential
def sequential_rows(iters, repeats, recipe, H=64, T=8):
    torch.manual_seed(0)
    ours = ops.Sequential(ops.BasicLinear(H, H, **FACTORY), ops.Bias(H, **FACTORY), ops.GELU(),
                          ops.BasicLinear(H, H, **FACTORY))
    plain = torch.nn.Sequential(torch.nn.Linear(H, H, **FACTORY), torch.nn.GELU(),
                                torch.nn.Linear(H, H, bias=False, **FACTORY))
    x = torch.randn(T, H, requires_grad=True, **FACTORY)

    def run(model):
        def step():
            model(x).sum().backward()
        return step

    with te_dist.autocast(recipe=recipe):
        t_ours = bench(run(ours), iters, repeats)
        t_eval = bench(lambda: _no_grad(ours, x), iters, repeats)
    t_plain = bench(run(plain), iters, repeats)
    t_plain_eval = bench(lambda: _no_grad(plain, x), iters, repeats)
    return [
        ("Sequential(Linear,Bias,GELU,Linear) fwd+bwd", t_ours, t_plain),
        ("same, forward under no_grad", t_eval, t_plain_eval),
    ]


def _no_grad(model, x):
    with torch.no_grad():
        return model(x)


# ------------------------------------------------------------------ grouped MLP
class PlainExpertMLP(torch.nn.Module):
    """The expert MLP as plain torch modules: per-expert F.linear, SwiGLU, probs, per-expert F.linear."""

    def __init__(self, E, H, F):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(E, 2 * F, H, **FACTORY) * H ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, F, **FACTORY) * F ** -0.5)

    def forward(self, x, split_list, probs):
        outs = []
        for e, xe in enumerate(x.split(split_list)):
            gate, up = torch.nn.functional.linear(xe, self.w1[e]).chunk(2, -1)
            outs.append(torch.nn.functional.silu(gate) * up)
        a = torch.cat(outs) * probs[:, None].to(x.dtype)
        return torch.cat([torch.nn.functional.linear(ae, self.w2[e]) for e, ae in enumerate(a.split(split_list))])


def grouped_mlp_rows(iters, repeats, recipe, E=4, H=64, F=64, T=32):
    torch.manual_seed(0)
    fuser = ops.OperationFuser([ops.GroupedLinear(E, H, 2 * F, **FACTORY), ops.ScaledSwiGLU(),
                                ops.GroupedLinear(E, F, H, **FACTORY)])
    plain = PlainExpertMLP(E, H, F)
    x = torch.randn(T, H, requires_grad=True, **FACTORY)
    probs = torch.rand(T, requires_grad=True, device=FACTORY["device"])
    split_list = [T // E] * E
    splits = torch.tensor(split_list, device=FACTORY["device"])

    def ours():
        fuser(x, splits, probs, splits).sum().backward()

    def theirs():
        plain(x, split_list, probs).sum().backward()

    # The six grouped GEMMs alone (te_dist.kernels), to split the total into kernel calls and the rest.
    from te_dist import kernels

    fc1, fc2 = fuser.basic_ops[0], fuser.basic_ops[2]
    w1, w2 = fc1.weight.detach().transpose(1, 2), fc2.weight.detach().transpose(1, 2)
    offsets = torch.cumsum(splits, 0, dtype=torch.int32)
    xd, h, s, dy = x.detach(), torch.randn(T, 2 * F, **FACTORY), torch.randn(T, F, **FACTORY), torch.randn(T, H, **FACTORY)

    def gemms():  # as GroupedLinear calls them: backward operands were validated by the forward
        kernels.grouped_mm_forward(xd, w1, offsets, check_offsets=False)
        kernels.grouped_mm_forward(s, w2, offsets, row_scale_T=probs.detach(), check_offsets=False)
        kernels.grouped_mm_dgrad(dy, w2, offsets, validate=False)
        kernels.grouped_mm_wgrad(s, dy, offsets, num_groups=E, validate=False)
        kernels.grouped_mm_dgrad(h, w1, offsets, validate=False)
        kernels.grouped_mm_wgrad(xd, h, offsets, num_groups=E, validate=False)

    # Detail row: uneven routing (one expert idle), so no figure hinges on equal splits.
    uneven_list = [3 * T // 32, 0, 20 * T // 32, T - 23 * T // 32] if E == 4 else split_list
    uneven = torch.tensor(uneven_list, device=FACTORY["device"])

    def ours_uneven():
        fuser(x, uneven, probs, uneven).sum().backward()

    def theirs_uneven():
        plain(x, uneven_list, probs).sum().backward()

    with te_dist.autocast(recipe=recipe):
        t_ours = bench(ours, iters, repeats)
        t_ours_uneven = bench(ours_uneven, iters, repeats)
    t_plain = bench(theirs, iters, repeats)
    t_plain_uneven = bench(theirs_uneven, iters, repeats)
    t_gemms = bench(gemms, iters, repeats)
    assert type(fuser.plan.forward_ops[0].op).__name__ == "GroupedMLP"
    name = f"grouped MLP fwd+bwd (E={E}, H={H}, F={F}, T={T})"
    return [(name, t_ours, t_plain), ("  of which: its 6 te_dist.kernels grouped GEMM calls", t_gemms, None),
            (f"  same, uneven splits {uneven_list}", t_ours_uneven, t_plain_uneven)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recipe", default="none", help="none | delayed | current | block | mxfp8 | nvfp4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (float32) | cuda (bfloat16)")
    parser.add_argument("--tokens", type=int, default=None, help="grouped-MLP tokens (default 32 on cpu, 64 on cuda)")
    args = parser.parse_args()
    if args.device != "cpu":
        FACTORY.update(device=args.device, dtype=torch.bfloat16)
    # On CUDA keep > 8 rows per expert so the kernel selector does not take the host-syncing loop.
    tokens = args.tokens or (32 if args.device == "cpu" else 64)
    torch.set_num_threads(args.threads)
    recipe = recipe_from_name(args.recipe)
    print(f"torch {torch.__version__}, device={args.device}, dtype={FACTORY['dtype']}, threads={args.threads}, recipe={args.recipe}, "
          f"iters={args.iters}, repeats={args.repeats} (median of repeats)\n")
    print(f"{'measurement':<52} {'us/call':>10}")
    for name, t in plan_lookup_rows(args.iters, args.repeats, recipe):
        print(f"{name:<52} {t:>10.3f}")
    print()
    print(f"{'measurement':<52} {'te_dist us':>10} {'torch us':>10} {'ratio':>7}")
    rows = sequential_rows(args.iters, args.repeats, recipe) + grouped_mlp_rows(args.iters, args.repeats, recipe, T=tokens)
    for name, t_ours, t_plain in rows:
        if t_plain is None:
            print(f"{name:<52} {t_ours:>10.1f}")
        else:
            print(f"{name:<52} {t_ours:>10.1f} {t_plain:>10.1f} {t_ours / t_plain:>7.2f}")
    if recipe is not None:
        print("\n(te_dist rows quantize every GEMM operand with emulated numerics; the torch rows do not.)")


if __name__ == "__main__":
    main()
