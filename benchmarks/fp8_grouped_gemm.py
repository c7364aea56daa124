"""FP8 grouped GEMMs against bf16 and torch's row-wise FP8, in one run (one H200).

    python benchmarks/fp8_grouped_gemm.py [--shapes dsv3_fc1,dsv3_fc2,...] [--splits even,ragged] [--dirs fwd,dgrad,wgrad]
        [--sweep 0,1,...] [--json PATH]

Rows: one per (shape, split, direction). Columns (TFLOP/s, median of do_bench):
  * fp8 block   te_dist.kernels.grouped_mm_quantized_* on Float8BlockScaling operands (1x128
                activations and gradients, 128x128 weights), the group sizes given: our CUTLASS
                SM90 block-scaled kernels, or cuBLAS per expert where the selector picks it
                (te_dist/backends/fp8_selection.py); then "other" = the backend not picked, forced
                (the CUTLASS kernels where the loop was picked, else cuBLAS per expert where it can run).
  * fp8 tensor  the same entry points on Float8CurrentScaling operands (HYBRID: e5m2 gradients):
                the tensor-scaled kernels, which apply each operand's one scale in the epilogue
                (or cuBLAS per expert, as above; "other" as above).
  * tables      the same per-tensor operands on the block-scaled kernels, their scales broadcast
                into block tables per call (the A/B baseline of the tensor-scaled kernels).
  * bf16        te_dist.kernels.grouped_mm_forward/_dgrad/_wgrad on bf16 operands (auto backend).
  * torch fp8   torch._scaled_grouped_mm, row-wise e4m3 scales (fwd and dgrad; no e5m2 and no
                block scales there), as a user would call it.
  * err         relative Frobenius error of the native block result against the emulated one
                (te_dist's reference: dequantize the same quantized operands, bf16 GEMM), and
                against a float32 matmul of the dequantized operands.
Quantization is outside the timed region (the layer quantizes once per tensor; see
benchmarks/fp8_layer.py for the whole layer). Splits: "even", and "ragged" (Zipf-like sizes,
an empty expert, every size a multiple of 128 as the layer pads them).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from te_dist import kernels as K
from te_dist import recipe as R
from te_dist.backends import fp8_selection
from te_dist.quantization import make_quantizer

from scale_tables import scale_tables  # beside this file: the script's directory is on sys.path

SHAPES = {  # name: (experts, rows per expert, K in, N out)
    "dsv3_fc1": (32, 1024, 7168, 4096),
    "dsv3_fc2": (32, 1024, 2048, 7168),
    "mixtral_fc1": (8, 4096, 4096, 28672),
    "mixtral_fc2": (8, 4096, 14336, 4096),
    "qwen3_fc1": (128, 512, 2048, 1536),
    "qwen3_fc2": (128, 512, 768, 2048),
    "long_k": (4, 1024, 16384, 2048),
    # the DeepSeek-like MoE layer of benchmarks/fp8_layer.py (EP=1: 64 experts, 4096 tokens x top-8)
    "dslayer_fc1": (64, 512, 7168, 4096),
    "dslayer_fc2": (64, 512, 2048, 7168),
}


def splits_for(kind: str, E: int, rows: int, gen) -> list:
    total = E * rows
    if kind == "even":
        return [rows] * E
    weights = torch.tensor([1.0 / (i + 1) ** 0.8 for i in range(E)])
    weights = weights[torch.randperm(E, generator=gen)]
    weights[0] = 0.0  # an empty expert
    sizes = [int(round(w / weights.sum().item() * total / 128)) * 128 for w in weights.tolist()]
    sizes[int(torch.argmax(weights))] += total - sum(sizes)
    return sizes


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def reference(direction, xq, wq, dyq, sizes):
    """float32 per-expert GEMMs of the dequantized operands (what the kernels multiply)."""
    f32 = torch.float32
    if direction == "fwd":
        a, b = xq.dequantize(f32, usage="rowwise"), wq.source.dequantize(f32, usage="rowwise")
    elif direction == "dgrad":
        a, b = dyq.dequantize(f32, usage="rowwise"), wq.source.dequantize(f32, usage="columnwise")
    else:
        a, b = xq.dequantize(f32, usage="columnwise"), dyq.dequantize(f32, usage="columnwise")
    out, start = [], 0
    for e, s in enumerate(sizes):
        if direction == "fwd":
            out.append(a[start:start + s] @ b[e].t())
        elif direction == "dgrad":
            out.append(a[start:start + s] @ b[e])
        else:
            out.append((b[start:start + s].t() @ a[start:start + s]).unsqueeze(0))
        start += s
    return torch.cat(out, 0)


def run_shape(name, split, args, gen):
    E, rows, Kin, N = SHAPES[name]
    sizes = splits_for(split, E, rows, gen)
    T = sum(sizes)
    dev = torch.device("cuda")
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(T, Kin, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kin, device=dev, dtype=torch.bfloat16) / math.sqrt(Kin)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    out = []
    quantized = {}
    for label, recipe in (("block", R.Float8BlockScaling()), ("tensor", R.Float8CurrentScaling(fp8_format=R.Format.HYBRID))):
        qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
        quantized[label] = (qi(x, rowwise=True, columnwise=True),
                            K.prepare_quantized_weight(qw(w, rowwise=True, columnwise=True)),
                            qg(dy, rowwise=True, columnwise=True))
    w_EKN = w.transpose(1, 2)
    calls = {
        "fwd": (2 * T * Kin * N,
                lambda q, b=None: K.grouped_mm_quantized_forward(q[0], q[1], offs, group_sizes=sizes, backend=b),
                lambda: K.grouped_mm_forward(x, w_EKN, offs, group_sizes=sizes)),
        "dgrad": (2 * T * Kin * N,
                  lambda q, b=None: K.grouped_mm_quantized_dgrad(q[2], q[1], offs, group_sizes=sizes, backend=b),
                  lambda: K.grouped_mm_dgrad(dy, w_EKN, offs, group_sizes=sizes)),
        "wgrad": (2 * T * Kin * N,
                  lambda q, b=None: K.grouped_mm_quantized_wgrad(q[0], q[2], offs, num_groups=E, group_sizes=sizes,
                                                                 backend=b),
                  lambda: K.grouped_mm_wgrad(x, dy, offs, num_groups=E)),
    }
    torch_fp8 = _torch_rowwise(x, w, dy, offs) if hasattr(torch, "_scaled_grouped_mm") else {}
    for direction, (flops, quant_call, bf16_call) in calls.items():
        if direction not in args.dirs.split(","):
            continue
        row = {"shape": name, "split": split, "dir": direction, "E": E, "T": T, "K": Kin, "N": N}
        for label in ("block", "tensor"):
            q = quantized[label]
            got = quant_call(q)
            if label == "block":
                emu = {"fwd": lambda: K.grouped_mm_quantized_forward(q[0], q[1], offs, backend="emulated"),
                       "dgrad": lambda: K.grouped_mm_quantized_dgrad(q[2], q[1], offs, backend="emulated"),
                       "wgrad": lambda: K.grouped_mm_quantized_wgrad(q[0], q[2], offs, num_groups=E,
                                                                     backend="emulated")}[direction]()
                row["err_vs_emulated"] = rel(got, emu)
                row["err_vs_fp32"] = rel(got, reference(direction, q[0], q[1], q[2], sizes))
                row["bf16_err_vs_fp32"] = rel(emu, reference(direction, q[0], q[1], q[2], sizes))
                del emu
            row[f"fp8_{label}"] = flops / bench(lambda: quant_call(q)) / 1e9
            row[f"{label}_pick"] = "loop" if fp8_selection.loop_wins(T, Kin, N, E, label == "block") else "grouped"
            # the size rule only (the selector's other conditions hold on these shapes); the backend it
            # did not pick is timed on the same call too, for the A/B
            if row[f"{label}_pick"] == "loop":
                row[f"{label}_grouped"] = flops / bench(lambda: quant_call(q, "cutlass")) / 1e9
            else:
                try:
                    row[f"{label}_loop"] = flops / bench(lambda: quant_call(q, "loop")) / 1e9
                except ValueError as exc:  # the loop cannot run this call (e.g. a block contraction)
                    print(f"{name} {split} {direction} {label}: no loop: {exc}")
            if label == "tensor":
                def tables(q=q, call=quant_call):
                    with scale_tables():
                        return call(q, "cutlass")

                row["tensor_tables"] = flops / bench(tables) / 1e9
                row["tensor_vs_tables_err"] = rel(got, tables())
            if args.sweep:  # block configs as c<id>, tensor-scaled ones as t<id>; *_err: vs the default's result
                from cutlass_kernels import fp8_block

                for config in (int(c) for c in args.sweep.split(",")):
                    if not fp8_block.config_fits(direction, config, label == "tensor"):
                        continue
                    column = f"{'t' if label == 'tensor' else 'c'}{config}"
                    fp8_block.CONFIG_OVERRIDE = config
                    try:
                        row[f"{column}_err"] = rel(quant_call(q, "cutlass"), got)
                        row[column] = flops / bench(lambda: quant_call(q, "cutlass")) / 1e9
                    except Exception as exc:
                        print(f"config {config} {label} {direction}: {type(exc).__name__}: {str(exc)[:300]}")
                    finally:
                        fp8_block.CONFIG_OVERRIDE = None
        row["bf16"] = flops / bench(bf16_call) / 1e9
        if direction in torch_fp8:
            row["torch_fp8"] = flops / bench(torch_fp8[direction]) / 1e9
        out.append(row)
        print("row " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)  # a run cut by a time limit keeps what it measured
    return out


def _torch_rowwise(x, w, dy, offs):
    """torch._scaled_grouped_mm with row-wise e4m3 scales (quantization outside the timing)."""
    def rowwise(t):
        amax = t.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        scale = 448.0 / amax
        return (t.float() * scale).to(torch.float8_e4m3fn), (1.0 / scale).squeeze(-1)

    xf, xs = rowwise(x)
    wf, ws = rowwise(w)  # [E, N, K], a scale per output row
    dyf, dys = rowwise(dy)
    wt = w.transpose(1, 2).contiguous()  # [E, K, N]
    wtf, wts = rowwise(wt)
    calls = {
        "fwd": lambda: torch._scaled_grouped_mm(xf, wf.transpose(1, 2), xs, ws, offs=offs, out_dtype=torch.bfloat16),
        "dgrad": lambda: torch._scaled_grouped_mm(dyf, wtf.transpose(1, 2), dys, wts, offs=offs,
                                                  out_dtype=torch.bfloat16),
    }
    ok = {}
    for k, fn in calls.items():
        try:
            fn()
            ok[k] = fn
        except Exception as exc:  # report, keep the rest of the table
            print(f"torch._scaled_grouped_mm {k}: {type(exc).__name__}: {str(exc)[:200]}")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv3_fc1,dsv3_fc2,mixtral_fc1,mixtral_fc2,qwen3_fc1,qwen3_fc2,long_k")
    p.add_argument("--splits", default="even,ragged")
    p.add_argument("--dirs", default="fwd,dgrad,wgrad", help="the GEMM directions to time")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", default=None, help="comma-separated FP8 tile configs to time, block (c<id>) and tensor-scaled (t<id>)")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        for split in args.splits.split(","):
            rows += run_shape(name, split, args, gen)
            torch.cuda.empty_cache()
    print(f"\nFP8 grouped GEMM on {torch.cuda.get_device_name()} (torch {torch.__version__}), TFLOP/s")
    head = (f"{'shape':<12} {'split':<7} {'dir':<6} {'fp8 block':>9} {'other':>7} {'fp8 tensor':>10} {'other':>7} "
            f"{'tables':>7} {'bf16':>7} "
            f"{'torch fp8':>9} {'blk/bf16':>8} {'ten/tables':>10} {'err/emu':>8} {'err/fp32':>8} {'bf16 emu/fp32':>13}")
    print(head)
    for r in rows:
        tf = r.get("torch_fp8")
        bg, tg = (r.get(f"{label}_grouped", r.get(f"{label}_loop")) for label in ("block", "tensor"))
        print(f"{r['shape']:<12} {r['split']:<7} {r['dir']:<6} {r['fp8_block']:9.0f} {(f'{bg:7.0f}' if bg else '      -')} "
              f"{r['fp8_tensor']:10.0f} {(f'{tg:7.0f}' if tg else '      -')} "
              f"{r['tensor_tables']:7.0f} {r['bf16']:7.0f} {(f'{tf:9.0f}' if tf else '        -')} "
              f"{r['fp8_block'] / r['bf16']:8.2f} {r['fp8_tensor'] / r['tensor_tables']:10.2f} {r['err_vs_emulated']:8.1e} "
              f"{r['err_vs_fp32']:8.1e} {r['bf16_err_vs_fp32']:13.1e}")
    if args.sweep:
        for label, letter in (("block", "c"), ("tensor", "t")):
            configs = [f"{letter}{c}" for c in args.sweep.split(",")]
            print(f"\n{label}-scaled operands per tile config (TFLOP/s; err: largest relative difference from auto's result):")
            print(f"{'shape':<12} {'split':<7} {'dir':<6} " + " ".join(f"{c:>7}" for c in configs) + f" {'auto':>7} {'err':>8}")
            for r in rows:
                err = max((r.get(f"{c}_err", 0.0) for c in configs), default=0.0)
                print(f"{r['shape']:<12} {r['split']:<7} {r['dir']:<6} " + " ".join(f"{r.get(c, 0):7.0f}" for c in configs)
                      + f" {r[f'fp8_{label}']:7.0f} {err:8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
