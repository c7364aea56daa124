"""``te-dist tune --shapes FILE`` (also ``python -m cutlass_kernels tune``): measure the grouped-GEMM
choices ahead of time.

Why: a run's first call of a shape bucket measures its candidates (te_dist.gemm.measure)
within a budget; tuning the run's shapes before it starts moves that cost out of the job and
lifts the budget (each bucket gets ``--bucket-ms``). The choices land in the same file the run
reads (``<kernel cache>/autotune/``), so build the tiles first (``python -m cutlass_kernels``):
only built tiles are timed. It lives here, not in ``cutlass_kernels``, because it measures through
``te_dist.kernels``: the kernel package stays a leaf that imports nothing of te_dist.

Shapes file: JSON (a list of objects, or ``{"shapes": [...]}``) or CSV with a header row, one
GEMM per row::

    direction,E,K,N,rows_per_expert,ragged
    fwd,8,4096,14336,512,false
    all,32,2880,5760,128,true          # all = fwd, dgrad and wgrad

K = in-features, N = out-features of the expert weight [E, N, K] (dgrad reads it the other way).
Ragged rows get Zipf-skewed group sizes with empty experts (:func:`zipf_splits`), even rows the
same size everywhere; both pass the sizes on the host, as the MoE layer does.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from pathlib import Path
from typing import List, NamedTuple

__all__ = ["Shape", "DIRECTIONS", "read_shapes", "parse_shapes", "zipf_splits", "add_arguments", "run", "main"]

DIRECTIONS = ("fwd", "dgrad", "wgrad")


class Shape(NamedTuple):
    direction: str
    num_experts: int
    k: int
    n: int
    rows_per_expert: int
    ragged: bool


def _flag(value, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "ragged"):
        return True
    if text in ("0", "false", "no", "even", ""):
        return False
    raise ValueError(f"{where}: ragged must be true/false, received {value!r}")


def _positive(row: dict, name: str, where: str, minimum: int = 1) -> int:
    aliases = {"E": ("E", "num_experts", "experts"), "rows_per_expert": ("rows_per_expert", "rows", "m")}
    for alias in aliases.get(name, (name,)):
        if alias in row:
            value = row[alias]
            break
    else:
        raise ValueError(f"{where}: missing {name!r} (columns: direction, E, K, N, rows_per_expert, ragged)")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{where}: {name} must be an integer, received {value!r}") from None
    if number < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, received {number}")
    return number


def parse_shapes(rows: List[dict], source: str = "shapes") -> List[Shape]:
    """Shapes from row dicts (see the module docstring); errors name the row and the column."""
    shapes = []
    for i, row in enumerate(rows, 1):
        where = f"{source} row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with direction, E, K, N, rows_per_expert, ragged; "
                             f"received {row!r}")
        direction = str(row.get("direction", "all")).strip().lower()
        if direction not in DIRECTIONS + ("all",):
            raise ValueError(f"{where}: direction must be one of {DIRECTIONS + ('all',)}, received {direction!r}")
        dims = (_positive(row, "E", where), _positive(row, "K", where), _positive(row, "N", where),
                _positive(row, "rows_per_expert", where, minimum=0))
        ragged = _flag(row.get("ragged", False), where)
        for d in DIRECTIONS if direction == "all" else (direction,):
            shapes.append(Shape(d, *dims, ragged))
    return shapes


def read_shapes(path) -> List[Shape]:
    """Shapes from a .json or .csv file (anything else is read as CSV)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() == ".json":
        data = json.loads(text)
        rows = data.get("shapes") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of shapes or {{\"shapes\": [...]}}")
    else:
        rows = list(csv.DictReader(line for line in text.splitlines() if line.strip() and not line.startswith("#")))
        rows = [{k.strip(): v.split("#")[0].strip() for k, v in r.items() if k is not None and v is not None}
                for r in rows]
    return parse_shapes(rows, str(path))


def zipf_splits(num_experts: int, rows_per_expert: int, *, s: float = 1.2, seed: int = 0) -> List[int]:
    """Zipf-skewed rows per expert summing to ``num_experts * rows_per_expert``: expert shares
    1/rank^s in a seeded order, and the least-loaded eighth of the experts (one of four or more)
    left empty, as a router gives them early in training."""
    total = num_experts * rows_per_expert
    num_empty = num_experts // 8 if num_experts >= 8 else (1 if num_experts >= 4 else 0)
    busy = num_experts - num_empty
    weights = [1.0 / (r + 1) ** s for r in range(busy)]
    scale = total / sum(weights)
    sizes = [int(w * scale) for w in weights]
    for r in range(total - sum(sizes)):  # the remainder, one row each to the heaviest experts
        sizes[r % busy] += 1
    sizes += [0] * num_empty
    random.Random(seed).shuffle(sizes)
    return sizes


def _tune_one(shape: Shape, device) -> str:
    """Run the shape once through te_dist.kernels: the call's miss measures and writes the file."""
    import torch

    from . import kernels

    E, K, N, m = shape.num_experts, shape.k, shape.n, shape.rows_per_expert
    sizes = zipf_splits(E, m) if shape.ragged else [m] * E
    T = sum(sizes)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=device, dtype=torch.bfloat16) / K ** 0.5).transpose(1, 2)
    off = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    if shape.direction == "fwd":
        kernels.grouped_mm_forward(x, w, off, group_sizes=sizes)
    elif shape.direction == "dgrad":
        kernels.grouped_mm_dgrad(torch.randn(T, N, device=device, dtype=torch.bfloat16), w, off, group_sizes=sizes)
    else:
        kernels.grouped_mm_wgrad(x, torch.randn(T, N, device=device, dtype=torch.bfloat16), off, num_groups=E,
                                 group_sizes=sizes)
    torch.cuda.synchronize()
    return kernels.describe_choice(shape.direction, x, w, group_sizes=sizes)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command's options (``te-dist tune`` and ``python -m te_dist.tune`` share them)."""
    ap.add_argument("--shapes", required=True, help="JSON or CSV file of shapes (see te_dist/tune.py)")
    ap.add_argument("--bucket-ms", type=float, default=500.0, help="timed GPU ms per shape bucket (default 500)")
    ap.add_argument("--device", default="cuda", help="CUDA device to tune on (default: the current one)")


def run(args: argparse.Namespace) -> int:
    """Tune every shape of ``args.shapes``; 2 where the file is bad or there is no CUDA device."""
    try:
        shapes = read_shapes(args.shapes)
    except (OSError, ValueError) as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return 2

    import torch

    from .gemm import measure

    if not torch.cuda.is_available():
        print("tune: no CUDA device; measured choices are per GPU model, run this on the training GPU", file=sys.stderr)
        return 2
    # one call per shape, no run's calls after it: its whole bucket goes to the first call
    measure.configure(enabled=True, deterministic=False, bucket_ms=args.bucket_ms, total_ms=float("inf"))
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    print(f"tuning {len(shapes)} GEMMs on {torch.cuda.get_device_name(device)}", flush=True)
    for shape in shapes:
        print(f"{shape.direction:<6} E={shape.num_experts:<4} K={shape.k:<6} N={shape.n:<6} "
              f"rows/expert={shape.rows_per_expert:<6} {'ragged' if shape.ragged else 'even':<7} "
              f"{_tune_one(shape, device)}", flush=True)
    path = measure.tuner().save(device.index if device.index is not None else torch.cuda.current_device())
    print(f"choices written to {path}" if path else "choices kept in memory only (persisting is off)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m te_dist.tune", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
