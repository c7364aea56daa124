"""te_dist.megatron.gpt_moe_example end to end: a Megatron-Core GPT (a dense and an MoE layer) under
Megatron's DDP, distributed optimizer and schedule, against the same model with Megatron's SequentialMLP.

CPU: 2 ranks over gloo (torchrun; Megatron's CUDA assumptions are the documented test workarounds of
mcore_helpers). GPU (``-m gpu``): the same scenarios over NCCL on one GPU per rank (1 or 2 ranks).
"""

from pathlib import Path

import pytest
import torch

from harness import run_torchrun, scenario_results

WORKER = Path(__file__).resolve().parent / "workers" / "gpt_moe_e2e.py"
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}

# train/<experts>/<recipe>/<distributed optimizer>/<overlap grad reduce + param gather>/<EP>
TRAIN_2RANKS = [
    "train/te_dist/none/1/1/1", "train/sequential/none/1/1/1",      # DP=2: overlapped param all-gather
    "train/te_dist/none/1/0/2", "train/sequential/none/1/0/2",      # EP=2 (alltoall), no overlap
    "train/te_dist/current/1/1/1", "train/te_dist/block/1/0/2",     # FP8 recipes
]
TRAIN_1RANK = ["train/te_dist/none/1/1/1", "train/sequential/none/1/1/1",
               "train/te_dist/current/1/1/1", "train/te_dist/block/1/1/1"]
CKPT = [
    "ckpt/te_dist/te_dist/dp_reshardable",           # the distributed optimizer's flat buffers: bit-exact
    "ckpt/te_dist/sequential/plain",                 # model-space optimizer state: interchange both ways
    "ckpt/sequential/te_dist/plain",
    "ckpt/te_dist/te_dist/fully_reshardable",        # saves; Megatron's load needs Apex/TE's Adam
    "ckpt/sequential/sequential/fully_reshardable",
    "ckpt/te_dist/te_dist/fully_sharded_model_space",      # flat ShardedTensors: gone from Megatron
    "ckpt/sequential/sequential/fully_sharded_model_space",
]


def _run(tmp_path, nproc, scenarios, env=None):
    result = run_torchrun(WORKER, nproc, args=(tmp_path, *scenarios), timeout=420, env=env)
    result.check()
    assert "te_dist from " + str(Path(__file__).resolve().parents[2]) in result.log(0)
    runs = scenario_results(result.rank_logs)
    assert set(runs) == set(scenarios), result.report()
    for name, per_rank in runs.items():
        for rank, run in enumerate(per_rank):
            assert run is not None and "error" not in run, f"{name} rank {rank}: {run}"
    return runs


def _close(a, b, atol):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


def _check_training(runs, *, atol, fp8_atol):
    """Every te_dist run against the SequentialMLP run of the same layout, rank by rank."""
    for name, per_rank in runs.items():
        kind, experts, recipe, layout = name.split("/", 3)
        if kind != "train" or experts != "te_dist":
            continue
        for rank, run in enumerate(per_rank):
            reference = runs[f"train/sequential/none/{layout}"][rank]
            flags = [flag for step_flags in run["flags"] for flag in step_flags]
            if recipe == "none":
                # The same model, data and initial weights: te_dist's experts train as SequentialMLP does.
                _close(run["losses"], reference["losses"], atol)
                assert set(flags) == {None}, flags  # no FP8: nothing is kept
                continue
            assert run["losses"] != reference["losses"], f"{name}: the FP8 recipe did not run"
            _close(run["losses"], reference["losses"], fp8_atol)
            # Megatron marked the first micro-batch of every step (the config names the FP8 recipe): the
            # experts' ops turned the mark False, so the later micro-batches may reuse the weight copy...
            assert set(flags) == {False}, flags
            # ... at most one cast per op and step, never one per micro-batch,
            num_ops = len(run["flags"][0])
            assert all(casts <= num_ops for casts in run["casts_per_step"]), run["casts_per_step"]
            # ... and after every optimizer step the layer computes with its new weights: its output
            # equals that of a fresh module holding them (an FP8 copy cast from scratch), bit for bit.
            assert all(diff == 0.0 for diffs in run["copy_diffs"] for diff in diffs), run["copy_diffs"]


