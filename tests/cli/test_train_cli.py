"""`te-dist train` end to end on CPU: 2 gloo ranks started by the command itself (real torchrun)."""

import json

import pytest

pytestmark = pytest.mark.multiprocess


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(out_dir):
    return {row["step"]: row["loss"] for row in _rows(out_dir)}


def test_two_ranks_three_steps(run_cli, tmp_path):
    result = run_cli("train", "--nproc", 2, "--steps", 3, "--log-every", 1).check()
    out = result.output
    assert "2 ranks (gloo, cpu) | ep=2" in out
    assert out.count("[te-dist] agreed recipe key:") == 1  # printed once, by rank 0
    assert out.count("fusion plan of") == 1 and "GroupedLinear" in out
    # the default recipe (current scaling) on CPU: the float32 reference, said once by rank 0
    assert out.count("[te-dist] expert MLPs: emulated (cpu: the float32 reference path)") == 1
    assert all(f"step {s:>5}/3" in out for s in (1, 2, 3))
    assert "te-dist train summary" in out and "tokens/s" in out
    losses = _losses(tmp_path / "te_dist_out" / "latest")
    assert sorted(losses) == [1, 2, 3]
    assert losses[3] < losses[1]
    assert (tmp_path / "te_dist_out" / "latest" / "checkpoints" / "step_000003" / "meta.json").is_file()


def test_loss_goes_down_with_a_recipe(run_cli, tmp_path):
    result = run_cli("train", "--steps", 20, "--recipe", "current").check()
    assert "agreed recipe key: Float8CurrentScaling(" in result.output
    assert "[te-dist] expert MLPs: emulated (cpu: the float32 reference path)" in result.output
    losses = _losses(tmp_path / "te_dist_out" / "latest")
    first, last = losses[1], losses[20]
    assert last < first - 1.5, losses  # real learning: from ~ln(64)=4.16 towards the chain entropy 0.68


def test_dense_linears_under_the_recipe(run_cli, tmp_path):
    """model.fp8_dense: the attention projections and the LM head are quantized too (emulated on CPU,
    where the native kernels cannot run), they load the same checkpoint keys, and training still lowers the loss."""
    result = run_cli("train", "--steps", 8, "--recipe", "current", "--model.fp8_dense", "true").check()
    assert ("[te-dist] dense linears (attention, LM head): emulated in 5 of 5 "
            "(a CPU run, features off the 128 grid") in result.output
    losses = _losses(tmp_path / "te_dist_out" / "latest")
    assert losses[8] < losses[1], losses
    plain = run_cli("train", "--steps", 8, "--recipe", "current", "--out", "plain").check()
    assert "dense linears" not in plain.output
    assert _losses(tmp_path / "plain")[8] != losses[8]  # the dense layers' quantization changed the run


def test_optimizer_copies_change_nothing_where_no_kernel_writes_them(run_cli, tmp_path):
    """train.fp8_optimizer_copies: the job builds te_dist.optim.AdamWWithFP8Copies and drives is_first_microbatch at
    one micro-batch a step; on CPU no kernel writes a copy (the emulated path keeps none), so the run is the plain
    one bit for bit (its GPU effect: docs/quantization.md "Weight copies written by the optimizer")."""
    args = ("train", "--steps", 4, "--recipe", "block", "--train.eval_every", 2)
    copies = run_cli(*args, "--out", "copies").check()
    assert "fp8_optimizer_copies=true" in copies.output  # the default
    run_cli(*args, "--train.fp8_optimizer_copies", "false", "--out", "plain").check()
    assert _losses(tmp_path / "copies") == _losses(tmp_path / "plain")


