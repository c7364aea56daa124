"""torchrun worker: amax reduction across ranks for DelayedScaling and an explicit current-scaling group.

Every rank holds different data (amax = 2 * (rank + 1)); prints one RESULT line as JSON.
"""

import json
import os

import torch
import torch.distributed as dist

import te_dist.distributed  # noqa: F401  (its exit hook: no SIGABRT after the last gloo collective)
from te_dist import recipe as R
from te_dist.quantization import make_quantizer


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    x = torch.tensor([2.0 * (rank + 1), -1.0])
    recipe = R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=4)

    reduced = make_quantizer(recipe, "input", group=group)
    reduced(x)
    local = make_quantizer(R.DelayedScaling(fp8_format=R.Format.E4M3, reduce_amax=False), "input", group=group)
    local(x)
    no_group = make_quantizer(recipe, "input")
    no_group(x)
    current = make_quantizer(R.Float8CurrentScaling(fp8_format=R.Format.E4M3), "input", group=group)(x)
    subgroup = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group; one-rank group: no collective
    single = make_quantizer(recipe, "input", group=subgroup) if world > 1 else None
    if single is not None:
        single(x)

    result = {
        "rank": rank,
        "world": world,
        "reduced_scale": reduced.scale.item(),
        "reduced_history0": reduced.amax_history[0].item(),
        "local_scale": local.scale.item(),
        "no_group_scale": no_group.scale.item(),
        "current_scale_inv": current.scale_inv.item(),
        "single_scale": single.scale.item() if single is not None else None,
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