@pytest.mark.multiprocess
def test_training_matches_sequential_mlp_and_the_fp8_copy_follows_every_step(tmp_path):
    runs = _run(tmp_path, 2, TRAIN_2RANKS, env=CPU_ONLY)
    _check_training(runs, atol=1e-6, fp8_atol=5e-3)  # fp32 on the CPU


@pytest.mark.multiprocess
def test_distributed_optimizer_checkpoints_resume_and_interchange(tmp_path):
    runs = _run(tmp_path, 2, CKPT, env=CPU_ONLY)
    for rank in range(2):
        # Save with te_dist's experts, resume into a freshly built model and optimizer: bit-exact.
        run = runs["ckpt/te_dist/te_dist/dp_reshardable"][rank]
        assert run["resumed"] == run["reference"] and run["params_max_diff"] == 0.0, run
        # Model-space optimizer state (Megatron's optimizer without the distributed one): a te_dist
        # checkpoint resumes SequentialMLP and back, the loss following the saving run's.
        for name in ("ckpt/te_dist/sequential/plain", "ckpt/sequential/te_dist/plain"):
            run = runs[name][rank]
            _close(run["resumed"], run["reference"], 1e-6)  # fp32 on the CPU
        # fully_reshardable: te_dist's experts save the same tensors as SequentialMLP (model and
        # optimizer state, same keys and global shapes); megatron-core 0.16's load then fails the
        # same way for both with torch's Adam (no Apex/TransformerEngine): its 'step' state.
        ours, theirs = runs["ckpt/te_dist/te_dist/fully_reshardable"][rank], runs[
            "ckpt/sequential/sequential/fully_reshardable"][rank]
        for run in (ours, theirs):
            assert run.get("load_error", "").startswith("KeyError: 'step'"), run
        if rank == 0:
            assert ours["layout"] == theirs["layout"]
            assert any(k.startswith("optimizer.state.exp_avg.") and k.endswith("experts.linear_fc1.weight")
                       for k in ours["layout"]), sorted(ours["layout"])
        # The flattened format: megatron-core >= 0.16 refuses flat ShardedTensors for every model.
        for arm in ("te_dist", "sequential"):
            error = runs[f"ckpt/{arm}/{arm}/fully_sharded_model_space"][rank]["save_error"]
            assert "flattened_range is not supported" in error, error


@pytest.mark.gpu
def test_gpu_training_matches_sequential_mlp_and_the_fp8_copy_follows_every_step(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    scenarios = TRAIN_2RANKS if nproc == 2 else TRAIN_1RANK
    runs = _run(tmp_path, nproc, scenarios + ["ckpt/te_dist/te_dist/dp_reshardable"])
    _check_training(runs, atol=2e-3, fp8_atol=2e-2)
    for run in runs["ckpt/te_dist/te_dist/dp_reshardable"]:
        assert run["resumed"] == run["reference"] and run["params_max_diff"] == 0.0, run


def test_settings_and_command_line_errors_name_what_to_change(capsys):
    from te_dist.megatron import gpt_moe_example as ex

    with pytest.raises(ValueError, match="experts='grouped'"):
        ex.RunSettings(experts="grouped")
    with pytest.raises(ValueError, match="needs experts='te_dist'"):
        ex.RunSettings(experts="sequential", recipe="block")
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep_size=3"):
        ex.RunSettings(ep_size=3)
    with pytest.raises(SystemExit) as exit_info:
        ex.main(["--recipe", "fp7"])
    assert exit_info.value.code == 2
    capsys.readouterr()
    if not torch.cuda.is_available():  # the launcher runs Megatron on GPUs; the CPU run is this file's
        assert ex.main(["--steps", "1"]) == 2
        assert capsys.readouterr().err.strip().count("\n") == 0