def test_resume_is_bit_exact_after_a_crash(run_cli, tmp_path):
    """A job killed at step 5 (rank 1 fails) and resumed from its step-3 checkpoint reproduces the
    uninterrupted job's losses exactly. DelayedScaling is the stateful recipe: its amax histories
    must come back too."""
    common = ("train", "--steps", 6, "--ckpt-every", 3, "--recipe", "delayed")
    run_cli(*common, "--out", "straight").check()
    crashed = run_cli(*common, "--out", "crashy", "--fail-rank", 1, "--fail-step", 5)
    assert crashed.returncode != 0
    resumed = run_cli(*common, "--out", "crashy", "--resume", "crashy").check()
    assert "resumed from crashy/checkpoints/step_000003 at step 3" in resumed.output
    assert "recipe state restored" in resumed.output
    straight, again = _losses(tmp_path / "straight"), _losses(tmp_path / "crashy")
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    assert again == straight  # exact float equality, every step


def test_resume_at_another_ep_size(run_cli, tmp_path):
    """A checkpoint written at EP=2 reloads at EP=1: experts are resharded exactly (the first resumed
    loss is bit-identical to the EP=2 run's), and training continues on the same trajectory.

    Unquantized on purpose: per-tensor FP8 scales are taken over the tensor a rank holds (its local
    experts' weights, the tokens routed to them), so a quantized model is a slightly different
    function at another EP size, checkpoint or not."""
    common = ("train", "--steps", 6, "--ckpt-every", 3, "--recipe", "none")
    run_cli(*common, "--out", "ep2", "--ep", 2).check()
    resumed = run_cli(*common, "--out", "ep1", "--ep", 1, "--resume", "ep2/checkpoints/step_000003").check()
    assert "written by 2 ranks, ep=2; now 2 ranks, ep=1" in resumed.output
    ep2, ep1 = _losses(tmp_path / "ep2"), _losses(tmp_path / "ep1")
    assert sorted(ep1) == [1, 2, 3, 4, 5, 6]
    assert ep1[4] == ep2[4]
    for step in (5, 6):
        assert ep1[step] == pytest.approx(ep2[step], rel=1e-5, abs=0)


def test_the_main_command_runs_again_and_again(run_cli, tmp_path):
    """The README's ``te-dist train``, three times in one directory: three runs in three directories,
    nothing overwritten, ``latest`` naming the newest; ``--resume`` (no --out) continues the third."""
    runs = []
    for _ in range(3):
        result = run_cli("train", "--steps", 1).check()
        first = result.output.splitlines()[0]
        out = first.split(" | out ")[1].split(" (new)")[0]  # the first line names the new directory
        assert out.startswith("te_dist_out/") and out not in runs, first
        runs.append(out)
        assert (tmp_path / "te_dist_out" / "latest").resolve() == (tmp_path / out).resolve()
    rows = {out: _rows(tmp_path / out) for out in runs}
    assert all([r["step"] for r in r_] == [1] for r_ in rows.values())
    assert len({r_[0]["run"] for r_ in rows.values()}) == 3  # three runs, each in its own files
    resumed = run_cli("train", "--steps", 2, "--resume").check()
    assert f"out {runs[2]} | resume" in resumed.output.splitlines()[0]
    assert f"resumed from {runs[2]}/checkpoints/step_000001 at step 1" in resumed.output
    assert [r["step"] for r in _rows(tmp_path / runs[2])] == [1, 2]
    assert _rows(tmp_path / runs[0]) == rows[runs[0]] and _rows(tmp_path / runs[1]) == rows[runs[1]]


def test_out_dir_flags_without_out(run_cli, tmp_path):
    """``--overwrite`` needs ``--out`` (a run without one gets a new directory: nothing to replace);
    the refusal leaves no directory behind. ``--print-config`` shows ``out_dir: null``."""
    refused = run_cli("train", "--overwrite", timeout=120)
    assert refused.returncode == 2, refused.output
    assert "te-dist train: error: --overwrite replaces the run that --out holds: pass --out DIR" in refused.output
    assert not (tmp_path / "te_dist_out").exists() or not any((tmp_path / "te_dist_out").iterdir())
    shown = run_cli("train", "--print-config", timeout=120).check()
    assert "  out_dir: null\n" in shown.output and not any((tmp_path / "te_dist_out").glob("*"))


