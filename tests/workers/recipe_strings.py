"""Worker: each rank builds every recipe independently and gathers the strings from all ranks."""

import torch.distributed as dist

import te_dist.distributed  # noqa: F401  (its exit hook: no SIGABRT after the last gloo collective)
from te_dist import recipe as R


def main():
    dist.init_process_group("gloo")
    recipes = [
        R.DelayedScaling(margin=1, amax_compute_algo=max),
        R.Float8CurrentScaling(use_power_2_scales=True),
        R.Float8BlockScaling(),
        R.MXFP8BlockScaling(),
        R.NVFP4BlockScaling(disable_rht=True),
    ]
    recipes[2].enable_fused_grouped_mlp = False
    mine = [str(r) for r in recipes]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(strings == everyone[0] for strings in everyone), everyone
    print("IDENTICAL", len(mine), mine[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
