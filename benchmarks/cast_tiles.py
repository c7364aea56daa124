"""Tile sweep for the fused Triton casts: time each candidate tile of one kernel family on CUDA.

    python benchmarks/cast_tiles.py                 # 8192x8192 bf16 on the current GPU
    python benchmarks/cast_tiles.py --rows 4096 --cols 14336

Why: the tiles in ``te_dist/quantization/triton_casts.py`` (``_PT_*``, ``_ROWS_TILE``, ``_TILE``,
``_ROWCOL_SPLIT``) and ``triton_nvfp4.py`` (``_NVFP4_ROWS``, ``_NVFP4_2D``, ``_TILE_AMAX``)
were picked on one H200; this script re-measures the alternatives, in interleaved rounds so drift hits
every candidate alike, after checking that every candidate gives the same bytes as the current tile.
It prints one table per family: kernel time, GB/s (input read + outputs written) and the ratio to a
device-to-device copy of x measured in the same run. Each round replays ``--iters`` calls captured
in one CUDA graph (the copy too), so the host's launch cost, which is larger than some of these
kernels on a slow host, does not hide the kernels' differences. The stochastic-rounding family
reseeds torch's CPU generator before each call so that every tile draws the same noise.
"""

from __future__ import annotations

import argparse
import statistics

import torch

_E4M3 = (torch.float8_e4m3fn, 448.0)
_ONE = {}


def _one(x):
    """A cached device scalar 1.0 (creating it per call would time a host-to-device copy)."""
    if x.device not in _ONE:
        _ONE[x.device] = torch.ones((), device=x.device)
    return _ONE[x.device]


def _rowcol(group: int, split: bool):
    def call(tc, x):
        old = tc._ROWCOL_SPLIT[group]
        tc._ROWCOL_SPLIT[group] = split
        try:
            if group == 128:
                return tc.cast_fp8_blocks(x, 1, 128, *_E4M3, True, columnwise=True)
            return tc.cast_mxfp8(x, *_E4M3, 8, 0, columnwise=True)
        finally:
            tc._ROWCOL_SPLIT[group] = old

    return call


_T128 = [(1, 64, 4), (1, 32, 4), (2, 32, 4), (2, 64, 4), (1, 64, 2), (1, 32, 2), (4, 32, 4)]
_T32 = [(8, 32, 4), (4, 32, 4), (16, 32, 4), (8, 32, 2), (4, 32, 2)]
FAMILIES = {
    # family: (table attribute, candidates, call(tc, x))
    "current scaling (per-tensor)": ("_PT", [(2048, 4, 4), (4096, 2, 8), (1024, 4, 4)],
                                     lambda tc, x: tc.current_scaling_quantize(x, *_E4M3, False)),
    "delayed cast+amax (per-tensor)": ("_PT", [(2048, 4, 4), (4096, 2, 8), (1024, 4, 4)],
                                       lambda tc, x: tc.cast_and_amax(x, _one(x), *_E4M3)),
    "1x128 rowwise": ("_ROWS_TILE[128]", [(16, 4, 4), (16, 8, 4), (16, 1, 4), (8, 8, 4)],
                      lambda tc, x: tc.cast_fp8_blocks(x, 1, 128, *_E4M3, True)),
    "1x128 row+col, one pass": ("_TILE[(128, False)]", _T128, _rowcol(128, False)),
    "1x128 row+col, rows kernel + columns pass": ("_TILE[(128, False)]", _T128, _rowcol(128, True)),
    "mxfp8 rowwise": ("_ROWS_TILE[32]", [(64, 4, 4), (128, 2, 8), (64, 1, 4)],
                      lambda tc, x: tc.cast_mxfp8(x, *_E4M3, 8, 0)),
    "mxfp8 row+col, one pass": ("_TILE[(32, False)]", _T32, _rowcol(32, False)),
    "mxfp8 row+col, rows kernel + columns pass": ("_TILE[(32, False)]", _T32, _rowcol(32, True)),
    "nvfp4 1x16": ("_NVFP4_ROWS", [(128, 4, 4), (128, 2, 4), (128, 8, 4), (64, 8, 2), (256, 2, 8), (256, 4, 8)],
                   lambda tc, x: tc.cast_nvfp4(x, 1, False)),
    "nvfp4 16x16": ("_NVFP4_2D", [(128, 4), (64, 2), (256, 8), (32, 1), (64, 4)],
                    lambda tc, x: tc.cast_nvfp4(x, 16, False)),
    "nvfp4 16x16, its amax pass": ("_TILE_AMAX", [(128, 4), (64, 2), (32, 1), (256, 8), (64, 4)],
                                   lambda tc, x: tc.cast_nvfp4(x, 16, False)),
    "nvfp4 1x16 SR": ("_NVFP4_ROWS", [(128, 4, 4), (128, 2, 4), (128, 8, 4), (64, 8, 2), (256, 2, 8), (256, 4, 8)],
                      lambda tc, x: (torch.default_generator.manual_seed(1), tc.cast_nvfp4(x, 1, True))[1]),
    "128x128 rowwise": ("_TILE[(128, True)]", _T128, lambda tc, x: tc.cast_fp8_blocks(x, 128, 128, *_E4M3, True)),
    "128x128 row+col": ("_TILE[(128, True)]", _T128,
                        lambda tc, x: tc.cast_fp8_blocks(x, 128, 128, *_E4M3, True, columnwise=True)),
}


