"""Damaged checkpoints are refused naming the file, or passed over when asked; never loaded.

Real DCP checkpoints of a tiny model, written in this process by ``save_checkpoint`` on a one-rank
gloo group (steps 2 and 4, plus step 4 of a second run with another seed), then damaged at random:
bit flips, truncation, a missing file, a stale or malformed meta.json, a foreign file, a crash
in the middle of a save. Every case must end in a one-line CheckpointError naming the damaged
file, or in step 2 with ``skip_invalid`` (a crashed save: step 4, the newest whole one).
"""

import json
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import te_dist.train.checkpoint as ckpt_mod
from te_dist.train.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from te_dist.train.config import JobConfig, ModelConfig
from te_dist.train.manifest import CheckpointError, file_digest, read_manifest, select_checkpoint
from te_dist.train.model import build_model

MODEL = ModelConfig(vocab_size=16, hidden_size=32, ffn_hidden_size=32, num_layers=1, num_heads=2, num_experts=2,
                    top_k=1)
SHARD = "__0_0.distcp"
# (damage, where): which file each damage hits is fixed per case, so each damage meets each file; offsets,
# bits, lengths and the form of a malformed meta.json are drawn at random (seeded per case).
CASES = [("bitflip", SHARD), ("bitflip", SHARD), ("bitflip", SHARD), ("bitflip", ".metadata"), ("bitflip", "meta.json"),
         ("truncate", SHARD), ("truncate", SHARD), ("truncate", ".metadata"), ("truncate", "meta.json"),
         ("missing", SHARD), ("missing", ".metadata"), ("missing", "meta.json"),
         ("stale_meta", "step 2"), ("stale_meta", "other run"), ("bad_meta", None), ("bad_meta", None),
         ("foreign", None), ("crash", "dcp"), ("crash", "manifest"), ("crash", "publish")]
assert len(CASES) == 20


@pytest.fixture(scope="module")
def runtime(one_rank_runtime):
    """This process as a one-rank job (session-wide: torch.distributed starts once per process)."""
    return one_rank_runtime


