"""Host time of the token dispatch and combine (EP size 1) with the expert rows padded for the native
FP8 GEMMs, against the same dispatch unpadded.

    python benchmarks/dispatch_host_time.py [--tokens 8192] [--top-k 8] [--experts 128] [--hidden 2048]
        [--alignments none,16,128,16:torch,128:torch] [--rounds 5] [--calls 20] [--device cuda]

Why: a padded MoE step is host-bound on the Qwen3-like layer (docs/benchmarks.md "FP8 expert MLP"):
the padding (16 rows for per-tensor FP8, 128 for Float8BlockScaling) must cost the host little over the
unpadded dispatch. Times ``--calls`` forward+backward passes of dispatch -> probability scale ->
combine queued back to back (``time.perf_counter``, one sync after the timed region; median of
``--rounds``, alignments interleaved). Columns: host µs per pass, the ratio to the unpadded pass in the
same run, and the top-level torch ops of one forward (torch.profiler). An alignment with the suffix
``:torch`` builds the padding maps with torch ops instead of the Triton kernels (the A/B of those kernels;
without Triton, or on the CPU, both rows run torch ops).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from te_dist.moe import padding
from te_dist.moe.transports.all_to_all import AllToAllDispatcher


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--alignments", default="none,16,128,16:torch,128:torch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    probs, indices = torch.randn(args.tokens, args.experts, device=device).softmax(-1).topk(args.top_k)
    probs = probs.to(dtype).requires_grad_(True)
    grad = torch.randn_like(x)
    dispatcher = AllToAllDispatcher(args.experts)
    alignments = args.alignments.split(",")

    def forward(name):
        rows, _, option = name.partition(":")
        padding.USE_TRITON = option != "torch"
        alignment = None if rows == "none" else int(rows)
        x_NH, _, probs_N, state = dispatcher.dispatch(x, probs, indices, probs_in_expert=True, row_alignment=alignment)
        return dispatcher.combine(x_NH * probs_N[:, None], state)

    def one_pass(alignment):
        forward(alignment).backward(grad)

    for a in alignments:  # warm-up: Triton compiles, allocator pools
        for _ in range(3):
            one_pass(a)
    sync()
    times = {a: [] for a in alignments}
    for _ in range(args.rounds):
        for a in alignments:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                one_pass(a)
            times[a].append((time.perf_counter() - t0) / args.calls * 1e6)
            sync()
    ops = {}
    for a in alignments:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward(a)
            sync()
        ops[a] = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"dispatch+combine forward+backward, EP size 1, T {args.tokens} x top-{args.top_k}, {args.experts} experts, "
          f"H {args.hidden} ({name}, torch {torch.__version__})")
    print(f"{'alignment':>10} {'host µs':>9} {'vs none':>8} {'fwd ops':>8}")
    base = statistics.median(times[alignments[0]])
    for a in alignments:
        med = statistics.median(times[a])
        print(f"{a:>10} {med:9.0f} {med / base:7.2f}x {ops[a]:8d}")


if __name__ == "__main__":
    main()
