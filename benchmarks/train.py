"""`te-dist train` end to end: throughput, resume drift, real text, memory on a large token file.

    python benchmarks/train.py throughput                          # 2 CPU ranks, the default tiny model
    python benchmarks/train.py throughput --nproc 2 --config launchers/configs/mixtral_like.yaml \
        --steps 12 --variants none:2 none:1                        # 2 GPUs
    python benchmarks/train.py throughput --nproc 1 --device cuda --steps 300 --seed 1 --variants none block
    python benchmarks/train.py throughput --nproc 1 --device cuda --config launchers/configs/mixtral_like.yaml \
        --variants none:1 block:1 --fp8-dense     # FP8 arms quantize attention and LM head too
    python benchmarks/train.py resume-drift [--recipe none] [--reshard 1 4]
    python benchmarks/train.py text [--work DIR] [--steps 300] [--recipes current none] [--plot-to DIR]
    python benchmarks/train.py token-memory [--gib 1] [--steps 200] [--nproc 2]
    python benchmarks/train.py profile --config launchers/configs/deepseek_like.yaml --recipes none,current,block
    python benchmarks/train.py switch --setting fp8_head_loss --config launchers/configs/deepseek_like.yaml
    python benchmarks/train.py idle --config launchers/configs/deepseek_like.yaml --recipes current,none

``throughput``: each variant (``recipe:ep``; the first is the baseline) is one real `te-dist train` job,
torchrun workers included; tokens/s is the mean over the steps after the first two, read from the job's
metrics.jsonl, with the first and last loss.

``resume-drift``: one reference job (``--nproc`` ranks, EP = ranks) writes a checkpoint at step ``--at``
and trains to ``--steps``; each resumed job reloads it on another rank count (the experts resharded)
and trains to ``--steps``. Printed per resumed job: ``|resumed - reference| / reference`` of the loss
at the first resumed step, the last step, and the largest over the resumed steps.

``text``: trains on real English text found on this machine (the manual pages of common commands
rendered with ``man`` and ``col``, or without them the licence texts of /usr/share/common-licenses;
nothing is downloaded): ``te-dist train --nproc 2 --data.path corpus.txt`` per recipe into
``DIR/runs/<recipe>``, the validation loss against the corpus' unigram entropy (the loss of a model
that knows only byte frequencies); with several recipes ``te-dist plot`` draws them on one chart.

``profile``: where a step's time goes, per recipe: the job's own model, loss and AdamW in one process (no torchrun,
no collectives; the FP8 recipes with ``model.fp8_dense``, as ``throughput --fp8-dense``; ``--unfused``: the loss on
float32 logits and foreach AdamW). Wall ms per step over ``--steps`` after ``--warmup``, then torch.profiler over two
more steps: kernel time per step summed by kind (``KINDS``, the first whose words a kernel's name holds) and the
``--top`` heaviest kernels; then cProfile over ``--steps`` more: the host's time per step working and waiting for
the GPU (``host_split``: mostly waiting means the step is GPU-bound). On CPU the ops' own CPU time stands in for
kernel time (a check of the script, not a figure).

``switch``: a fast path's switch (a boolean field of te_dist.settings, or an integer one with ``--values``) measured
in the job's step: the same process builds the job's model, loss and AdamW per recipe (as ``profile``) and times
``--steps`` steps per arm in ``--rounds`` interleaved rounds: bf16, then per recipe the switch at its value in force
and flipped (an integer: at each of ``--values``, the value in force first). Printed: median ms per step, bf16 over
each arm, and on over off (an integer: the value in force over each other value).

``idle``: where the GPU waits for the host in the job's step, per recipe (the model, loss and AdamW of ``profile``):
torch.profiler with Python stacks over two steps; printed per step the window from the first kernel's start to the
last one's end and the time no kernel ran in it, then the ``--top`` longest gaps, each with the kernel after it,
the te_dist or benchmark frames that launched that kernel, whether a device->host copy or a synchronize ended just
before (a host read), and the host functions that ran during the gap. CUDA only.

``token-memory``: rank 0's peak RSS (``max_rss_gib`` of metrics.jsonl) after step 1 and after the last
step of the same job on the synthetic data, on a 1 MiB token file and on a ``--gib`` GiB one (the 1 MiB
of random tokens repeated: a file of one token would send every token to the same experts), and the
peak RSS of the parent's one pass over the large file. The file is memory-mapped: a loaded one would
add its size to rank 0's memory.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timing


def te_dist_train(out: Path, nproc: int, *extra, cwd=None, timeout=None) -> list:
    """Run ``te-dist train --nproc N --out OUT *extra`` from this checkout; the rows of its metrics.jsonl."""
    cmd = [sys.executable, "-m", "te_dist.cli", "train", "--nproc", str(nproc), "--out", str(out), *map(str, extra)]
    proc = subprocess.run(cmd, cwd=cwd, env=timing.repo_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def throughput(args) -> list:
    """One ``te-dist train`` job per variant; each row is printed (flushed) when its job ends, its ratio against the
    first variant's, so a run cut short by a time limit still shows the jobs that finished."""
    results = []
    print(f"te-dist train throughput: nproc={args.nproc} steps={args.steps} config={args.config or 'defaults'}")
    print(f"{'recipe':<10}{'ep':>4}{'tokens/s':>14}{'median':>12}{'ratio':>8}{'loss first->last':>22}"
          f"{'job wall s':>12}  settings", flush=True)
    for spec in args.variants:
        recipe, _, rest = spec.partition(":")
        ep, _, settings = rest.partition(":")
        extra = ["--steps", args.steps, "--recipe", recipe, "--ep", ep or args.nproc, "--no-checkpoint",
                 "--log-every", args.steps]
        for setting in filter(None, settings.split("+")):  # SECTION.KEY=VALUE: the job's --SECTION.KEY VALUE
            key, _, value = setting.partition("=")
            extra += [f"--{key}", value]
        extra += ["--config", args.config] if args.config else []
        extra += ["--device", args.device] if args.device else []
        extra += ["--seed", args.seed] if args.seed is not None else []
        extra += ["--model.fp8_dense", "true"] if args.fp8_dense and recipe != "none" else []
        with tempfile.TemporaryDirectory(prefix="te_dist_bench_") as out:
            t0 = time.perf_counter()
            rows = te_dist_train(Path(out), args.nproc, *extra)
            wall = time.perf_counter() - t0
        steady = [r["tokens_per_s"] for r in rows if r["step"] > 2] or [r["tokens_per_s"] for r in rows]
        r = {"recipe": recipe, "ep": int(ep or args.nproc), "settings": settings,
             "tokens_per_s": statistics.mean(steady), "median_tokens_per_s": statistics.median(steady),
             "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"], "job_wall_s": wall}
        r["ratio"] = r["tokens_per_s"] / (results[0] if results else r)["tokens_per_s"]
        results.append(r)
        print(f"{r['recipe']:<10}{r['ep']:>4}{r['tokens_per_s']:>14,.0f}{r['median_tokens_per_s']:>12,.0f}"
              f"{r['ratio']:>8.2f}{r['first_loss']:>11.4f} -> {r['last_loss']:<7.4f}{r['job_wall_s']:>12.1f}  "
              f"{r['settings']}", flush=True)
    print(fp8_ceiling(args.config, {"model.fp8_dense": True} if args.fp8_dense else None))
    return results