def _trainer(runtime, seed):
    """A model, its AdamW and a ``step()`` that moves weights and optimizer state as training would
    (random updates: the checkpoint only has to hold whatever values they reach)."""
    model = build_model(MODEL, seed=seed, ep_group=runtime.groups.ep_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(seed)

    def step():
        with torch.no_grad():
            for p in model.parameters():
                state = optimizer.state[p]
                if not state:
                    state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                update = torch.randn(p.shape, generator=gen)
                state["step"] += 1
                state["exp_avg"].add_(update)
                state["exp_avg_sq"].add_(update * update)
                p.add_(update, alpha=1e-2)

    return model, optimizer, step


def _meta(run_id):
    return {"model": asdict(MODEL), "run_id": run_id, "config": JobConfig(model=MODEL).to_dict(), "losses": {}}


@pytest.fixture(scope="module")
def golden(runtime, tmp_path_factory):
    """Output dirs: ``main`` (steps 2 and 4) and ``other`` (step 4 of another run); the step-2 weights."""
    root = tmp_path_factory.mktemp("golden")
    model, optimizer, step = _trainer(runtime, seed=0)
    for _ in range(2):
        step()
    save_checkpoint(checkpoint_dir(root / "main", 2), model=model, optimizer=optimizer, runtime=runtime, step=2,
                    meta=_meta("main"))
    at_step2 = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        step()
    save_checkpoint(checkpoint_dir(root / "main", 4), model=model, optimizer=optimizer, runtime=runtime, step=4,
                    meta=_meta("main"))
    other, other_opt, other_step = _trainer(runtime, seed=1)
    for _ in range(4):
        other_step()
    save_checkpoint(checkpoint_dir(root / "other", 4), model=other, optimizer=other_opt, runtime=runtime, step=4,
                    meta=_meta("other"))
    return {"root": root, "at_step2": at_step2, "model": model, "optimizer": optimizer}


def _damage(kind, where, rng, out, golden, runtime, monkeypatch) -> set:
    """Apply one damage to ``out``'s step 4; returns the files an error may name (empty: a crashed save)."""
    step4 = checkpoint_dir(out, 4)
    target = step4 / str(where)
    if kind == "bitflip":
        data = bytearray(target.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        return {target}
    if kind == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: rng.randrange(len(data))])
        return {target}
    if kind == "missing":
        target.unlink()
        return {target}
    if kind == "stale_meta":
        # The manifest of another checkpoint: step 2 of this run, or step 4 of another run (what a
        # crash while overwriting a step directory used to leave beside the new shards).
        source = checkpoint_dir(out, 2) if where == "step 2" else checkpoint_dir(golden["root"] / "other", 4)
        shutil.copy(source / "meta.json", step4 / "meta.json")
        stale = read_manifest(step4)["files"]
        differing = {step4 / n for n, entry in stale.items() if file_digest(step4 / n)["sha256"] != entry["sha256"]}
        return {step4 / "meta.json"} | differing
    if kind == "bad_meta":
        text = (step4 / "meta.json").read_text()
        body = json.loads(text)
        body.pop(rng.choice(sorted(body)))  # a field missing
        (step4 / "meta.json").write_text(rng.choice(["{not json", text[: rng.randrange(len(text))], json.dumps(body),
                                                      json.dumps([1, 2])]))
        return {step4 / "meta.json"}
    if kind == "foreign":
        shutil.copy(checkpoint_dir(golden["root"] / "other", 4) / SHARD, step4 / "__1_0.distcp")
        return {step4 / "__1_0.distcp"}
    assert kind == "crash"
    # A save of step 6 killed half-way through DCP's write, before meta.json, or before the rename.

    def killed(*args, **kwargs):
        raise KeyboardInterrupt(f"killed at {where}")

    if where == "dcp":
        real_save = dcp.save

        def half_written(state, storage_writer, **kwargs):
            real_save(state, storage_writer=storage_writer, **kwargs)
            shard = next(Path(storage_writer.path).glob("*.distcp"))
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            killed()

        monkeypatch.setattr(dcp, "save", half_written)
    else:
        monkeypatch.setattr(ckpt_mod, "write_manifest" if where == "manifest" else "_publish", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_dir(out, 6), model=golden["model"], optimizer=golden["optimizer"], runtime=runtime,
                        step=6, meta=_meta("main"))
    monkeypatch.undo()
    assert not checkpoint_dir(out, 6).exists()  # never a step directory that looks whole
    assert (out / "checkpoints" / ".step_000006.partial").is_dir()
    return set()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_damaged_checkpoint_is_never_resumed(case, golden, runtime, tmp_path, monkeypatch):
    kind, where = CASES[case]
    rng = random.Random(f"damage-{case}")
    out = tmp_path / "out"
    shutil.copytree(golden["root"] / "main", out)
    assert sorted(p.name for p in checkpoint_dir(out, 4).iterdir()) == [".metadata", SHARD, "meta.json"]
    blamed = _damage(kind, where, rng, out, golden, runtime, monkeypatch)
    if not blamed:  # a crashed save: the newest whole checkpoint is the one before it
        for skip in (False, True):
            assert select_checkpoint(out, skip_invalid=skip)[0] == checkpoint_dir(out, 4)
        return
    with pytest.raises(CheckpointError) as refused:
        select_checkpoint(out)
    message = str(refused.value)
    assert "\n" not in message and refused.value.path in blamed, (kind, message, blamed)
    assert message.startswith(str(refused.value.path))
    chosen, meta, notes = select_checkpoint(out, skip_invalid=True)
    assert chosen == checkpoint_dir(out, 2) and meta["step"] == 2
    assert len(notes) == 1 and str(refused.value.path) in notes[0]
    with pytest.raises(CheckpointError):  # the collective load refuses it too (rank 0 verifies)
        load_checkpoint(checkpoint_dir(out, 4), model=golden["model"], optimizer=golden["optimizer"],
                        runtime=runtime, model_config=asdict(MODEL))


def test_recovered_checkpoint_loads_the_saved_weights(golden, runtime):
    model, optimizer, _ = _trainer(runtime, seed=7)
    meta = load_checkpoint(checkpoint_dir(golden["root"] / "main", 2), model=model, optimizer=optimizer,
                           runtime=runtime, model_config=asdict(MODEL))
    assert meta["step"] == 2 and meta["run_id"] == "main"
    for key, value in model.state_dict().items():
        assert torch.equal(value, golden["at_step2"][key]), key


def test_retention_and_a_step_reached_again(golden, runtime, tmp_path):
    """--keep-last deletes older checkpoints only; a step saved again replaces its directory whole."""
    out = tmp_path / "out"
    shutil.copytree(golden["root"] / "main", out)
    before = read_manifest(checkpoint_dir(out, 4))["meta_sha256"]
    save_checkpoint(checkpoint_dir(out, 4), model=golden["model"], optimizer=golden["optimizer"], runtime=runtime,
                    step=4, meta=dict(_meta("main"), losses={"4": 1.0}))
    assert read_manifest(checkpoint_dir(out, 4))["meta_sha256"] != before
    assert select_checkpoint(out)[0] == checkpoint_dir(out, 4)
    save_checkpoint(checkpoint_dir(out, 5), model=golden["model"], optimizer=golden["optimizer"], runtime=runtime,
                    step=5, meta=_meta("main"), keep_last=2)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000004", "step_000005"]
