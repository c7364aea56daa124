"""FP8 GEMMs on one GPU: our grouped kernels per scaling against bf16, torch's row-wise FP8 and cuBLAS.

    python benchmarks/fp8_gemm.py grouped [--shapes dsv3_fc1,dsv3_fc2,...] [--splits even,ragged]
                                          [--dirs fwd,dgrad,wgrad] [--json PATH]
    python benchmarks/fp8_gemm.py ceiling [--shapes dsv3_fc1,dsv3_fc2,square] [--json PATH]
    python benchmarks/fp8_gemm.py tiles [--shapes dslayer_fc1,...] [--scalings tensor,block] [--instances]

``grouped``, one row per (shape, split, direction), TFLOP/s (median of do_bench; quantization outside
the timing, as the layer quantizes once per tensor):
  * block / tensor  ``te_dist.kernels.grouped_mm_quantized_*`` on Float8BlockScaling operands (1x128
                activations and gradients, 128x128 weights) and on Float8CurrentScaling ones (HYBRID),
                the group sizes given: our CUTLASS SM90 kernels, or cuBLAS per expert where the selector
                picks it (te_dist/gemm/decide.py); "other" = the backend not picked, forced.
  * bf16        ``te_dist.kernels.grouped_mm_*`` on the bf16 operands.
  * torch fp8   ``torch._scaled_grouped_mm`` with row-wise e4m3 scales (fwd and dgrad), as a user calls it.
  * err         the native block result against the emulated one (dequantize, bf16 GEMM) and against a
                float32 GEMM of the dequantized operands (relative Frobenius).
``tiles``: every FP8 tile of cutlass_kernels.heuristics.FP8_CONFIGS that fits the call, forced per call
(``te_dist.settings.fp8_tile``), on our grouped kernels (never the per-expert loop), TFLOP/s interleaved in one
process (``timing.interleaved_ms``), beside the rule's own tile (fast accumulation off); ``err``: the best and the
rule's tile against float32 GEMMs of the same quantized values (relative Frobenius). ``--instances`` prints the
instance names the sweep needs (to build them ahead: ``python -m cutlass_kernels --jobs 16 --only ...``). Tensor
scales use Float8CurrentScaling (HYBRID).
Splits: "even", and "ragged" (Zipf-like sizes, an empty expert, every size a multiple of 128 as the
layer pads them).

``ceiling``: what an FP8 GEMM reaches on this GPU. Per (shape, direction) the same FLOPs as
torch._scaled_mm on one dense GEMM (tensor, row-wise and 1x128 x 128x128 block scales), the same one
expert at a time (``/e``), our grouped kernels with one group and with the shape's experts, and bf16
torch.mm. Each column runs ~0.4 s while nvidia-smi samples the SM clock and power every 25 ms; "of
peak" is the TFLOP/s over the tensor cores' rate at that window's median clock (SMs x 8192 FP8 FLOP
per clock; half for bf16).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import threading
import time

import torch

import timing

SHAPES = {  # name: (experts, rows per expert, K in, N out)
    "dsv3_fc1": (32, 1024, 7168, 4096),
    "dsv3_fc2": (32, 1024, 2048, 7168),
    "mixtral_fc1": (8, 4096, 4096, 28672),
    "mixtral_fc2": (8, 4096, 14336, 4096),
    "qwen3_fc1": (128, 512, 2048, 1536),
    "qwen3_fc2": (128, 512, 768, 2048),
    "long_k": (4, 1024, 16384, 2048),
    # the EP=1 MoE layers of benchmarks/fp8_layer.py (4096 tokens)
    "dslayer_fc1": (64, 512, 7168, 4096),
    "dslayer_fc2": (64, 512, 2048, 7168),
    "mixtral_layer_fc1": (8, 1024, 4096, 28672),
    "mixtral_layer_fc2": (8, 1024, 14336, 4096),
    "square": (1, 8192, 8192, 8192),
    "qwen235_layer_fc1": (128, 512, 4096, 3072),
    "qwen235_layer_fc2": (128, 512, 1536, 4096),
    "gptoss_layer_fc1": (32, 512, 2880, 5760),
    "gptoss_layer_fc2": (32, 512, 2880, 2880),
    "decode_fc1": (64, 64, 7168, 4096),
    # te-dist train --config launchers/configs/deepseek_like.yaml: 32768 tokens x top-8 over 64 experts
    "dstrain_fc1": (64, 4096, 2048, 2048),
    "dstrain_fc2": (64, 4096, 1024, 2048),
}
FP8_FLOP_PER_CLOCK_PER_SM = 8192
E4M3_MAX = 448.0


def splits_for(kind: str, E: int, rows: int, gen) -> list:
    if kind == "even":
        return [rows] * E
    weights = torch.tensor([1.0 / (i + 1) ** 0.8 for i in range(E)])
    weights = weights[torch.randperm(E, generator=gen)]
    weights[0] = 0.0  # an empty expert
    sizes = [int(round(w / weights.sum().item() * E * rows / 128)) * 128 for w in weights.tolist()]
    sizes[int(torch.argmax(weights))] += E * rows - sum(sizes)
    return sizes


def quantized_operands(x, w, dy, labels=("block", "tensor")):
    """{"block": (xq, wq, dyq), "tensor": (...)} of ``labels``: both copies of every operand, the weight prepared."""
    from te_dist import kernels as K
    from te_dist import recipe as R
    from te_dist.quantization import make_quantizer

    out = {}
    for label, rec in (("block", R.Float8BlockScaling()),
                       ("tensor", R.Float8CurrentScaling(fp8_format=R.Format.HYBRID))):
        if label not in labels:
            continue
        qi, qw, qg = (make_quantizer(rec, role) for role in ("input", "weight", "grad_output"))
        out[label] = (qi(x, rowwise=True, columnwise=True),
                      K.prepare_quantized_weight(qw(w, rowwise=True, columnwise=True)),
                      qg(dy, rowwise=True, columnwise=True))
    return out


def quantized_call(direction, q, offs, E, sizes=None, backend=None):
    """The quantized entry point of ``direction`` on operands ``q`` = (xq, wq, dyq)."""
    from te_dist import kernels as K

    if direction == "fwd":
        return K.grouped_mm_quantized_forward(q[0], q[1], offs, group_sizes=sizes, backend=backend)
    if direction == "dgrad":
        return K.grouped_mm_quantized_dgrad(q[2], q[1], offs, group_sizes=sizes, backend=backend)
    return K.grouped_mm_quantized_wgrad(q[0], q[2], offs, num_groups=E, group_sizes=sizes, backend=backend)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def reference(direction, xq, wq, dyq, sizes):
    """float32 per-expert GEMMs of the dequantized operands (what the kernels multiply)."""
    def dq(q, usage):  # a per-tensor operand holds the same values in both layouts
        return q.dequantize(torch.float32, usage=usage) if hasattr(q, "rowwise") else q.dequantize(torch.float32)

    if direction == "fwd":
        a, b = dq(xq, "rowwise"), dq(wq.source, "rowwise")
    elif direction == "dgrad":
        a, b = dq(dyq, "rowwise"), dq(wq.source, "columnwise")
    else:
        a, b = dq(xq, "columnwise"), dq(dyq, "columnwise")
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


def _torch_rowwise(x, w, dy, offs):
    """torch._scaled_grouped_mm with row-wise e4m3 scales (quantization outside the timing)."""
    def rowwise(t):
        amax = t.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        return (t.float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn), (amax / E4M3_MAX).squeeze(-1)

    if not hasattr(torch, "_scaled_grouped_mm"):
        return {}
    (xf, xs), (wf, ws), (dyf, dys) = rowwise(x), rowwise(w), rowwise(dy)
    wtf, wts = rowwise(w.transpose(1, 2).contiguous())  # [E, K, N]
    calls = {"fwd": lambda: torch._scaled_grouped_mm(xf, wf.transpose(1, 2), xs, ws, offs=offs,
                                                     out_dtype=torch.bfloat16),
             "dgrad": lambda: torch._scaled_grouped_mm(dyf, wtf.transpose(1, 2), dys, wts, offs=offs,
                                                       out_dtype=torch.bfloat16)}
    ok = {}
    for k, fn in calls.items():
        try:
            fn()
            ok[k] = fn
        except Exception as exc:  # report, keep the rest of the table
            print(f"torch._scaled_grouped_mm {k}: {type(exc).__name__}: {str(exc)[:200]}")
    return ok


def shape_operands(name, split, gen):
    """(E, K, N, sizes, T, offsets, x, w [E, N, K], dy) of one shape and split: bf16 on the GPU."""
    E, rows, Kin, N = SHAPES[name]
    sizes = splits_for(split, E, rows, gen)
    T, dev = sum(sizes), torch.device("cuda")
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(T, Kin, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kin, device=dev, dtype=torch.bfloat16) / math.sqrt(Kin)
    return E, Kin, N, sizes, T, offs, x, w, torch.randn(T, N, device=dev, dtype=torch.bfloat16)


def grouped_rows(name, split, args, gen) -> list:
    from te_dist import kernels as K
    from te_dist.gemm import decide

    E, Kin, N, sizes, T, offs, x, w, dy = shape_operands(name, split, gen)
    quantized, w_EKN = quantized_operands(x, w, dy), w.transpose(1, 2)
    bf16 = {"fwd": lambda: K.grouped_mm_forward(x, w_EKN, offs, group_sizes=sizes),
            "dgrad": lambda: K.grouped_mm_dgrad(dy, w_EKN, offs, group_sizes=sizes),
            "wgrad": lambda: K.grouped_mm_wgrad(x, dy, offs, num_groups=E)}
    torch_fp8 = _torch_rowwise(x, w, dy, offs)
    flops, out = 2 * T * Kin * N, []
    for direction in args.dirs.split(","):
        row = {"shape": name, "split": split, "dir": direction, "E": E, "T": T, "K": Kin, "N": N}
        for label in ("block", "tensor"):
            q = quantized[label]
            call = lambda backend=None, q=q: quantized_call(direction, q, offs, E, sizes, backend)  # noqa: E731
            if label == "block":
                got = call()
                emulated = quantized_call(direction, q, offs, E, backend="emulated")
                exact = reference(direction, *q, sizes)
                row.update(err_vs_emulated=rel(got, emulated), err_vs_fp32=rel(got, exact),
                           bf16_err_vs_fp32=rel(emulated, exact))
                del got, emulated, exact
            row[f"fp8_{label}"] = flops / timing.do_bench_ms(call) / 1e9
            # the size rule only (the selector's other conditions hold on these shapes)
            row[f"{label}_pick"] = "loop" if decide.fp8_loop_wins(T, Kin, N, E, label == "block") else "grouped"
            other = "cutlass" if row[f"{label}_pick"] == "loop" else "loop"
            try:
                row[f"{label}_other"] = flops / timing.do_bench_ms(lambda: call(other)) / 1e9
            except ValueError as exc:  # the loop cannot run this call (e.g. a block contraction)
                print(f"{name} {split} {direction} {label}: no {other}: {exc}")
        row["bf16"] = flops / timing.do_bench_ms(bf16[direction]) / 1e9
        if direction in torch_fp8:
            row["torch_fp8"] = flops / timing.do_bench_ms(torch_fp8[direction]) / 1e9
        out.append(row)
        print("row " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)  # a run cut by a time limit keeps what it measured
    return out


def over_shapes(args, rows_of) -> list:
    """``rows_of(name, split, args, gen)`` for every ``--shapes`` x ``--splits``, from the same seeds."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        for split in args.splits.split(","):
            rows += rows_of(name, split, args, gen)
            torch.cuda.empty_cache()
    return rows


