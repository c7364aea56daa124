"""The training loop of ``te-dist train``: build, (resume), train, checkpoint, summarise.

One step on every rank:

    batch(step) -> autocast(recipe, group=WORLD) { loss = CE(model(x), y) } -> backward
      -> reduce grads (dense: WORLD, experts: EDP; both / W) -> AdamW -> loss all-reduce for the log

The loss all-reduce also carries the ranks' SIGINT/SIGTERM votes (te_dist.train.stop): every rank
stops after the same step, SIGTERM after saving a checkpoint, and rank 0 prints one line saying so.
Every collective is bounded by ``train.collective_timeout_s`` (te_dist.distributed.bounded).

Every ``train.eval_every`` steps (and after the last) the ranks score the held-out batches under
``no_grad`` (te_dist.train.datasets), after the step and before its checkpoint, so a resumed run
continues from the same state.

Rank 0 prints the agreed recipe key and the fusion plan once, a progress line every
``log_every`` steps (and at every evaluation) and a summary; it also writes ``<out>/config.yaml``
(the resolved config), ``<out>/metrics.jsonl`` (one JSON line per step with the run id, losses as
exact floats, the fields of progress.py) so runs can be repeated and compared bit for bit, and at
the end ``<out>/plots/`` (plots.py; skipped with a note without matplotlib). What the run may do
with ``<out>`` (refuse, resume, overwrite) is decided in run_dir.py.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .. import settings
from ..autocast import autocast
from ..distributed.bounded import wait_collective
from ..ops.basic.wgrad_accumulation import set_fuse_wgrad_accumulation
from ..ops.basic.weight_copy import set_first_microbatch
from ..optim import AdamWWithFP8Copies
from .batch_ahead import BatchAhead
from .checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from .config import JobConfig, resolve_recipe
from .datasets import build_data, prepare_data
from .estimate import flops_per_token, memory_estimate
from .faults import FaultInjection
from .job_files import RankPhase
from .model import build_model
from .plots import plots_after_run
from .parallel import GradientReducer, Runtime, dense_group, init_runtime
from .progress import Progress, peak_flops_note
from .resolved import resolved_config, summary_lines, write_config_yaml
from .run_dir import Run, RunPlan, open_run
from .stop import StopRequest

__all__ = ["FaultInjection", "TrainResult", "train", "lr_at"]


@dataclass
class TrainResult:
    first_step: int
    last_step: int
    losses: dict = field(default_factory=dict)  # step -> global mean loss
    tokens_per_s: float = float("nan")
    wall_s: float = 0.0
    checkpoint: Optional[str] = None
    stopped_by: Optional[str] = None  # "SIGINT" / "SIGTERM" when a signal ended the run early
    val: Optional[tuple] = None  # (step, validation loss) of the run's last evaluation


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(t.steps - t.warmup_steps, 1)
    progress = min(max(step - t.warmup_steps, 0) / span, 1.0)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _say(runtime: Runtime, text: str) -> None:
    if runtime.is_main:
        print(text, flush=True)


def _fuser_report(model) -> str:
    try:
        from ..ops import OperationFuser
    except ImportError as exc:
        return f"fusion plan: unavailable ({exc})"
    for name, module in model.named_modules():
        if isinstance(module, OperationFuser):
            plan = getattr(module, "plan", None)
            described = plan.describe() if plan is not None else "(no plan yet)"
            body = "\n".join("  " + line for line in described.splitlines())
            return f"[te-dist] fusion key: {module.fusion_key!r}\n[te-dist] fusion plan of {name}:\n{body}"
    return "fusion plan: the model holds no OperationFuser"


def _expert_path_report(model, recipe) -> str:
    """The path the expert MLPs took in the first step: native grouped kernels, or the emulated /
    split reference, and why (te_dist.support.explain_path; te-dist env shows the same per device)."""
    from ..moe import MoELayer
    from ..support import explain_path

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        return "[te-dist] expert MLPs: the model holds no MoELayer"
    fc1, fc2 = layers[0].fc1, layers[0].fc2
    path, why = explain_path(recipe, fc1.weight.dtype, device=fc1.weight.device)
    if recipe is not None and path == "native":
        if not (fc1.native_shape_ok and fc2.native_shape_ok):
            path, why = "emulated", ("expert features are not multiples of 128 (the FP8 kernels' scale block; "
                                     "te_dist.settings.fp8_pad_off_grid pads them, it is off)")
        elif not all(layer.fc1.has_native_weight_copy for layer in layers):
            path, why = "emulated", ("the first step did not run the native kernels (see the warnings in the rank "
                                     "logs, <out>/logs/)")
    return f"[te-dist] expert MLPs: {path} ({why})"


def _dense_path_report(model, recipe) -> Optional[str]:
    """With ``model.fp8_dense``: the path the attention projections and the LM head took in the first
    step (te_dist.ops.basic.dense_fp8 says when the native one runs); None when they are not quantized."""
    from ..ops import BasicLinear

    dense = [m for m in model.modules() if isinstance(m, BasicLinear)]
    if recipe is None or not dense:
        return None
    if all(m.has_native_weight_copy for m in dense):
        return "[te-dist] dense linears (attention, LM head): native (FP8 grouped kernels as one group)"
    native = sum(m.has_native_weight_copy for m in dense)
    why = ("te_dist.settings.fp8_dense_native is off" if not settings.current().fp8_dense_native else
           "a CPU run, features off the 128 grid or rows off the recipe's alignment (te_dist.ops.basic.dense_fp8)")
    return f"[te-dist] dense linears (attention, LM head): emulated in {len(dense) - native} of {len(dense)} ({why})"


@dataclass
class _Job:
    """Everything one rank builds before its first step."""

    runtime: Runtime
    recipe: object
    agreed_key: Optional[str]
    data: object  # MarkovData or TokenData (datasets.py)
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    reducer: GradientReducer
    ep_size: int
    micro_batches: int
    fused_loss: bool
    batches: BatchAhead  # the next step's batch, built while the device runs this one


def _optimizer_impl(device: torch.device, fused: bool) -> dict:
    """AdamW's implementation keywords: on CUDA the fused kernel (the FP8 weight copies follow its writes,
    docs/quantization.md) or foreach; elsewhere the plain loop."""
    if device.type != "cuda":
        return {"foreach": False}
    return {"fused": True} if fused else {"foreach": True}


def _build(cfg: JobConfig, phase: RankPhase, fault: Optional[FaultInjection], *, announce: bool) -> _Job:
    t, m = cfg.train, cfg.model
    if t.device != "cuda" and not (t.device == "auto" and torch.cuda.is_available()):
        torch.set_num_threads(t.threads)  # fixed thread count: CPU reductions stay reproducible
    ep_size, _ = cfg.layout(int(os.environ.get("WORLD_SIZE", "1")))
    recipe = resolve_recipe(cfg.recipe)
    if fault is not None:
        fault.at(int(os.environ.get("RANK", "0")), "startup")
    rt = init_runtime(device=t.device, ep_size=ep_size, timeout_s=t.collective_timeout_s,
                      startup_timeout_s=t.startup_timeout_s, checkpoint_timeout_s=t.checkpoint_timeout_s)
    phase.started()
    agreed_key = None
    if recipe is not None:
        from ..distributed import sync_recipe

        agreed_key = sync_recipe(recipe, group=dense_group())  # raises on every rank if ranks disagree
    plan = prepare_data(cfg)  # the te-dist parent checked the file and filled the cache: this finds them
    if plan is not None and announce and rt.is_main and plan.cache_line():
        print(plan.cache_line(), flush=True)
    data = build_data(cfg, plan)
    model = build_model(m, seed=t.seed, ep_group=rt.groups.ep_group, device=rt.device,
                        transport=cfg.parallel.transport)
    fuse_expert_wgrad_accumulation(model)
    kwargs = dict(lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay,
                  **_optimizer_impl(rt.device, t.fused_optimizer))  # CPU: the plain loop, as in every CPU run
    optimizer = AdamWWithFP8Copies(model.parameters(), copies_of=[model], **kwargs) \
        if t.fp8_optimizer_copies and recipe is not None else torch.optim.AdamW(model.parameters(), **kwargs)
    return _Job(rt, recipe, agreed_key, data, model, optimizer, GradientReducer(model, rt), ep_size, t.micro_batches,
                t.fused_loss, BatchAhead(data, rt.rank, rt.world_size))


def fuse_expert_wgrad_accumulation(model: torch.nn.Module) -> None:
    """While ``te_dist.settings.fp8_wgrad_accumulation`` is on, the expert ops add their FP8 weight gradients into
    ``.grad`` themselves (``fuse_wgrad_accumulation``): nothing here hooks a gradient's accumulation
    (``GradientReducer`` reduces after the backward), the condition that attribute asks of its caller."""
    set_fuse_wgrad_accumulation(model, settings.current().fp8_wgrad_accumulation)


def _drives_weight_copies(job: _Job) -> bool:
    """Training drives ``is_first_microbatch``: several micro-batches reuse one weight cast, or the optimizer's
    copies go to the next driven forward."""
    return job.micro_batches > 1 or isinstance(job.optimizer, AdamWWithFP8Copies)


def _step(job: _Job, step: int, lr: float, stop_votes: list) -> tuple:
    """One optimizer step on every rank; returns (global mean loss, global gradient norm, agreed stop
    signal or None) (collective)."""
    rt, model = job.runtime, job.model
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    x_BS, y_BS = (b.to(rt.device) for b in job.batches.take(step))
    micro = job.micro_batches
    loss = torch.zeros((), device=rt.device)
    drive = _drives_weight_copies(job)
    for i, (x_bS, y_bS) in enumerate(zip(x_BS.chunk(micro), y_BS.chunk(micro))):
        if drive:  # the FP8 expert weights: cast (or the optimizer's copy taken) at the first micro-batch, then reused
            set_first_microbatch(model, i == 0)
        with autocast(recipe=job.recipe, group=dense_group() if job.recipe is not None else None):
            micro_loss = model.loss(x_bS, y_bS, fused=job.fused_loss) / micro
        micro_loss.backward()
        loss += micro_loss.detach().float()
    # A non-finite local loss still enters every collective below; the all-reduced loss then
    # tells every rank, and all of them stop at the same step.
    # [loss, SIGINT votes, SIGTERM votes]: the stop decision rides on the loss all-reduce (stop.py). The votes
    # are filled in on the device: a host->device copy here would wait for the whole backward.
    loss_and_votes = torch.stack([loss, *(torch.full((), float(v), device=loss.device) for v in stop_votes)])
    job.reducer.reduce()
    # The same all-reduce carries both squared gradient norms (see GradientReducer.squared_norms).
    stats = torch.cat([loss_and_votes, job.reducer.squared_norms()])
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.batches.build(step + 1)  # while the device runs the optimizer (batch_ahead.py)
    if dist.is_initialized():
        wait_collective(dist.all_reduce(stats, async_op=True), "loss all-reduce", None)
    summed_loss, sigint_votes, sigterm_votes, dense_sq, expert_sq = stats.tolist()
    global_loss = summed_loss / rt.world_size
    grad_norm = math.sqrt(max(dense_sq / rt.world_size + expert_sq / rt.groups.edp_size, 0.0))
    if not math.isfinite(global_loss):
        raise FloatingPointError(f"loss is {global_loss} at step {step}; lower train.lr or check the recipe")
    return global_loss, grad_norm, StopRequest.agreed(sigint_votes, sigterm_votes)


def _evaluate(job: _Job, cfg: JobConfig) -> float:
    """The mean loss over the held-out batches, the same on every rank (collective; no state changes
    but what a forward under the recipe records)."""
    rt, model = job.runtime, job.model
    if _drives_weight_copies(job):  # cast the FP8 expert weights afresh, keep no copy (an offered one is dropped):
        set_first_microbatch(model, None)  # training's reuse rule stays its own
    total = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad(), autocast(recipe=job.recipe, group=dense_group() if job.recipe is not None else None):
        for index in range(cfg.train.eval_batches):
            x_BS, y_BS = (b.to(rt.device) for b in job.data.val_batch(index, rt.rank, rt.world_size))
            total += model.loss(x_BS, y_BS, fused=job.fused_loss).double().cpu()
    if dist.is_initialized():
        wait_collective(dist.all_reduce(total, async_op=True), "validation loss all-reduce", None)
    return float(total) / (cfg.train.eval_batches * rt.world_size)


def _recipe_state_word(recipe, meta: dict) -> str:
    if recipe is None:
        return "none (no recipe)"
    return "restored" if meta["restored_recipe_state"] else "starts fresh (other ranks, EP size or recipe)"


def _resume(job: _Job, plan: RunPlan, cfg: JobConfig) -> tuple:
    """(start step, loss history) after loading the checkpoint the run's plan chose (and verified)."""
    rt, recipe = job.runtime, job.recipe
    meta = load_checkpoint(plan.checkpoint, model=job.model, optimizer=job.optimizer, runtime=rt,
                           model_config=asdict(cfg.model), recipe=recipe,
                           recipe_key=str(recipe) if recipe is not None else None, verify=False)
    _say(rt, f"[te-dist] resumed from {plan.checkpoint} at step {meta['step']} "
             f"(written by {meta['world_size']} ranks, ep={meta['ep']}; now {rt.world_size} ranks, ep={job.ep_size}; "
             f"recipe state {_recipe_state_word(recipe, meta)})")
    return int(meta["step"]), {int(k): v for k, v in meta.get("losses", {}).items()}