def test_bad_config_fails_before_launch(run_cli, tmp_path):
    (tmp_path / "bad.yaml").write_text("model:\n  num_experts: 3\nparallel:\n  ep: 2\n")
    result = run_cli("train", "--config", "bad.yaml", timeout=60)
    assert result.returncode == 2
    assert "te-dist train: error: model.num_experts=3 is not divisible by parallel.ep=2" in result.output
    assert "torch.distributed" not in result.output  # no rank was started
    assert list((tmp_path / "te_dist_out").iterdir()) == []  # the new run directory is removed again


def test_micro_batches_accumulate_the_same_step(run_cli, tmp_path):
    """Two micro-batches per optimizer step compute the step of one whole batch: the same first loss,
    then losses within the FP8 gradients' rounding (the wgrad's column blocks span other tokens)."""
    common = ("train", "--nproc", 2, "--steps", 3, "--no-checkpoint", "--recipe", "block")
    run_cli(*common, "--out", "whole").check()
    run_cli(*common, "--out", "halves", "--train.micro_batches", 2).check()
    whole, halves = _losses(tmp_path / "whole"), _losses(tmp_path / "halves")
    assert sorted(halves) == [1, 2, 3]
    assert halves[1] == whole[1]
    for step in (2, 3):
        assert abs(halves[step] - whole[step]) <= 2e-3 * abs(whole[step]), (step, whole, halves)
    assert halves[3] < halves[1]
    bad = run_cli("train", "--nproc", 2, "--train.micro_batches", 3, timeout=60)
    assert bad.returncode == 2
    assert "train.micro_batches=3 does not divide the sequences per rank" in bad.output


def test_unknown_config_key_fails(run_cli, tmp_path):
    (tmp_path / "typo.yaml").write_text("train:\n  stpes: 3\n")
    result = run_cli("train", "--config", "typo.yaml", timeout=60)
    assert result.returncode == 2
    assert "unknown key(s) ['stpes'] in config section 'train'" in result.output


def test_failing_rank_ends_the_job_with_its_error(run_cli, tmp_path):
    """One line on the terminal names the rank, the phase and its error and points at the rank's log,
    which holds the traceback."""
    result = run_cli("train", "--steps", 4, "--fail-rank", 1, "--fail-step", 2, timeout=120)
    assert result.returncode == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("te-dist train:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith("te-dist train: rank 1 failed in step 2: RuntimeError: injected failure on rank 1 at "
                               "step 2 (--fail-rank/--fail-step)"), lines[0]  # the cause, not what it set off
    assert "; results incomplete: this job wrote no checkpoint; logs te_dist_out/" in lines[0], lines[0]
    log = tmp_path / lines[0].rsplit("; logs ", 1)[1]
    assert log.name == "rank1.log" and "Traceback" in log.read_text() and "injected failure" in log.read_text()


def test_resume_of_another_model_shape_fails(run_cli, tmp_path):
    """Resuming a checkpoint of another model shape names the differing setting, before any rank starts."""
    run_cli("train", "--steps", 2, "--out", "small").check()
    (tmp_path / "narrow.yaml").write_text("model:\n  hidden_size: 64\n")
    result = run_cli("train", "--config", "narrow.yaml", "--steps", 4, "--resume", "small", timeout=60)
    assert result.returncode == 2
    assert "model.hidden_size: checkpoint 128 vs config 64" in result.output


def test_plain_torchrun_entry(tmp_path):
    """launchers/train.py under a plain torchrun (what the shell and Slurm launchers run)."""
    from harness import REPO_ROOT, run_torchrun

    config = REPO_ROOT / "launchers" / "configs" / "tiny_cpu.yaml"
    result = run_torchrun(REPO_ROOT / "launchers" / "train.py", 2, timeout=180,
                          args=["--config", config, "--steps", 2, "--out", tmp_path / "out"]).check()
    assert "te-dist train summary" in result.log(0)
    assert "te-dist train summary" not in result.log(1)  # rank 0 reports for the job
    assert sorted(_losses(tmp_path / "out")) == [1, 2]


