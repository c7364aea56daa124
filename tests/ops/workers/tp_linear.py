"""torchrun worker: tensor-parallel BasicLinear (column, row, column->row MLP) and the comm ops
against a single-process float64 reference. Every rank builds the same global tensors from a seed."""

import sys

import torch
import torch.distributed as dist

from te_dist import ops

T, IN, OUT = 6, 8, 12


def close(a, b, what):
    torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {RANK} {what}: {m}")


def globals_(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in ((T, IN), (OUT, IN), (OUT,), (T, OUT), (IN, OUT), (IN,))]


def ref_leaves(*ts):
    return [t.double().requires_grad_(True) for t in ts]


def check_column():
    x, w, b, dy, _, _ = globals_(1)
    n = OUT // WORLD
    rows = slice(RANK * n, (RANK + 1) * n)
    lin = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", tensor_parallel_group=dist.group.WORLD)
    bias = ops.Bias(n)
    with torch.no_grad():
        lin.weight.copy_(w[rows])
        bias.bias.copy_(b[rows])
    fuser = ops.OperationFuser([lin, bias, ops.GELU()])
    xl = x.clone().requires_grad_(True)
    y = fuser(xl)
    y.backward(dy[:, rows])
    x64, w64, b64 = ref_leaves(x, w, b)
    y64 = torch.nn.functional.gelu(x64 @ w64.t() + b64)
    y64.backward(dy.double())
    close(y, y64[:, rows], "column y")
    close(xl.grad, x64.grad, "column dx")
    close(lin.weight.grad, w64.grad[rows], "column dw")
    close(bias.bias.grad, b64.grad[rows], "column db")
    assert type(fuser.plan.forward_ops[0].op).__name__ == "ForwardLinearBiasActivation"


def check_row():
    x, w, b, dy, _, _ = globals_(2)
    n = IN // WORLD
    cols = slice(RANK * n, (RANK + 1) * n)
    lin = ops.BasicLinear(IN, OUT, tensor_parallel_mode="row", tensor_parallel_group=dist.group.WORLD)
    bias = ops.Bias(OUT)
    with torch.no_grad():
        lin.weight.copy_(w[:, cols])
        bias.bias.copy_(b)
    fuser = ops.OperationFuser([lin, bias])
    xl = x[:, cols].clone().requires_grad_(True)
    y = fuser(xl)
    y.backward(dy)
    x64, w64, b64 = ref_leaves(x, w, b)
    y64 = x64 @ w64.t() + b64  # the bias is added once, after the reduction
    y64.backward(dy.double())
    close(y, y64, "row y")
    close(xl.grad, x64.grad[:, cols], "row dx")
    close(lin.weight.grad, w64.grad[:, cols], "row dw")
    close(bias.bias.grad, b64.grad, "row db")


def check_mlp():
    x, w1, b1, dy, w2t, _ = globals_(3)
    w2 = w2t  # [IN, OUT]: the second linear maps OUT -> IN
    b2 = torch.randn(IN, generator=torch.Generator().manual_seed(4))
    n = OUT // WORLD
    sl = slice(RANK * n, (RANK + 1) * n)
    col = ops.BasicLinear(IN, OUT, tensor_parallel_mode="column", tensor_parallel_group=dist.group.WORLD)
    row = ops.BasicLinear(OUT, IN, tensor_parallel_mode="row", tensor_parallel_group=dist.group.WORLD)
    seq = ops.Sequential(col, ops.Bias(n), ops.ReLU(), row, ops.Bias(IN))
    with torch.no_grad():
        col.weight.copy_(w1[sl])
        seq[1].bias.copy_(b1[sl])
        row.weight.copy_(w2[:, sl])
        seq[4].bias.copy_(b2)
    xl = x.clone().requires_grad_(True)
    dy2 = dy[:, :IN]
    y = seq(xl)
    y.backward(dy2)
    x64, w164, b164, w264, b264 = ref_leaves(x, w1, b1, w2, b2)
    y64 = torch.relu(x64 @ w164.t() + b164) @ w264.t() + b264
    y64.backward(dy2.double())
    close(y, y64, "mlp y")
    close(xl.grad, x64.grad, "mlp dx")
    close(col.weight.grad, w164.grad[sl], "mlp dw1")
    close(seq[1].bias.grad, b164.grad[sl], "mlp db1")
    close(row.weight.grad, w264.grad[:, sl], "mlp dw2")
    close(seq[4].bias.grad, b264.grad, "mlp db2")


def check_comm_ops():
    def per_rank(seed, shape):
        return [torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 10 + r)) for r in range(WORLD)]

    group = dist.group.WORLD
    xs, dys = per_rank(5, (2, 3)), per_rank(6, (2 * WORLD, 3))
    x = xs[RANK].clone().requires_grad_(True)
    y = ops.AllGather(group)(x)
    close(y, torch.cat(xs), "all_gather y")
    y.backward(dys[RANK])
    close(x.grad, sum(d[2 * RANK:2 * RANK + 2] for d in dys), "all_gather dx")

    xs, dys = per_rank(7, (2 * WORLD, 3)), per_rank(8, (2, 3))
    x = xs[RANK].clone().requires_grad_(True)
    y = ops.ReduceScatter(group)(x)
    close(y, sum(xs)[2 * RANK:2 * RANK + 2], "reduce_scatter y")
    y.backward(dys[RANK])
    close(x.grad, torch.cat(dys), "reduce_scatter dx")

    xs, dys = per_rank(9, (2, 3)), per_rank(10, (2, 3))
    x = xs[RANK].clone().requires_grad_(True)
    y = ops.AllReduce(group)(x)
    close(y, sum(xs), "all_reduce y")
    close(x, xs[RANK], "all_reduce leaves its input untouched")
    y.backward(dys[RANK])
    close(x.grad, dys[RANK], "all_reduce dx")


def check_amax_reduction():
    """DelayedScaling(reduce_amax=True) under autocast(group=...): ops build quantizers that reduce amax
    over the group, so ranks with different inputs end up with the same scale; without a group they differ."""
    import te_dist
    from te_dist import recipe as R

    def input_scale(group):
        recipe = R.DelayedScaling(amax_history_len=4)
        lin = ops.BasicLinear(16, 16)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(RANK)) * (RANK + 1)
        with te_dist.autocast(recipe=recipe, group=group):
            lin(x)
            lin(x)  # the second call quantizes with the scale derived from the (reduced) history
        scale = lin.quantizers.input.scale.reshape(1)
        gathered = [torch.zeros_like(scale) for _ in range(WORLD)]
        dist.all_gather(gathered, scale)
        return torch.cat(gathered)

    reduced = input_scale(dist.group.WORLD)
    assert torch.all(reduced == reduced[0]), f"rank {RANK}: scales differ across ranks with a group: {reduced}"
    local = input_scale(None)
    assert not torch.all(local == local[0]), f"rank {RANK}: scales should differ without a group: {local}"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    checks = {"column": check_column, "row": check_row, "mlp": check_mlp, "comm": check_comm_ops,
              "amax": check_amax_reduction}
    for name in sys.argv[1:] or checks:
        checks[name]()
        print(f"rank {RANK}: {name} OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()