def save_step(job: _Job, run: Run, cfg: JobConfig, step: int, history: dict, *, phase: Optional[RankPhase] = None,
              fault: Optional[FaultInjection] = None) -> Path:
    """Collective: checkpoint ``step`` into the run's output directory (with the run id, the resolved
    config and the losses so far), then apply ``train.keep_last``. ``phase`` marks the save's start
    and end for the launcher's ``train.checkpoint_timeout_s`` (job_watch.py)."""
    phase = phase if phase is not None else RankPhase()
    meta = {"model": asdict(cfg.model), "recipe": cfg.recipe, "recipe_key": job.agreed_key, "run_id": run.run_id,
            "config": resolved_config(cfg, world_size=job.runtime.world_size),
            "losses": {str(k): v for k, v in sorted(history.items())}}
    phase.saving(step)
    if fault is not None:
        fault.at(job.runtime.rank, "save", step)
    path = save_checkpoint(checkpoint_dir(run.out_dir, step), model=job.model, optimizer=job.optimizer,
                           runtime=job.runtime, step=step, meta=meta, keep_last=cfg.train.keep_last)
    phase.saved(step)
    return path


def _announce(cfg: JobConfig, world_size: int) -> str:
    """The resolved config and the memory estimate, as ``te-dist train`` prints them before the launch
    (for jobs started by a plain torchrun, whose ranks may span machines: no comparison with this one's memory)."""
    uses_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    estimate = memory_estimate(cfg, world_size, device_type="cuda" if uses_gpu else "cpu")
    return "\n".join([*summary_lines(resolved_config(cfg, world_size=world_size)),
                      f"[te-dist] memory per rank (estimate): {estimate.describe()}"])