def grouped(args) -> list:
    rows = over_shapes(args, grouped_rows)
    print(f"\nFP8 grouped GEMM on {torch.cuda.get_device_name()} (torch {torch.__version__}), TFLOP/s; other: the "
          "backend the selector did not pick")
    print(f"{'shape':<12} {'split':<7} {'dir':<6} {'block':>7} {'other':>7} {'tensor':>7} {'other':>7} {'bf16':>7} "
          f"{'torch fp8':>9} {'blk/bf16':>8} {'err/emu':>8} {'err/fp32':>8} {'bf16 emu/fp32':>13}")
    cell = lambda v, width: f"{v:{width}.0f}" if v else f"{'-':>{width}}"  # noqa: E731
    for r in rows:
        print(f"{r['shape']:<12} {r['split']:<7} {r['dir']:<6} {r['fp8_block']:7.0f} {cell(r.get('block_other'), 7)} "
              f"{r['fp8_tensor']:7.0f} {cell(r.get('tensor_other'), 7)} {r['bf16']:7.0f} {cell(r.get('torch_fp8'), 9)} "
              f"{r['fp8_block'] / r['bf16']:8.2f} {r['err_vs_emulated']:8.1e} {r['err_vs_fp32']:8.1e} "
              f"{r['bf16_err_vs_fp32']:13.1e}")
    return rows


