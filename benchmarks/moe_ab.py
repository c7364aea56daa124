"""MoELayer steps of this tree against another revision, interleaved in one process.

Why: on the shared device hosts the same layer step moved by 5-10% between processes on one lease
(the 1024-token steps are paced by the host's Python). Two versions built with the same seed and
timed in alternating blocks inside one process see the same host and GPU noise, so their ratio
isolates the code change.

    python benchmarks/moe_ab.py --export 28613c7 .ab_base      # here, where git is: writes the
        # revision's te_dist and cutlass_kernels as .ab_base/te_dist_base, .ab_base/cutlass_kernels_base
    python benchmarks/moe_ab.py --base .ab_base --configs deepseek,mixtral --tokens 1024       # EP=1
    torchrun --nproc-per-node 2 benchmarks/moe_ab.py --base .ab_base --tokens 1024           # EP=2, NCCL

    torchrun --nproc-per-node 2 benchmarks/moe_ab.py --against-transport all_to_all --tokens 1024
        # this tree against itself on TE_DIST_EP_TRANSPORT=all_to_all (auto picks peer rows on one host)

(Carry ``.ab_base`` to the device machine; the base's kernels build into the same cache under their
own source hash.) The table gives, per config, the median ms per step over ``--blocks`` blocks of
``--steps`` steps (block order alternates), this/base, and whether the two layers' outputs were
bitwise equal after the warm-up steps (expected for refactors that keep the arithmetic). Under
torchrun each rank prints its own line; rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

TRANSPORT_ENV = "TE_DIST_EP_TRANSPORT"  # overrides MoELayer(transport=...); read on every dispatch

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8),
    "tiny": dict(hidden=64, ffn=32, experts=8, top_k=2),  # CPU check of the script
}
_KERNELS_IMPORT = 'import_module("cutlass_kernels")'


def export(ref: str, out_dir: Path) -> None:
    """Write ``ref``'s te_dist and cutlass_kernels as importable te_dist_base / cutlass_kernels_base."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "te_dist", "cutlass_kernels"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        backend = Path(tmp, "te_dist", "backends", "cutlass_backend.py")
        text = backend.read_text()
        if _KERNELS_IMPORT not in text:
            raise SystemExit(f"{ref}: te_dist/backends/cutlass_backend.py has no {_KERNELS_IMPORT}; cannot rename "
                             "its kernels package, so both sides would share this tree's kernels")
        backend.write_text(text.replace(_KERNELS_IMPORT, 'import_module("cutlass_kernels_base")'))
        for source in Path(tmp, "te_dist").rglob("*.py"):  # e.g. the peer-rows library (from cutlass_kernels.peer_rows)
            text = source.read_text()
            if "from cutlass_kernels" in text:
                source.write_text(text.replace("from cutlass_kernels", "from cutlass_kernels_base"))
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("te_dist", "cutlass_kernels"):
            target = out_dir / f"{name}_base"
            shutil.rmtree(target, ignore_errors=True)
            shutil.move(str(Path(tmp, name)), target)
    print(f"wrote {out_dir}/te_dist_base and {out_dir}/cutlass_kernels_base from {ref}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", nargs=2, metavar=("REF", "DIR"), help="write the base packages and exit")
    ap.add_argument("--base", help="directory written by --export")
    ap.add_argument("--against-transport", choices=("nccl", "peer"),
                    help="no base revision: this tree against itself with TE_DIST_EP_TRANSPORT set to this")
    ap.add_argument("--configs", default="deepseek,mixtral")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.export:
        export(args.export[0], Path(args.export[1]))
        return
    if not args.base and not args.against_transport:
        ap.error("--base DIR (write it with --export REF DIR) or --against-transport NAME is required")
    env = {"this": os.environ.get(TRANSPORT_ENV), "base": os.environ.get(TRANSPORT_ENV)}
    if args.against_transport:
        sides = {"this": importlib.import_module("te_dist")}
        sides["base"], env["base"] = sides["this"], args.against_transport
        base_name = f"{TRANSPORT_ENV}={args.against_transport}"
    else:
        sys.path.insert(0, str(Path(args.base).resolve()))
        sides = {"this": importlib.import_module("te_dist"), "base": importlib.import_module("te_dist_base")}
        base_name = args.base
    group, rank = None, 0
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        group, rank = dist.group.WORLD, dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ep = dist.get_world_size() if group is not None else 1
    rows = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        layers = {}
        for side, package in sides.items():
            torch.manual_seed(0)
            layers[side] = package.moe.MoELayer(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"],
                                                ep_group=group, dtype=dtype, device=device)
        torch.manual_seed(1 + rank)
        x = torch.randn(args.tokens, cfg["hidden"], dtype=dtype, device=device, requires_grad=True)
        g = torch.randn_like(x)

        def step(side):
            layer = layers[side]
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            if env[side] is None:
                os.environ.pop(TRANSPORT_ENV, None)
            else:
                os.environ[TRANSPORT_ENV] = env[side]
            out = layer(x)
            out.backward(g)
            return out

        outs = {}
        for side in layers:  # warm-up (kernel builds, compiles), then compare outputs
            for _ in range(3):
                outs[side] = step(side).detach()
        equal = torch.equal(outs["this"], outs["base"])
        times = {side: [] for side in layers}
        for block in range(args.blocks):
            for side in (("this", "base") if block % 2 == 0 else ("base", "this")):
                if group is not None:
                    dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(side)
                sync()
                times[side].append((time.perf_counter() - t0) / args.steps * 1e3)
        this, base = statistics.median(times["this"]), statistics.median(times["base"])
        print(f"rank {rank} {name} EP={ep}: this " + " ".join(f"{t:.2f}" for t in times["this"])
              + " | base " + " ".join(f"{t:.2f}" for t in times["base"]), flush=True)
        rows.append((name, this, base, equal))
        layers = outs = None  # free the two layers before the next config
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"\nMoE layer fwd+bwd, this tree vs {base_name}, EP={ep}, {args.tokens} tokens/rank, {dtype}, "
              f"{args.blocks} blocks x {args.steps} steps, median ms per step")
        print("| config | this ms | base ms | this/base | outputs equal |\n|---|---|---|---|---|")
        for name, this, base, equal in rows:
            print(f"| {name} | {this:.3f} | {base:.3f} | {this / base:.3f} | {equal} |")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