def train(cfg: JobConfig, *, resume=None, fault: Optional[FaultInjection] = None, stop: Optional[StopRequest] = None,
          overwrite: bool = False, skip_invalid: bool = False, announce: bool = True,
          phase: Optional[RankPhase] = None) -> TrainResult:
    """Run the job on this rank (collective; call on every rank of the torchrun job).

    ``resume``: None, True (the newest valid checkpoint in ``train.out_dir``) or a checkpoint /
    output directory; ``overwrite`` and ``skip_invalid`` as the flags of the same names.
    ``stop``: the signals this rank received (installed by the worker); None never stops early.
    ``announce``: rank 0 prints the resolved config and the memory estimate first (False when the
    ``te-dist`` parent already did). ``phase``: where this rank is, marked for the launcher's
    deadlines and named by a failure (job_files.RankPhase; the worker passes its own).
    """
    cfg.validate()
    # train.autotune: false turns the measured grouped-GEMM choices off for this run; true leaves
    # te_dist.settings.tune as the process has it (TE_DIST_TUNE=0 keeps it off).
    with settings.override(**({} if cfg.train.autotune else {"tune": False})):
        return _train(cfg, resume=resume, fault=fault, stop=stop, overwrite=overwrite, skip_invalid=skip_invalid,
                      announce=announce, phase=phase)