# ------------------------------------------------------------------------------------------ tiles
_SWEEP_FORMAT = {("tensor", "fwd"): "e4m3", ("tensor", "dgrad"): "e5m2", ("tensor", "wgrad"): "e5m2",
                 ("block", "fwd"): "e4m3", ("block", "dgrad"): "e4m3", ("block", "wgrad"): "e4m3"}  # A's (HYBRID)


def sweep_instances(scalings, dirs) -> list:
    """The Fp8Instance of every tile that fits each (scaling, direction) of the sweep."""
    from cutlass_kernels.fp8_block import FP8_CONFIGS, Fp8Instance, config_fits

    return [Fp8Instance(d, c, _SWEEP_FORMAT[(s, d)], tensor_scales=s == "tensor") for s in scalings for d in dirs
            for c in sorted(FP8_CONFIGS) if config_fits(d, c, s == "tensor")]


def tile_rows(name, split, args, gen) -> list:
    from te_dist import settings
    from te_dist.gemm import decide
    from cutlass_kernels.fp8_block import fp8_config

    E, Kin, N, sizes, T, offs, x, w, dy = shape_operands(name, split, gen)
    quantized, flops, out = quantized_operands(x, w, dy, args.scalings.split(",")), 2 * T * Kin * N, []
    for scaling in args.scalings.split(","):
        q = quantized[scaling]
        for direction in args.dirs.split(","):
            fns = {}
            for inst in sweep_instances([scaling], [direction]):
                def fn(c=inst.config):
                    with settings.override(fp8_tile=c):
                        return quantized_call(direction, q, offs, E, sizes, "cutlass")
                try:
                    fn()
                    fns[inst.config] = fn
                except Exception as exc:  # noqa: BLE001 - a tile that does not build or run: say so, time the rest
                    print(f"{name} {scaling} {direction} tile {inst.config}: {type(exc).__name__}: {str(exc)[:160]}")
            ms = timing.interleaved_ms(fns, iters=args.iters, warmup=3, rounds=args.rounds)
            best = min(ms, key=ms.get)
            rule = fp8_config(direction, T, E, tensor_scales=scaling == "tensor",
                              contraction=Kin if direction == "fwd" else N, columns=N if direction == "fwd" else Kin)
            exact, err = reference(direction, *q, sizes), {}
            for c in {best, rule} & set(fns):
                err[c] = rel(fns[c](), exact)
            del exact
            row = {"shape": name, "split": split, "scaling": scaling, "dir": direction, "E": E, "T": T, "K": Kin,
                   "N": N, "tflops": {c: flops / t / 1e9 for c, t in ms.items()}, "rule": rule, "best": best,
                   "best_over_rule": ms[rule] / ms[best] if rule in ms else None, "err": err,
                   "loop_picked": decide.fp8_loop_wins(T, Kin, N, E, scaling == "block")}
            out.append(row)
            print("row " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def tiles(args) -> list:
    scalings, dirs = args.scalings.split(","), args.dirs.split(",")
    if args.instances:
        print(" ".join(sorted({i.name for i in sweep_instances(scalings, dirs)})))
        return []
    from cutlass_kernels.fp8_block import FP8_CONFIGS

    rows, configs = over_shapes(args, tile_rows), sorted(FP8_CONFIGS)
    print(f"\nFP8 tiles on {torch.cuda.get_device_name()} (torch {torch.__version__}), TFLOP/s per tile (interleaved "
          f"{args.rounds} rounds); rule: heuristics.fp8_config's tile; best/rule: its speed-up")
    print(f"{'shape':<18} {'split':<6} {'scale':<6} {'dir':<6} " + "".join(f"{c:>6}" for c in configs)
          + f"{'rule':>6}{'best':>6}{'best/rule':>10}{'err best':>9}{'err rule':>9}")
    for r in rows:
        cells = "".join(f"{r['tflops'][c]:6.0f}" if c in r["tflops"] else f"{'-':>6}" for c in configs)
        gain = f"{r['best_over_rule']:10.3f}" if r["best_over_rule"] else f"{'-':>10}"
        print(f"{r['shape']:<18} {r['split']:<6} {r['scaling']:<6} {r['dir']:<6} {cells}{r['rule']:6d}{r['best']:6d}"
              f"{gain}{r['err'].get(r['best'], float('nan')):9.1e}{r['err'].get(r['rule'], float('nan')):9.1e}")
    return rows


# ------------------------------------------------------------------------------------------ ceiling
class ClockSampler:
    """nvidia-smi's SM clock (MHz) and power (W), stamped on arrival; read back per time window."""

    def __init__(self, interval_ms: int = 25):
        self.samples = []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"-lms={interval_ms}", "-i", str(torch.cuda.current_device())],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as exc:
            print(f"no clock samples: {exc}")
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), clock, power))

    def window(self, t0: float, t1: float):
        inside = [(c, p) for t, c, p in self.samples if t0 <= t <= t1]
        if not inside:
            return float("nan"), float("nan")
        return statistics.median(c for c, _ in inside), statistics.median(p for _, p in inside)

    def close(self):
        if self.proc is not None:
            self.proc.terminate()


