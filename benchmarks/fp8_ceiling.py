"""What an FP8 GEMM reaches on this GPU: NVIDIA's dense kernels and the tensor cores' rate at the
clock the GPU holds, beside our grouped kernels, in one run.

    python benchmarks/fp8_ceiling.py [--shapes dsv3_fc1,dsv3_fc2,square] [--json PATH]

Why: the FP8 issue's goals for the block-scaled grouped GEMMs (1200 / 1100 / 900 TFLOP/s) need a
ceiling to be read against. Per (shape, direction) the same FLOPs run as:
  * cublas tensor / row / block  torch._scaled_mm on one dense GEMM (all experts' rows as one M, or,
                 in wgrad, all tokens as one contraction): one scale per operand; row-wise scales;
                 1x128 x 128x128 block scales (1x128 x 1x128 in wgrad), the Float8BlockScaling layout.
  * cublas tensor/e, block/e  the same, one expert at a time (the expert's rows, or in wgrad its tokens).
  * ours block 1 / ours block / ours tensor  te_dist's grouped kernels (grouped_mm_quantized_*) with
                 one group, with the shape's experts (even split), and on per-tensor operands.
  * bf16 dense   torch.mm on the same FLOPs.
Each column is timed for ~0.4 s (median of do_bench) while nvidia-smi samples the SM clock and the
power draw every 25 ms; "peak@clk" is the tensor cores' rate at the median clock of that window
(SMs x 8192 FP8 FLOP per clock, the datasheet's 1979 TFLOP/s at 1830 MHz on 132 SMs; half that for
bf16) and "of peak" the measured fraction of it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import threading
import time

import torch

from te_dist import kernels as K
from te_dist import recipe as R
from te_dist.quantization import make_quantizer

from fp8_grouped_gemm import SHAPES  # beside this file: the script's directory is on sys.path

SHAPES = dict(SHAPES, square=(1, 8192, 8192, 8192),  # and the EP=1 layers of benchmarks/fp8_layer.py:
              mixtral_layer_fc1=(8, 1024, 4096, 28672), mixtral_layer_fc2=(8, 1024, 14336, 4096),
              dsv3_layer_fc1=(64, 512, 7168, 4096), dsv3_layer_fc2=(64, 512, 2048, 7168))
FP8_FLOP_PER_CLOCK_PER_SM = 8192
E4M3_MAX = 448.0


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
    dev = torch.device("cuda")
    T = E * rows
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
    x = torch.randn(T, Kin, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, Kin, device=dev, dtype=torch.bfloat16) / math.sqrt(Kin)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    calls = {}
    for label, recipe in (("block", R.Float8BlockScaling()), ("tensor", R.Float8CurrentScaling(fp8_format=R.Format.HYBRID))):
        qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
        xq = qi(x, rowwise=True, columnwise=True)
        wq = K.prepare_quantized_weight(qw(w, rowwise=True, columnwise=True))
        dyq = qg(dy, rowwise=True, columnwise=True)
        calls[label] = {
            "fwd": lambda xq=xq, wq=wq: K.grouped_mm_quantized_forward(xq, wq, offs),
            "dgrad": lambda dyq=dyq, wq=wq: K.grouped_mm_quantized_dgrad(dyq, wq, offs),
            "wgrad": lambda xq=xq, dyq=dyq: K.grouped_mm_quantized_wgrad(xq, dyq, offs, num_groups=E),
        }[direction]
    return calls


def dense_operands(direction, T, Kin, N):
    """(a [M, C], b [N', C], b's block rows): the direction's GEMM as one dense GEMM."""
    dev = torch.device("cuda")
    r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)  # noqa: E731
    if direction == "fwd":
        return r(T, Kin), r(N, Kin) / math.sqrt(Kin), 128
    if direction == "dgrad":
        return r(T, N), r(Kin, N) / math.sqrt(N), 128
    return r(N, T), r(Kin, T), 1  # wgrad: dy^T by x^T, contracted over tokens, 1x128 on both


def timed(fn, flops, sampler, sms, flop_per_clock):
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    ms = do_bench(fn, warmup=50, rep=400, return_mode="median")
    t1 = time.time()
    clock, power = sampler.window(t0, t1)
    peak = sms * flop_per_clock * clock * 1e6 / 1e12
    return {"tflops": flops / ms / 1e9, "clock_mhz": clock, "power_w": power, "peak_at_clock": peak}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="dsv3_fc1,dsv3_fc2,square")
    p.add_argument("--directions", default="fwd,dgrad,wgrad")
    p.add_argument("--per-expert-max", type=int, default=64, help="time cuBLAS per expert up to this many experts")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sampler = ClockSampler()
    time.sleep(1.0)
    rows = []
    try:
        for name in args.shapes.split(","):
            E, per_expert, Kin, N = SHAPES[name]
            T = E * per_expert
            flops = 2 * T * Kin * N
            for direction in args.directions.split(","):
                a, b, b_rows = dense_operands(direction, T, Kin, N)
                columns = cublas_calls(a, b, b_rows)
                columns["bf16 dense"] = lambda a=a, b=b: a @ b.t()
                one = our_calls(direction, 1, T, Kin, N)
                columns["ours block 1"] = one["block"]
                if E > 1:
                    grouped = our_calls(direction, E, per_expert, Kin, N)
                    columns["ours block"], columns["ours tensor"] = grouped["block"], grouped["tensor"]
                    if E <= args.per_expert_max:
                        columns.update(per_expert_calls(direction, E, per_expert, Kin, N))
                row = {"shape": name, "dir": direction, "E": E, "T": T, "K": Kin, "N": N, "sms": sms}
                for label, fn in columns.items():
                    per_clock = FP8_FLOP_PER_CLOCK_PER_SM // (2 if label == "bf16 dense" else 1)
                    row[label] = timed(fn, flops, sampler, sms, per_clock)
                    print(f"row {name} {direction} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in row[label].items()),
                          flush=True)
                rows.append(row)
                del a, b, columns, one
                torch.cuda.empty_cache()
    finally:
        sampler.close()
    labels = ["cublas tensor", "cublas row", "cublas block", "cublas tensor/e", "cublas block/e", "ours block 1",
              "ours block", "ours tensor", "bf16 dense"]
    print(f"\nFP8 ceiling on {torch.cuda.get_device_name()} ({sms} SMs, torch {torch.__version__}): "
          "TFLOP/s (SM clock MHz, power W; of peak = TFLOP/s over the FP8 tensor-core rate at that clock)")
    print(f"{'shape':<9} {'dir':<6} " + " ".join(f"{c:>22}" for c in labels))
    for r in rows:
        cells = []
        for c in labels:
            v = r.get(c)
            cells.append(f"{'-':>22}" if v is None else
                         f"{v['tflops']:5.0f} ({v['clock_mhz']:4.0f},{v['power_w']:4.0f}) {v['tflops'] / v['peak_at_clock']:4.2f}")
        print(f"{r['shape']:<9} {r['dir']:<6} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