def _train(cfg: JobConfig, *, resume, fault, stop, overwrite, skip_invalid, announce, phase) -> TrainResult:
    t, m, d = cfg.train, cfg.model, cfg.data
    phase = phase if phase is not None else RankPhase()
    if announce and int(os.environ.get("RANK", "0")) == 0:
        print(_announce(cfg, int(os.environ.get("WORLD_SIZE", "1"))), flush=True)
    job = _build(cfg, phase, fault, announce=announce)
    rt = job.runtime
    run = open_run(cfg, rt, resume=resume, overwrite=overwrite, skip_invalid=skip_invalid)
    cfg.train.out_dir = str(run.out_dir)  # a null out_dir became a new run directory: config.yaml records it
    tensorboard = None
    if rt.is_main:
        write_config_yaml(run.out_dir, resolved_config(cfg, world_size=rt.world_size))
        if t.log == "tensorboard":
            from .tensorboard import TensorBoardWriter

            tensorboard = TensorBoardWriter(run.out_dir)
    start_step, history = _resume(job, run.plan, cfg) if run.plan.checkpoint is not None else (0, {})
    tokens_per_step = d.global_batch_size * d.seq_len
    num_params = sum(p.numel() for p in job.model.parameters())
    _say(rt, (f"[te-dist] {rt.world_size} ranks ({rt.backend}, {rt.device.type}) | ep={job.ep_size} "
              f"edp={rt.groups.edp_size} | {num_params:,} params/rank | {m.num_layers} layers, {m.num_experts} "
              f"experts top-{m.top_k} | {tokens_per_step} tokens/step | steps {start_step + 1}..{t.steps}"))
    _say(rt, f"[te-dist] agreed recipe key: {job.agreed_key}")
    _say(rt, f"[te-dist] data: {job.data.describe()}")
    note = peak_flops_note(rt.device)
    if note:
        _say(rt, f"[te-dist] {note}; model FLOPs per token: {flops_per_token(m, d.seq_len):,}")

    speeds, losses, last_ckpt, last_val = [], {}, None, None
    progress = Progress(cfg, start_step=start_step, world_size=rt.world_size, device=rt.device)
    t_start = time.perf_counter()
    for step in range(start_step + 1, t.steps + 1):
        t0 = time.perf_counter()
        phase.step(step)
        if fault is not None:
            fault.at(rt.rank, "step", step)
        lr = lr_at(step, cfg)
        loss, grad_norm, stop_signal = _step(job, step, lr, stop.votes() if stop is not None else [0.0, 0.0])
        losses[step] = loss
        dt = time.perf_counter() - t0
        if step > start_step + 1 or t.steps == start_step + 1:  # the first step pays for warm-up
            speeds.append(tokens_per_step / dt)
        if step == start_step + 1:  # the plans of the training step, before an evaluation runs its own
            _say(rt, _fuser_report(job.model))
            _say(rt, _expert_path_report(job.model, job.recipe))
            dense_report = _dense_path_report(job.model, job.recipe)
            if dense_report:
                _say(rt, dense_report)
        evaluated = t.evaluates_at(step, has_val=job.data.has_val)
        val_loss = _evaluate(job, cfg) if evaluated else None
        if evaluated:
            last_val = (step, val_loss)
        row = progress.record(step, loss=loss, lr=lr, grad_norm=grad_norm, step_s=dt,
                              val_loss=val_loss) if rt.is_main else None
        if rt.is_main:
            run.append_metrics(row)
            if tensorboard is not None:
                tensorboard.write(row)
        if rt.is_main and (step % t.log_every == 0 or step == t.steps or step == start_step + 1 or evaluated):
            _say(rt, progress.line(row))
            if tensorboard is not None:
                tensorboard.flush()
        stopping = stop_signal is not None and step < t.steps  # on the last step the run simply ends
        preempted = stopping and stop_signal == signal.SIGTERM
        saved_now = t.checkpoint and ((t.ckpt_every and step % t.ckpt_every == 0) or step == t.steps or preempted)
        if saved_now:
            history.update(losses)
            last_ckpt = save_step(job, run, cfg, step, history, phase=phase, fault=fault)
            if not stopping:  # the stop line below names it
                _say(rt, f"[te-dist] checkpoint {last_ckpt}")
        if stopping:
            saved = f"checkpoint {last_ckpt}" if saved_now else "no checkpoint written"
            _say(rt, f"te-dist train: stopped by {stop_signal.name} after step {step}/{t.steps}; {saved}")
            if tensorboard is not None:
                tensorboard.close()
            run.close()
            return TrainResult(start_step + 1, step, losses, float("nan"), time.perf_counter() - t_start,
                               str(last_ckpt) if last_ckpt else None, stopped_by=stop_signal.name)

    if tensorboard is not None:
        tensorboard.close()
    result = TrainResult(start_step + 1, t.steps, losses, sum(speeds) / len(speeds) if speeds else float("nan"),
                         time.perf_counter() - t_start,
                         str(last_ckpt) if last_ckpt else (run.plan.checkpoint if not losses else None), val=last_val)
    if rt.is_main:
        _print_summary(result, job.data, rt, job.ep_size, job.agreed_key)
    if t.plots and result.losses:
        _draw_plots(rt, run.out_dir)
    run.close()
    phase.done(t.steps, t.steps, result.checkpoint)
    return result