class _Kernels:
    """Both kernel modules under one name: an attribute resolves in triton_casts, then triton_nvfp4."""

    def __init__(self):
        from te_dist.quantization import triton_casts, triton_nvfp4

        object.__setattr__(self, "_modules", (triton_casts, triton_nvfp4))

    def _owner(self, name: str):
        for module in self._modules:
            if hasattr(module, name):
                return module
        raise AttributeError(name)

    def __getattr__(self, name: str):
        return getattr(self._owner(name), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._owner(name), name, value)


def _table(tc, attr: str):
    """'_ROWS_TILE[128]' -> (tc._ROWS_TILE, 128); '_TILE[(32, False)]' -> (tc._TILE, (32, False))."""
    import ast

    name, key = attr[:-1].split("[", 1)
    return getattr(tc, name), ast.literal_eval(key)


def _set(tc, attr: str, value) -> None:
    if attr == "_PT":
        tc._PT_BLOCK, tc._PT_ITERS, tc._PT_WARPS = value
    elif "[" not in attr:
        setattr(tc, attr, value)
    else:
        table, key = _table(tc, attr)
        table[key] = value


def _get(tc, attr: str):
    if attr == "_PT":
        return (tc._PT_BLOCK, tc._PT_ITERS, tc._PT_WARPS)
    if "[" not in attr:
        return getattr(tc, attr)
    table, key = _table(tc, attr)
    return table[key]


def _nbytes(out) -> int:
    tensors = out if isinstance(out, tuple) else (out,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _capture(fn, iters: int) -> torch.cuda.CUDAGraph:
    """``iters`` calls of fn in one CUDA graph (after a warm-up call outside it)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return graph


def _replay(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Seconds per call of one replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default="", help="families whose name contains this text")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cast_tiles.py times Triton kernels on a GPU; no CUDA device here")
    tc = _Kernels()

    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy_graph = _capture(lambda: dst.copy_(x), args.iters)
    copy_s = statistics.median(_replay(copy_graph, args.iters) for _ in range(args.rounds))
    copy_gbs = 2 * x.numel() * x.element_size() / copy_s / 1e9
    print(f"device={torch.cuda.get_device_name()} x={args.rows}x{args.cols} bf16, copy {copy_s * 1e6:.1f} us "
          f"({copy_gbs:.0f} GB/s); median of {args.rounds} interleaved rounds x {args.iters} calls")
    for family, (attr, candidates, call) in FAMILIES.items():
        if args.only not in family:
            continue
        current = _get(tc, attr)
        if current not in candidates:
            candidates = [current, *candidates]
        reference = [t.clone() for t in call(tc, x) if isinstance(t, torch.Tensor)]
        ok, times = [], {c: [] for c in candidates}
        try:
            for cand in candidates:  # build and check every candidate first
                _set(tc, attr, cand)
                got = [t for t in call(tc, x) if isinstance(t, torch.Tensor)]
                same = all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                                       if b.element_size() == 1 else b) for a, b in zip(got, reference))
                if same:
                    ok.append(cand)
                else:
                    print(f"  {family} {cand}: output differs from the current tile, skipped")
            graphs = {}
            for cand in ok:
                _set(tc, attr, cand)
                graphs[cand] = _capture(lambda: call(tc, x), args.iters)
            for _ in range(args.rounds):
                for cand in ok:
                    times[cand].append(_replay(graphs[cand], args.iters))
            del graphs
        finally:
            _set(tc, attr, current)
        moved = x.numel() * x.element_size() + _nbytes(call(tc, x))
        print(f"\n{family} ({attr} = {current} now)\n| tile | us | GB/s | vs copy |\n|---|---|---|---|")
        for cand in ok:
            t = statistics.median(times[cand])
            mark = " (current)" if cand == current else ""
            print(f"| {cand}{mark} | {t * 1e6:.1f} | {moved / t / 1e9:.0f} | {moved / t / 1e9 / copy_gbs:.2f} |")


if __name__ == "__main__":
    main()