def fp8_ceiling(config, overrides=None) -> str:
    """What an FP8 recipe can give this model's tokens/s: only the quantized GEMMs speed up (the expert
    MLPs, and with model.fp8_dense the attention projections and LM head), so by their share of the
    FLOPs (Amdahl) the step's speed-up stays under theirs."""
    from te_dist.train.config import load_config
    from te_dist.train.estimate import fp8_flops_share, speedup_ceiling, speedup_needed

    cfg = load_config(config, overrides=overrides)
    share = fp8_flops_share(cfg.model, cfg.data.seq_len)
    what = "expert MLPs" + (", attention projections and LM head" if cfg.model.fp8_dense else "")
    caps = ", ".join(f"{r}x -> {speedup_ceiling(share, r):.2f}x" for r in (1.2, 1.3, 1.5, 2.0))
    need = speedup_needed(share, 1.25)
    return (f"quantized GEMMs ({what}): {share:.1%} of the FLOPs per token; tokens/s ceiling at their speed-up of "
            f"{caps}; 1.25x tokens/s needs them at {need:.2f}x")


def resume_drift(args) -> list:
    common = ["--steps", args.steps, "--recipe", args.recipe, "--log-every", args.steps]
    rows = []
    with tempfile.TemporaryDirectory(prefix="te_dist_drift_") as tmp:
        root = Path(tmp)
        reference = {r["step"]: r["loss"] for r in te_dist_train(root / "reference", args.nproc, *common,
                                                                  "--ckpt-every", args.at)}
        ckpt = root / "reference" / "checkpoints" / f"step_{args.at:06d}"
        print(f"resume drift: reference {args.nproc} ranks, recipe {args.recipe}, checkpoint at step {args.at}, "
              f"steps {args.at + 1}..{args.steps}")
        print(f"{'ranks':>9}{'first step rel':>16}{'last step rel':>15}{'max rel':>10}{'at step':>9}")
        for nproc in args.reshard:
            resumed = {r["step"]: r["loss"] for r in te_dist_train(root / f"resumed{nproc}", nproc, *common,
                                                                    "--resume", ckpt, "--no-checkpoint")}
            rel = {s: abs(resumed[s] - reference[s]) / abs(reference[s]) for s in range(args.at + 1, args.steps + 1)}
            worst = max(rel, key=rel.get)
            rows.append(dict(reference_ranks=args.nproc, ranks=nproc, first_rel=rel[args.at + 1],
                             last_rel=rel[args.steps], max_rel=rel[worst], max_at_step=worst))
            print(f"{args.nproc:>3} -> {nproc:<3}{rel[args.at + 1]:>16.2e}{rel[args.steps]:>15.2e}"
                  f"{rel[worst]:>10.2e}{worst:>9}")
    return rows