def _draw_plots(rt: Runtime, out_dir: Path) -> None:
    """Rank 0 draws the run's plots while the other ranks wait (collective), so no rank is done before
    they exist: the launcher's exit deadline (train.exit_grace_s, from the first rank done) starts after."""
    if rt.is_main:
        print(plots_after_run(out_dir), flush=True)
    if dist.is_initialized():
        wait_collective(dist.barrier(async_op=True), "end-of-run wait for rank 0's plots", None)


def _print_summary(result: TrainResult, data, rt: Runtime, ep_size: int, agreed_key) -> None:
    lines = ["", "=" * 24 + " te-dist train summary " + "=" * 24]
    if result.losses:
        first, last = result.losses[result.first_step], result.losses[result.last_step]
        lines.append(f"steps      {result.first_step}..{result.last_step} on {rt.world_size} ranks "
                     f"({rt.backend}, {rt.device.type}), ep={ep_size}")
        refs = ", ".join(f"{name} {value:.4f}" for name, value in data.reference_losses().items())
        lines.append(f"loss       {first:.4f} -> {last:.4f}  ({refs})")
        if result.val is not None:
            step, val_loss = result.val
            lines.append(f"val loss   {val_loss:.4f} (perplexity {math.exp(min(val_loss, 700)):.2f}) at step {step}")
        lines.append(f"throughput {result.tokens_per_s:,.0f} tokens/s (mean over steps after the first)")
    else:
        lines.append(f"nothing to do: the checkpoint is already at step {result.first_step - 1}")
    lines.append(f"wall time  {result.wall_s:.1f} s")
    lines.append(f"recipe key {agreed_key}")
    lines.append(f"checkpoint {result.checkpoint}")
    print("\n".join(lines), flush=True)
    sys.stdout.flush()