def test_damaged_checkpoint_refused_then_skipped_when_asked(run_cli, tmp_path):
    """A bit flipped in the newest checkpoint: ``--resume`` exits 2 with one line naming the file,
    before any rank starts; ``--resume --skip-invalid`` continues from the checkpoint before it and
    reproduces the run's own losses exactly, in one metrics file of one run. A new run into the
    same --out is refused."""
    common = ("train", "--steps", 4, "--ckpt-every", 2, "--recipe", "none", "--out", "run")
    run_cli(*common).check()
    original = _rows(tmp_path / "run")
    again = run_cli(*common, timeout=120)
    assert again.returncode == 2 and "--out run holds another run (checkpoints step_000002..step_000004" in again.output
    shard = tmp_path / "run" / "checkpoints" / "step_000004" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))
    refused = run_cli(*common, "--resume", timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.output
    errors = [line for line in refused.output.splitlines() if "error" in line]
    assert errors == ["te-dist train: error: run/checkpoints/step_000004/__1_0.distcp: checksum mismatch (the content "
                      "changed after the save); --skip-invalid resumes from the newest checkpoint that verifies"]
    resumed = run_cli(*common, "--resume", "--skip-invalid").check()
    assert "skipped step_000004: run/checkpoints/step_000004/__1_0.distcp: checksum mismatch" in resumed.output
    assert "resumed from run/checkpoints/step_000002 at step 2" in resumed.output
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and {r["run"] for r in rows} == {original[0]["run"]}
    assert [r["loss"] for r in rows] == [r["loss"] for r in original]  # bit-identical
    from te_dist.train.manifest import verify_checkpoint

    assert verify_checkpoint(shard.parent)["step"] == 4  # step 4 was written again, whole


def test_a_live_run_holds_its_out(run_cli, tmp_path):
    from te_dist.train.run_lock import RunLock

    lock = RunLock(tmp_path / "busy").acquire("first")
    try:
        result = run_cli("train", "--steps", 2, "--out", "busy", timeout=120)
    finally:
        lock.release()
    assert result.returncode == 2
    assert "te-dist train: error: --out busy is in use by the live run first (pid" in result.output


def test_config_saved_progress_fields_and_resume_check(run_cli, tmp_path):
    """The first line says what is launched; config.yaml and the checkpoint hold the resolved config;
    metrics rows carry grad norm, throughput, memory and ETA; a resume names what changed."""
    import yaml

    from te_dist.train.config import load_config
    from te_dist.train.resolved import resolved_config

    try:
        import tensorboard  # noqa: F401

        log = ("--log", "tensorboard")
    except ImportError:  # the writer itself is tested (or skipped, with the reason) in test_tensorboard.py
        log = ()
    common = ("train", "--ckpt-every", 2, "--model.num_experts", 8, "--data.seq_len", 16, "--log-every", 1,
              "--out", "run", *log)
    first = run_cli(*common, "--steps", 2).check()
    lines = first.output.splitlines()
    assert lines[0].startswith("[te-dist] train: 2 ranks (gloo, cpu) | config (defaults) | out run")
    assert "[te-dist] config model: vocab_size=64 hidden_size=128 ffn_hidden_size=128 num_layers=2 num_heads=4 " \
           "num_experts=8" in first.output
    assert "[te-dist] memory per rank (estimate): params" in first.output
    assert first.output.count("[te-dist] config model:") == 1  # the workers do not repeat it
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved == resolved_config(load_config(tmp_path / "run" / "config.yaml"), world_size=2)
    assert (saved["model"]["num_experts"], saved["data"]["seq_len"], saved["provenance"]["world_size"]) == (8, 16, 2)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["config"] == saved
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["grad_norm"] > 0 and row["tokens_per_s"] > 0 and row["max_rss_gib"] > 0.05
        assert row["mfu"] is None  # no peak FLOP/s for a CPU
    assert rows[1]["eta_s"] == 0 and rows[0]["eta_s"] > 0
    assert "gnorm" in first.output and "ETA" in first.output and "rss" in first.output
    if log:
        assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))

    resumed = run_cli(*common, "--steps", 3, "--train.lr", 0.02, "--resume", "run").check()
    assert "[te-dist] settings changed since the checkpoint: train.lr 0.01 -> 0.02, train.steps 2 -> 3" \
        in resumed.output
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["lr"] == 0.02
