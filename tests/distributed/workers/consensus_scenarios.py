"""Recipe-consensus scenarios, run on every rank under torchrun (gloo on CPU, or NCCL with --backend nccl).

Each scenario checks what it can on its own rank and prints one ``RESULT <name> <json>`` line that
the launching test compares across ranks. Scenarios run back to back in one process group: a
mismatch must raise on every rank alike, which leaves the group usable for the next scenario (a
rank that did not raise would desynchronise the collectives and the launch would time out).

    python -m torch.distributed.run --nproc-per-node 2 consensus_scenarios.py --scenarios equal,field
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import te_dist as td
from te_dist import recipe as R
from te_dist.autocast import get_recipe_key
from te_dist.distributed import ConsensusError, RecipeMismatchError, sync_recipe

TIMEOUT_S = 20.0  # consensus timeout for the scenarios that expect success or a mismatch


def emit(name: str, **payload) -> None:
    print(f"RESULT {name} {json.dumps(payload, sort_keys=True)}", flush=True)


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def expect_mismatch(fn):
    """Run ``fn``; return the RecipeMismatchError text (None if it did not raise)."""
    try:
        fn()
    except RecipeMismatchError as exc:
        return {"message": str(exc), "mismatched": exc.mismatched_ranks}
    return None


def build_all_recipes():
    """One recipe per class, built independently on this rank, some with non-default settings."""
    delayed = R.DelayedScaling(margin=1, amax_history_len=16)
    delayed.enable_fused_grouped_mlp = False  # a public attribute attached on every rank
    return [
        delayed,
        R.Float8CurrentScaling(use_power_2_scales=True),
        R.Float8BlockScaling(),
        R.MXFP8BlockScaling(fp8_format=R.Format.HYBRID),
        R.NVFP4BlockScaling(disable_rht=True),
    ]


# --------------------------------------------------------------------------- scenarios


def scenario_equal(args, rank, world):
    keys = []
    for recipe in build_all_recipes():
        first = sync_recipe(recipe, timeout=TIMEOUT_S)  # full exchange (first time on this group)
        second = sync_recipe(recipe, timeout=TIMEOUT_S)  # steady state: digest only
        assert first == second == str(recipe), (first, second, str(recipe))
        with td.autocast(recipe=recipe, group=dist.group.WORLD):
            assert get_recipe_key() == first
        keys.append(first)
    assert sync_recipe(None, timeout=TIMEOUT_S) is None
    with td.autocast(recipe=None, group=dist.group.WORLD):
        assert get_recipe_key() is None
    all_keys = gather(keys)
    assert all(k == all_keys[0] for k in all_keys), all_keys
    emit("equal", keys=keys)


def scenario_class(args, rank, world):
    recipe = R.Float8CurrentScaling() if rank == world - 1 else R.DelayedScaling()
    err = expect_mismatch(lambda: sync_recipe(recipe, timeout=TIMEOUT_S))
    emit("class", error=err)


def scenario_field(args, rank, world):
    recipe = R.DelayedScaling(margin=3 if rank == world - 1 else 0)
    err = expect_mismatch(lambda: sync_recipe(recipe, timeout=TIMEOUT_S))
    emit("field", error=err)


def scenario_attr(args, rank, world):
    recipe = R.Float8BlockScaling()
    sync_recipe(recipe, timeout=TIMEOUT_S)  # agreed first, so the attribute is a change, not a new recipe
    if rank == world - 1:
        recipe.enable_cutedsl_fused_grouped_mlp = True
    err = expect_mismatch(lambda: sync_recipe(recipe, timeout=TIMEOUT_S))
    emit("attr", error=err)


def scenario_none(args, rank, world):
    recipe = None if rank == world - 1 else R.MXFP8BlockScaling()
    err = expect_mismatch(lambda: sync_recipe(recipe, timeout=TIMEOUT_S))
    emit("none", error=err)


def scenario_two_groups_of_ranks(args, rank, world):
    """4+ ranks: rank 1 and the last rank differ from rank 0 in different ways."""
    recipe = R.DelayedScaling()
    if rank == 1:
        recipe.margin = 2
    if rank == world - 1:
        recipe.fp8_format = R.Format.E4M3
    err = expect_mismatch(lambda: sync_recipe(recipe, timeout=TIMEOUT_S))
    emit("two_groups", error=err)


def scenario_midtrain(args, rank, world):
    """A training loop under autocast(group=...); the last rank changes its recipe at step 2, inside the block."""
    torch.manual_seed(0)
    device = args.device
    model = torch.nn.Linear(8, 8, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = R.Float8CurrentScaling()
    keys, failed_at, err = [], None, None
    for step in range(6):
        try:
            with td.autocast(recipe=recipe, group=dist.group.WORLD):
                agreed = get_recipe_key()
                loss = model(torch.randn(4, 8, device=device)).square().mean()
                if step == 2 and rank == world - 1:
                    recipe.use_power_2_scales = True  # changed on one rank only, mid-block
                    # The block keeps the agreed key: no rank may switch plans mid-block.
                    assert get_recipe_key() == agreed != str(recipe)
                keys.append(get_recipe_key())
        except RecipeMismatchError as exc:
            failed_at, err = step, {"message": str(exc), "mismatched": exc.mismatched_ranks}
            break
        loss.backward()
        for p in model.parameters():  # keep the ranks' models identical, as data parallel would
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    emit("midtrain", failed_at=failed_at, keys=keys, error=err)


def scenario_recover(args, rank, world):
    """After mismatches, the same group still agrees (no half-updated state on any rank)."""
    recipe = R.NVFP4BlockScaling()
    key = sync_recipe(recipe, timeout=TIMEOUT_S)
    emit("recover", key=key, same=gather(key) == [key] * world)


def scenario_subgroups(args, rank, world):
    """Pairs of ranks agree inside their own group; only the pair with a rogue rank fails."""
    pairs = [list(range(i, min(i + 2, world))) for i in range(0, world, 2)]
    groups = [dist.new_group(p) for p in pairs]  # every rank creates every group, same order
    mine = next(g for g, p in zip(groups, pairs) if rank in p)
    pair_index = rank // 2
    recipe = R.DelayedScaling(margin=pair_index)  # recipes differ between pairs: that is allowed
    key = sync_recipe(recipe, group=mine, timeout=TIMEOUT_S)
    assert key == str(recipe)
    if rank == world - 1:
        recipe.amax_compute_algo = "most_recent"
    err = expect_mismatch(lambda: sync_recipe(recipe, group=mine, timeout=TIMEOUT_S))
    emit("subgroups", key=key, pair=pairs[pair_index], error=err)


def scenario_grouped_mlp(args, rank, world):
    """Fusion keys of a grouped-MLP fuser are identical on every rank after consensus."""
    from te_dist.ops import GroupedLinear, OperationFuser, ScaledSwiGLU

    device = args.device
    num_experts, hidden, ffn, tokens = 2, 16, 8, 6
    torch.manual_seed(0)
    fuser = OperationFuser([
        GroupedLinear(num_experts, hidden, 2 * ffn, device=device),
        ScaledSwiGLU(),
        GroupedLinear(num_experts, ffn, hidden, device=device),
    ])
    recipe = R.Float8CurrentScaling()
    recipe.enable_fused_grouped_mlp = True  # attached attributes are part of the key on every rank
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    split_sizes = torch.tensor([4, 2], dtype=torch.int64)
    probs = torch.rand(tokens, device=device)
    fusion_keys = []
    for _ in range(2):
        with td.autocast(recipe=recipe, group=dist.group.WORLD):
            agreed = get_recipe_key()
            y = fuser(x, split_sizes, probs, split_sizes)
        y.float().sum().backward()
        fusion_keys.append(list(fuser.fusion_key))
        assert fuser.fusion_key[0] == agreed, (fuser.fusion_key, agreed)
    all_keys = gather(fusion_keys)
    assert all(k == all_keys[0] for k in all_keys), all_keys
    describe = fuser.plan.describe()
    # One rank turns the fused path off: every rank must refuse the step, none may run another plan.
    if rank == world - 1:
        recipe.enable_fused_grouped_mlp = False
    err = expect_mismatch(lambda: td.autocast(recipe=recipe, group=dist.group.WORLD).__enter__())
    after = list(fuser.fusion_key)
    emit("grouped_mlp", fusion_keys=fusion_keys, describe=describe, error=err, key_after_error=after)


def scenario_hang(args, rank, world):
    """The last rank never joins this consensus point: the others fail within the timeout."""
    timeout = args.dead_timeout
    if rank == world - 1:
        time.sleep(timeout + 5)  # alive but absent, long enough for the others to time out
        emit("hang", victim=True)
        return
    started = time.monotonic()
    try:
        sync_recipe(R.DelayedScaling(), timeout=timeout)
    except ConsensusError as exc:
        emit("hang", victim=False, elapsed=time.monotonic() - started, timeout=timeout, message=str(exc))
        return
    emit("hang", victim=False, elapsed=None, message="no error")


def scenario_killed(args, rank, world):
    """Run by test_consensus_killed without torchrun: the test SIGKILLs the last rank while it waits."""
    sync_recipe(R.DelayedScaling(), timeout=TIMEOUT_S)  # everyone is connected
    print("READY", flush=True)
    if rank == world - 1:
        time.sleep(600)  # killed by the test
        return
    time.sleep(args.kill_grace)  # the test kills the victim during this sleep
    started = time.monotonic()
    try:
        sync_recipe(R.Float8CurrentScaling(), timeout=args.dead_timeout)
    except ConsensusError as exc:
        emit("killed", elapsed=time.monotonic() - started, timeout=args.dead_timeout, message=str(exc))
        os._exit(0)  # the group is broken: skip destroy_process_group, which would wait on the dead rank
    emit("killed", elapsed=None, message="no error")
    os._exit(1)


SCENARIOS = {
    name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", required=True, help=f"comma list of {sorted(SCENARIOS)}")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--dead-timeout", type=float, default=4.0)
    parser.add_argument("--kill-grace", type=float, default=2.0)
    parser.add_argument("--side-group", action="store_true",
                        help="run consensus on a gloo side group even for gloo groups (the NCCL code path)")
    args = parser.parse_args(argv)
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; expected some of {sorted(SCENARIOS)}")
    if args.backend == "nccl":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        args.device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=args.device, timeout=datetime.timedelta(seconds=120))
    else:
        args.device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if args.side_group:
        from te_dist.distributed import consensus

        consensus.use_side_group_on_gloo()
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        SCENARIOS[name](args, rank, world)
    if "hang" in names:
        sys.stdout.flush()
        os._exit(0)  # the timed-out collective left the group unusable; teardown could block
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