MAN_PAGES = ("bash ls cp mv rm find grep sed tar gzip ssh git make gcc python3 man less cat sort uniq awk xargs "
             "chmod chown ps top kill du df mount curl wget apt dpkg").split()


def _build_corpus(path: Path) -> str:
    """Write English text found on this machine (nothing is downloaded); returns what it is made of."""
    if shutil.which("man") and shutil.which("col"):
        env = dict(os.environ, MANWIDTH="80")
        with open(path, "wb") as out:
            for page in MAN_PAGES:
                rendered = subprocess.run(["man", "-P", "cat", page], capture_output=True, env=env).stdout
                out.write(subprocess.run(["col", "-b"], input=rendered, capture_output=True).stdout)
        if path.stat().st_size > 100_000:
            return f"man pages of {len(MAN_PAGES)} commands"
    licences = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file() and not p.is_symlink())
    path.write_bytes(b"".join(p.read_bytes() for p in licences))
    return f"{len(licences)} licence texts of /usr/share/common-licenses"


def _unigram_entropy(path: Path) -> float:
    import numpy as np

    counts = np.bincount(np.frombuffer(path.read_bytes(), dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def text(args) -> list:
    work = args.work or Path(tempfile.mkdtemp(prefix="train_on_text_"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    what = _build_corpus(corpus)
    entropy = _unigram_entropy(corpus)
    print(f"corpus: {what}, {corpus.stat().st_size:,} bytes; unigram entropy of its bytes {entropy:.4f} nats")
    results = []
    for recipe in args.recipes:
        out = work / "runs" / recipe  # a path: as a flag, a bare "none" would be null
        rows = te_dist_train(out, 2, "--data.path", "corpus.txt", "--steps", args.steps, "--recipe", recipe,
                             "--overwrite", cwd=work)
        vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        step, val = vals[-1]
        results.append(dict(recipe=recipe, first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"], val_loss=val,
                            val_step=step, unigram_entropy=entropy, corpus=what))
        print(f"recipe {recipe}: train loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}; val loss "
              + ", ".join(f"{v:.3f}@{s}" for s, v in vals)
              + f"; final {val:.4f} {'<' if val < entropy else '>='} unigram entropy {entropy:.4f}; plots "
                f"{out / 'plots'}")
    if len(args.recipes) > 1 and args.plot_to:
        subprocess.run([sys.executable, "-m", "te_dist.cli", "plot", *(f"runs/{r}" for r in args.recipes), "--to",
                        str(args.plot_to.resolve())], cwd=work, env=timing.repo_env(), check=True)
        print(f"chart of {', '.join(args.recipes)}: {args.plot_to}")
    return results


MiB = 1 << 20


def _parent_scan_mib(work: Path, data: Path) -> float:
    """Peak RSS growth (MiB) of this process's pass over ``data``: the check the parent runs before any rank."""
    import resource

    from te_dist.train.config import load_config
    from te_dist.train.datasets import prepare_data

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cfg = load_config(overrides={"data.path": str(data), "model.vocab_size": 64, "train.out_dir": str(work / "scan"),
                                 "data.seq_len": 256, "data.global_batch_size": 16})
    prepare_data(cfg)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before


def token_memory(args) -> list:
    import numpy as np

    common = ["--model.vocab_size", "64", "--steps", args.steps, "--no-checkpoint", "--train.plots", "false",
              "--data.seq_len", "256", "--data.global_batch_size", "16", "--log-every", args.steps]
    with tempfile.TemporaryDirectory(prefix="token_file_memory_") as tmp:
        work = Path(tmp)
        small, large = work / "small.bin", work / "large.bin"
        block = np.random.default_rng(0).integers(0, 64, MiB // 2, dtype=np.uint16).tobytes()  # random: no hot expert
        small.write_bytes(block)
        with open(large, "wb") as f:
            for _ in range(int(args.gib * 1024)):
                f.write(block)
        scan = _parent_scan_mib(work, large)
        runs = {}
        for name, data in (("synthetic", ""), ("1 MiB", small), (f"{args.gib:g} GiB", large)):
            rows = te_dist_train(work / f"out_{len(runs)}", args.nproc, "--data.path", data, *common, cwd=work,
                                 timeout=3600)
            runs[name] = {"first": rows[0]["max_rss_gib"] * 1024, "last": rows[-1]["max_rss_gib"] * 1024}
    print(f"{args.steps} steps, {args.nproc} ranks, 16 x 256 tokens per step; rank 0's peak RSS (MiB):")
    print(f"{'token file':>12} {'after step 1':>14} {'after step ' + str(args.steps):>16} {'growth':>8}")
    for name, r in runs.items():
        print(f"{name:>12} {r['first']:>14.1f} {r['last']:>16.1f} {r['last'] - r['first']:>8.1f}")
    small_r, large_r = runs["1 MiB"], runs[f"{args.gib:g} GiB"]
    print(f"large file over small file, peak after the last step: {large_r['last'] - small_r['last']:+.1f} MiB")
    print(f"the parent's pass over the {args.gib:g} GiB file: peak RSS +{scan:.1f} MiB")
    return [dict(data=name, first_mib=r["first"], last_mib=r["last"], parent_scan_mib=scan) for name, r in runs.items()]


# kinds of kernels by the words of their names, the first match wins (attention before GEMMs: cuDNN's flash
# kernels are wgmma GEMMs too; casts and SwiGLU before FP8 GEMMs: their signatures name FP8 types; FP8 GEMMs before
# bf16 ones)
KINDS = (("attention", ("flash", "fmha", "sdpa")),
         ("cast", ("_cast", "cast_", "quant", "amax", "transpose", "rowcol")),  # not "broadcast" (GEMM epilogues)
         ("swiglu", ("swiglu", "silu")),
         ("fp8 gemm", ("fp8", "e4m3", "qqtst", "qrtst", "blockscaled")),
         ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "sm90_")),
         ("loss", ("_cross_entropy", "softmax", "nll", "log_")),
         ("optimizer", ("multi_tensor", "adam")),
         ("norm", ("norm",)),
         ("copy", ("copy", "cat", "index", "scatter", "gather", "sort", "cumsum")),
         ("elementwise", ("elementwise", "vectorized", "reduce", "fill")))


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, words in KINDS if any(w in lower for w in words)), "other")


def job_step(config: str, recipe_name: str, *, device: str, fused: bool):
    """The job's model, loss and AdamW under one recipe in this process (FP8 recipes with ``model.fp8_dense``):
    ``(step, tokens per step, sync)``; ``step()`` runs forward, backward and the optimizer."""
    import torch

    from te_dist.autocast import autocast
    from te_dist.train.config import load_config, resolve_recipe
    from te_dist.train.model import build_model

    device = torch.device(device)
    cfg = load_config(config)
    model_cfg = dataclasses.replace(cfg.model, fp8_dense=recipe_name != "none")
    model = build_model(model_cfg, seed=1, device=device)
    impl = {"fused": True} if fused and device.type == "cuda" else {"foreach": device.type == "cuda"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **impl)
    recipe = resolve_recipe(None if recipe_name == "none" else recipe_name)
    B, S = cfg.data.global_batch_size, cfg.data.seq_len
    tokens = torch.randint(0, model_cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)).to(device)
    targets = torch.roll(tokens, -1, 1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with autocast(recipe=recipe):
            loss = model.loss(tokens, targets, fused=fused)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, B * S, sync


_WAITS = ("synchronize", "'item'", "'tolist'", "'cpu'")  # calls in which the host waits for the GPU (host reads)


def host_split(step, sync, steps: int) -> tuple:
    """(working, waiting) host ms per step over ``steps`` steps under cProfile (its own overhead included): the time
    inside the calls that wait for the GPU (``_WAITS``: event and device synchronizes, a tensor read to the host;
    the final sync too) against the rest. A host that waits most of the step queues work faster than the GPU runs
    it: the step is GPU-bound, and cutting host work would not shorten it."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    waits = lambda key: any(w in key[2] for w in _WAITS)  # noqa: E731
    total = sum(entry[2] for entry in stats.values())
    # the outermost waiting calls (torch.cuda.synchronize holds torch._C._cuda_synchronize), with what they call
    waiting = sum(entry[3] for key, entry in stats.items() if waits(key) and not any(map(waits, entry[4])))
    return (total - waiting) / steps * 1e3, waiting / steps * 1e3


def profile_recipe(config: str, recipe_name: str, *, device: str, fused: bool, steps: int, warmup: int,
                   top: int) -> dict:
    import torch

    step, tokens_per_step, sync = job_step(config, recipe_name, device=device, fused=fused)
    device = torch.device(device)
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    ms = (time.perf_counter() - start) / steps * 1e3
    activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(2):
            step()
        sync()
    per_kernel, per_kind, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        us = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us > 0:
            per_kernel[event.key] += us / 2e3  # ms per step
            per_kind[kind_of(event.key)] += us / 2e3
            calls[event.key] += event.count / 2
    working, waiting = host_split(step, sync, steps)
    print(f"== {config} {recipe_name}: {ms:.2f} ms/step, {tokens_per_step / ms * 1e3:,.0f} tokens/s, kernels "
          f"{sum(per_kind.values()):.2f} ms\n   " + "  ".join(f"{k} {t:.2f}" for k, t in per_kind.most_common())
          + f"\n   host (cProfile): {working:.2f} ms/step working, {waiting:.2f} waiting for the GPU")
    for name, t in per_kernel.most_common(top):
        print(f"   {t:7.2f} ms {calls[name]:5.0f} calls  {name[:150]}")
    del step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ms_per_step": ms, "kinds_ms": dict(per_kind), "top_ms": per_kernel.most_common(top),
            "host_working_ms": working, "host_waiting_ms": waiting}


def _switch_values(field, in_force, given) -> list:
    """The arms' values of a switch: a boolean's value in force then flipped; an integer's ``--values`` (the value in
    force first)."""
    if given is None:
        if not isinstance(field.default, bool):
            raise SystemExit(f"--setting {field.name} is an integer field: give --values, e.g. --values 0,1,2")
        return [in_force, not in_force]
    if isinstance(field.default, bool):
        raise SystemExit(f"--values applies to an integer field of te_dist.settings, got {field.name!r}")
    try:
        values = [int(v) for v in given.split(",")]
    except ValueError:
        raise SystemExit(f"--values takes comma-separated integers, got {given!r}") from None
    return [in_force] + [v for v in dict.fromkeys(values) if v != in_force]


def switch(args) -> list:
    """Per arm {arm, recipe, setting, ms_per_step (median over rounds), over_bf16, on_over_off} (module doc)."""
    from te_dist import settings

    field = next((f for f in settings.fields() if f.name == args.setting), None)
    if field is None or not isinstance(field.default, int):
        raise SystemExit(f"--setting names a boolean or integer field of te_dist.settings, got {args.setting!r}")
    in_force = getattr(settings.current(), args.setting)
    values = _switch_values(field, in_force, args.values)
    base_value = False if isinstance(field.default, bool) else in_force  # gains: over off, or over the value in force
    arms = [("none", None)] + [(r, value) for r in args.recipes.split(",") for value in values]
    steps = {}
    for recipe_name, _ in arms:
        if recipe_name not in steps:
            steps[recipe_name] = job_step(args.config, recipe_name, device=args.device, fused=True)
    times = collections.defaultdict(list)
    for _ in range(args.rounds):  # interleaved, so drift over the run falls on every arm alike
        for recipe_name, value in arms:
            step, _, sync = steps[recipe_name]
            with settings.override(**({} if value is None else {args.setting: value})):
                for _ in range(args.warmup):
                    step()
                sync()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
            times[(recipe_name, value)].append((time.perf_counter() - start) / args.steps * 1e3)
    median = {arm: statistics.median(t) for arm, t in times.items()}
    base = median[("none", None)]
    rows = []
    gain_name = "on/off speed-up" if base_value is False else f"over {base_value}"
    print(f"{args.config}: ms per step, median of {args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'recipe':8s} {args.setting:>22s} {'ms/step':>9s} {'bf16/this':>10s} {gain_name:>16s}")
    for recipe_name, value in arms:
        ms = median[(recipe_name, value)]
        gain = None if value is None or value == base_value else median[(recipe_name, base_value)] / ms
        rows.append(dict(arm=f"{recipe_name}:{value}", recipe=recipe_name, setting=value, ms_per_step=ms,
                         over_bf16=base / ms, on_over_off=gain))
        shown = "-" if value is None else str(value)
        print(f"{recipe_name:8s} {shown:>22s} {ms:9.2f} {base / ms:10.3f} {'' if gain is None else f'{gain:.3f}':>16s}")
    return rows


def _gpu_gaps(events: list) -> tuple:
    """(window us, idle us, [(gap us, gap start, kernel after it)]) of the device events of a chrome trace."""
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not kernels:
        return 0.0, 0.0, []
    busy_until, gaps = kernels[0]["ts"], []
    for k in kernels:
        if k["ts"] > busy_until:
            gaps.append((k["ts"] - busy_until, busy_until, k))
        busy_until = max(busy_until, k["ts"] + k["dur"])
    return busy_until - kernels[0]["ts"], sum(g for g, _, _ in gaps), gaps


def idle_recipe(config: str, recipe_name: str, *, device: str, top: int, warmup: int) -> dict:
    import torch

    step, _, sync = job_step(config, recipe_name, device=device, fused=True)
    for _ in range(warmup):
        step()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(2):
            step()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    window, idle, gaps = _gpu_gaps(events)
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and ("Synchronize" in e["name"] or "Memcpy" in e["name"])]
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op")]
    ours = [e for e in events if e.get("cat") == "python_function" and ("te_dist" in e["name"] or "train.py" in e["name"])]
    print(f"== {config} {recipe_name}: window {window / 2e3:.2f} ms/step, GPU idle {idle / 2e3:.2f} ms/step in "
          f"{len(gaps)} gaps")
    rows = []
    for gap, start, kernel in sorted(gaps, key=lambda g: -g[0])[:top]:
        launch = launches.get(kernel["args"].get("correlation"))
        at = launch["ts"] if launch else kernel["ts"]
        frames = sorted((e for e in ours if e["ts"] <= at <= e["ts"] + e["dur"]), key=lambda e: e["ts"])
        read = any(abs(w["ts"] + w["dur"] - start) < 100 or w["ts"] <= start <= w["ts"] + w["dur"] for w in waits)
        during = sorted((e for e in host if e["ts"] >= start and e["ts"] + e["dur"] <= at and e["dur"] > 15),
                        key=lambda e: -e["dur"])[:4]
        rows.append(dict(gap_us=gap, kernel=kernel["name"][:80], launched_from=[f["name"] for f in frames[-3:]],
                         after_host_read=read, host=[(e["name"][:80], e["dur"]) for e in during]))
        print(f"  {gap / 1e3:6.3f} ms before {kernel['name'][:60]!r}{' (after a host read)' if read else ''}; "
              f"launched from {[f['name'] for f in frames[-2:]]}")
        for name, us in rows[-1]["host"]:
            print(f"      host {us:7.1f} us: {name}")
    del step
    torch.cuda.empty_cache()
    return {"window_ms_per_step": window / 2e3, "idle_ms_per_step": idle / 2e3, "gaps": rows}


def idle(args) -> list:
    """Per recipe: {recipe, window_ms_per_step, idle_ms_per_step, gaps} (module doc)."""
    if args.device != "cuda":
        raise SystemExit("idle times the GPU's gaps: --device cuda")
    return [dict(recipe=r, **idle_recipe(args.config, r, device=args.device, top=args.top, warmup=args.warmup))
            for r in args.recipes.split(",")]


def profile(args) -> list:
    """Per recipe: {recipe, ms_per_step, kinds_ms, top_ms} (module doc)."""
    return [dict(recipe=r, **profile_recipe(args.config, r, device=args.device, fused=not args.unfused,
                                            steps=args.steps, warmup=args.warmup, top=args.top))
            for r in args.recipes.split(",")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("throughput", help="tokens/s and loss per variant, against the first variant")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--config", default=None)
    p.add_argument("--device", default=None, help="te-dist train --device (default: its own choice)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fp8-dense", action="store_true",
                   help="FP8 variants also quantize the attention projections and LM head (model.fp8_dense)")
    p.add_argument("--variants", nargs="+", default=["none:2", "none:1", "current:2", "delayed:2"],
                   help="recipe:ep[:SECTION.KEY=VALUE+...] (ep defaults to --nproc; the settings are passed to "
                        "that job as --SECTION.KEY VALUE); the first is the baseline")
    p = sub.add_parser("resume-drift", help="loss drift of a run resumed on other rank counts")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the reference job")
    p.add_argument("--reshard", type=int, nargs="+", default=[1, 4], help="rank counts to resume on")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--at", type=int, default=30, help="checkpoint step the resumed jobs start from")
    p.add_argument("--recipe", default="none")
    p = sub.add_parser("text", help="train on man pages; the validation loss against the unigram entropy")
    p.add_argument("--work", type=Path, help="where the corpus and the runs go (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipes", nargs="+", default=["current"])
    p.add_argument("--plot-to", type=Path, help="with several recipes: where `te-dist plot` writes their chart")
    p = sub.add_parser("token-memory", help="rank 0's peak RSS on a large token file against a small one")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p = sub.add_parser("profile", help="kernel time per step by kind, per recipe (one process, torch.profiler)")
    p.add_argument("--config", default="launchers/configs/deepseek_like.yaml")
    p.add_argument("--recipes", default="none,current,block")
    p.add_argument("--device", default="cuda")
    p.add_argument("--unfused", action="store_true", help="train.fused_loss and train.fused_optimizer off")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p = sub.add_parser("switch", help="the job's step with a te_dist.settings switch off and on, against bf16")
    p.add_argument("--setting", required=True, help="a boolean or integer field of te_dist.settings, "
                   "e.g. fp8_head_loss")
    p.add_argument("--values", default=None, help="an integer field's values, e.g. 0,1,2 (the value in force first)")
    p.add_argument("--config", default="launchers/configs/deepseek_like.yaml")
    p.add_argument("--recipes", default="current")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p = sub.add_parser("idle", help="where the GPU waits for the host in the job's step (CUDA)")
    p.add_argument("--config", default="launchers/configs/deepseek_like.yaml")
    p.add_argument("--recipes", default="current,none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    timing.add_json_option(*sub.choices.values())
    return parser


def main(argv=None) -> int:
    runs = {"throughput": throughput, "resume-drift": resume_drift, "text": text, "token-memory": token_memory,
            "profile": profile, "switch": switch, "idle": idle}
    return timing.run_subcommand(build_parser(), runs, "train", argv)


if __name__ == "__main__":
    sys.exit(main())