def blockwise(t: torch.Tensor, rows: int, cols: int):
    """E4M3 data and float32 dequantization scales per (rows x cols) block of a 2-D tensor."""
    m, k = t.shape
    blocks = t.float().reshape(m // rows, rows, k // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12)
    data = (blocks * (E4M3_MAX / amax)).to(torch.float8_e4m3fn).reshape(m, k)
    return data, (amax / E4M3_MAX).reshape(m // rows, k // cols)


A_LAYOUTS = (("row-major", lambda s: s), ("M-major", lambda s: s.t().contiguous().t()))
B_LAYOUTS = (("K-major", lambda s: s.t()), ("N-major", lambda s: s.contiguous().t().contiguous()))
_block_layouts = {}  # B's scale block rows (128 or 1) -> the (A, B) scale layouts cuBLAS took


def block_mm(a8, sa, b8, sb, ref=None):
    """A zero-argument call of torch._scaled_mm(a8 [M, C], b8 [N, C]^T) with 1x128 scales ``sa``
    [M, C/128] and 128x128 or 1x128 scales ``sb`` [N or N/128, C/128], in the layouts cuBLAS takes
    (tried against ``ref`` on the first call)."""
    bf16 = torch.bfloat16
    key = b8.shape[0] // sb.shape[0]
    known = _block_layouts.get(key)
    tries = [known] if known else [(la, lb) for la in A_LAYOUTS for lb in B_LAYOUTS]
    last = "no layout tried"
    for la, lb in tries:
        sa_l, sb_l = la[1](sa), lb[1](sb)

        def call(sa_l=sa_l, sb_l=sb_l):
            return torch._scaled_mm(a8, b8.t(), sa_l, sb_l, out_dtype=bf16)
        if known:
            return call
        try:
            err = ((call().float() - ref).norm() / ref.norm()).item()
        except Exception as exc:  # noqa: BLE001 - a layout cuBLAS refuses: try the next
            last = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        if err < 1e-2:
            _block_layouts[key] = (la, lb)
            print(f"cublas block: scales {la[0]} x {lb[0]} (relative error {err:.1e})")
            return call
        last = f"wrong result (relative error {err:.2e})"
    raise RuntimeError(f"cublas block: none of the scale layouts ran: {last}")


def cublas_calls(a: torch.Tensor, b: torch.Tensor, b_block_rows: int):
    """torch._scaled_mm of a [M, C] by b [N, C] (both contracted along C), per scaling."""
    bf16 = torch.bfloat16
    calls = {}
    a8, a_s = blockwise(a, 1, a.shape[1])
    b8, b_s = blockwise(b, 1, b.shape[1])
    one = torch.ones((), device=a.device)
    calls["cublas tensor"] = lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=bf16)
    calls["cublas row"] = lambda: torch._scaled_mm(a8, b8.t(), a_s, b_s.t(), out_dtype=bf16)
    a8b, a_sb = blockwise(a, 1, 128)
    b8b, b_sb = blockwise(b, b_block_rows, 128)
    ref = a8b.float().mul(a_sb.repeat_interleave(128, 1)) @ \
        b8b.float().mul(b_sb.repeat_interleave(b_block_rows, 0).repeat_interleave(128, 1)).t()
    try:
        calls["cublas block"] = block_mm(a8b, a_sb, b8b, b_sb, ref)
    except RuntimeError as exc:
        print(exc)
    return calls


def per_expert_calls(direction, E, rows, Kin, N):
    """cuBLAS one expert at a time (what a user without grouped kernels would run): tensor- and
    block-scaled, scales made per expert in cuBLAS's layout outside the timing."""
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    T = E * rows
    bounds = [(e * rows, (e + 1) * rows) for e in range(E)]
    if direction == "wgrad":  # dy^T [N, T] and x^T [K, T], contracted over each expert's tokens
        a, b = torch.randn(N, T, device=dev, dtype=bf16), torch.randn(Kin, T, device=dev, dtype=bf16)
        pairs = [(a[:, s:t], b[:, s:t]) for s, t in bounds]
        b_rows = 1
    else:
        c, n = (Kin, N) if direction == "fwd" else (N, Kin)
        a = torch.randn(T, c, device=dev, dtype=bf16)
        w = torch.randn(E, n, c, device=dev, dtype=bf16) / math.sqrt(c)
        pairs = [(a[s:t], w[e]) for e, (s, t) in enumerate(bounds)]
        b_rows = 128
    one = torch.ones((), device=dev)
    tensor, block = [], []
    for ae, be in pairs:
        a8, b8 = blockwise(ae.contiguous(), 1, ae.shape[1])[0], blockwise(be.contiguous(), 1, be.shape[1])[0]
        tensor.append((a8, b8))
        a8b, sa = blockwise(ae.contiguous(), 1, 128)
        b8b, sb = blockwise(be.contiguous(), b_rows, 128)
        ref = None
        if b_rows not in _block_layouts:
            ref = a8b.float().mul(sa.repeat_interleave(128, 1)) @ \
                b8b.float().mul(sb.repeat_interleave(b_rows, 0).repeat_interleave(128, 1)).t()
        block.append(block_mm(a8b, sa, b8b, sb, ref))
    del a, pairs

    def run_tensor():
        for a8, b8 in tensor:
            torch._scaled_mm(a8, b8.t(), one, one, out_dtype=bf16)

    def run_block():
        for call in block:
            call()
    return {"cublas tensor/e": run_tensor, "cublas block/e": run_block}


def our_calls(direction, E, rows, Kin, N):
    """Our grouped kernels on block- and tensor-scaled operands, equal splits."""
    dev = torch.device("cuda")
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
    x = torch.randn(E * rows, Kin, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kin, device=dev, dtype=torch.bfloat16) / math.sqrt(Kin)
    dy = torch.randn(E * rows, N, device=dev, dtype=torch.bfloat16)
    return {label: (lambda q=q: quantized_call(direction, q, offs, E))
            for label, q in quantized_operands(x, w, dy).items()}


def dense_operands(direction, T, Kin, N):
    """(a [M, C], b [N', C], b's block rows): the direction's GEMM as one dense GEMM."""
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    if direction == "fwd":
        return r(T, Kin), r(N, Kin) / math.sqrt(Kin), 128
    if direction == "dgrad":
        return r(T, N), r(Kin, N) / math.sqrt(N), 128
    return r(N, T), r(Kin, T), 1  # wgrad: dy^T by x^T, contracted over tokens, 1x128 on both


def _clocked(fn, flops, sampler, sms, flop_per_clock):
    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    ms = timing.do_bench_ms(fn, warmup=50, rep=400)
    clock, power = sampler.window(t0, time.time())
    return {"tflops": flops / ms / 1e9, "clock_mhz": clock, "power_w": power,
            "peak_at_clock": sms * flop_per_clock * clock * 1e6 / 1e12}


def ceiling(args) -> list:
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sampler = ClockSampler()
    time.sleep(1.0)
    rows = []
    try:
        for name in args.shapes.split(","):
            E, per_expert, Kin, N = SHAPES[name]
            T, flops = E * per_expert, 2 * E * per_expert * Kin * N
            for direction in args.dirs.split(","):
                a, b, b_rows = dense_operands(direction, T, Kin, N)
                columns = cublas_calls(a, b, b_rows)
                columns["bf16 dense"] = lambda a=a, b=b: a @ b.t()
                columns["ours block 1"] = our_calls(direction, 1, T, Kin, N)["block"]
                if E > 1:
                    ours = our_calls(direction, E, per_expert, Kin, N)
                    columns["ours block"], columns["ours tensor"] = ours["block"], ours["tensor"]
                    if E <= args.per_expert_max:
                        columns.update(per_expert_calls(direction, E, per_expert, Kin, N))
                row = {"shape": name, "dir": direction, "E": E, "T": T, "K": Kin, "N": N, "sms": sms}
                for label, fn in columns.items():
                    per_clock = FP8_FLOP_PER_CLOCK_PER_SM // (2 if label == "bf16 dense" else 1)
                    row[label] = _clocked(fn, flops, sampler, sms, per_clock)
                    print(f"row {name} {direction} {label}: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in row[label].items()), flush=True)
                rows.append(row)
                del a, b, columns
                torch.cuda.empty_cache()
    finally:
        sampler.close()
    labels = ["cublas tensor", "cublas row", "cublas block", "cublas tensor/e", "cublas block/e", "ours block 1",
              "ours block", "ours tensor", "bf16 dense"]
    print(f"\nFP8 ceiling on {torch.cuda.get_device_name()} ({sms} SMs, torch {torch.__version__}): TFLOP/s (SM clock "
          "MHz, power W) of peak at that clock")
    print(f"{'shape':<9} {'dir':<6} " + " ".join(f"{c:>22}" for c in labels))
    for r in rows:
        cells = [f"{'-':>22}" if r.get(c) is None else f"{r[c]['tflops']:5.0f} ({r[c]['clock_mhz']:4.0f},"
                 f"{r[c]['power_w']:4.0f}) {r[c]['tflops'] / r[c]['peak_at_clock']:4.2f}" for c in labels]
        print(f"{r['shape']:<9} {r['dir']:<6} " + " ".join(cells))
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("grouped", help="our FP8 grouped GEMMs per scaling against bf16 and torch's row-wise FP8")
    p.add_argument("--shapes", default="dsv3_fc1,dsv3_fc2,mixtral_fc1,mixtral_fc2,qwen3_fc1,qwen3_fc2,long_k")
    p.add_argument("--splits", default="even,ragged")
    p = sub.add_parser("tiles", help="every FP8 tile that fits, forced per call, beside the rule's")
    p.add_argument("--shapes", default="dslayer_fc1,dslayer_fc2,qwen235_layer_fc1,qwen235_layer_fc2,qwen3_fc1,"
                   "qwen3_fc2,mixtral_layer_fc1,mixtral_layer_fc2")
    p.add_argument("--splits", default="even")
    p.add_argument("--scalings", default="tensor,block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--instances", action="store_true", help="print the instance names the sweep needs, then stop")
    p = sub.add_parser("ceiling", help="cuBLAS's dense FP8 GEMMs and the tensor cores' rate beside ours")
    p.add_argument("--shapes", default="dsv3_fc1,dsv3_fc2,square")
    p.add_argument("--per-expert-max", type=int, default=64, help="time cuBLAS per expert up to this many experts")
    for p in sub.choices.values():
        p.add_argument("--dirs", default="fwd,dgrad,wgrad", help="the GEMM directions to time")
    timing.add_json_option(*sub.choices.values())
    return parser


def _checked(run):
    def checked(args):
        unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
        if unknown:
            raise SystemExit(f"--shapes expects names of {sorted(SHAPES)}, received {unknown}")
        return run(args)
    return checked


def main(argv=None) -> int:
    return timing.run_subcommand(build_parser(), {"grouped": _checked(grouped), "ceiling": _checked(ceiling),
                                                   "tiles": _checked(tiles)},
                                 "fp8_gemm", argv)


if __name__ == "__main__":
    sys.exit(main())
