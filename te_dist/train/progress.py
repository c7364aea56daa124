"""Rank 0's account of a training run: one metrics row per step and the progress line.

Each row holds loss, learning rate, global gradient norm, step time, tokens trained on so far,
tokens/s, MFU (model FLOPs per token x tokens/s over the job's peak; GPUs of known peak only),
rank 0's peak memory (GPU allocator peak, or the process's peak RSS on CPU), elapsed time and
ETA; on a step that ends with an evaluation also ``val_loss`` and ``val_ppl`` (its perplexity). The same row goes to
``metrics.jsonl``, to TensorBoard (``--log tensorboard``) and, every ``log_every`` steps, to stdout.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from typing import Optional

import torch

from .estimate import GiB, flops_per_token, peak_flops

__all__ = ["Progress", "format_duration", "peak_flops_note"]

_ETA_WINDOW = 20  # recent step times the ETA averages (the first step, which pays for warm-up, is left out)


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / total)
    return "#" * filled + "." * (width - filled)


class Progress:
    """Turns each finished step into a metrics row and, on request, a progress line."""

    def __init__(self, cfg, *, start_step: int, world_size: int, device: torch.device):
        d = cfg.data
        self.total_steps = cfg.train.steps
        self.start_step = start_step
        self.tokens_per_step = d.global_batch_size * d.seq_len
        self.flops_per_token = flops_per_token(cfg.model, d.seq_len)
        self.device = device
        peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        self.job_peak_flops = peak * world_size if peak else None
        self.t_start = time.perf_counter()
        self._recent = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _memory(self) -> dict:
        if self.device.type == "cuda":
            return {"peak_gpu_mem_gib": torch.cuda.max_memory_allocated(self.device) / GiB}
        return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB}  # Linux: KiB

    def record(self, step: int, *, loss: float, lr: float, grad_norm: float, step_s: float,
               val_loss: Optional[float] = None) -> dict:
        """The metrics row of ``step`` (call once per step, in order)."""
        if step > self.start_step + 1:
            self._recent = (self._recent + [step_s])[-_ETA_WINDOW:]
        per_step = statistics.mean(self._recent) if self._recent else step_s
        tokens_per_s = self.tokens_per_step / step_s
        mfu = self.flops_per_token * tokens_per_s / self.job_peak_flops if self.job_peak_flops else None
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_s": step_s,
               "tokens": step * self.tokens_per_step, "tokens_per_s": tokens_per_s, "mfu": mfu, **self._memory(),
               "elapsed_s": time.perf_counter() - self.t_start, "eta_s": (self.total_steps - step) * per_step}
        if val_loss is not None:
            row["val_loss"], row["val_ppl"] = val_loss, math.exp(min(val_loss, 700.0))  # finite: JSON has no inf
        return row

    def line(self, row: dict) -> str:
        parts = [f"step {row['step']:>5}/{self.total_steps} [{_bar(row['step'], self.total_steps)}] loss {row['loss']:.4f}"]
        if "val_loss" in row:
            parts.append(f"val {row['val_loss']:.4f} ppl {row['val_ppl']:.2f}")
        parts += [f"lr {row['lr']:.2e}", f"gnorm {row['grad_norm']:.3g}", f"{row['tokens_per_s']:>9,.0f} tok/s"]
        if row["mfu"] is not None:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        if "peak_gpu_mem_gib" in row:
            parts.append(f"mem {row['peak_gpu_mem_gib']:.1f} GiB")
        else:
            parts.append(f"rss {row['max_rss_gib']:.2f} GiB")
        parts.append(f"{format_duration(row['elapsed_s'])} ETA {format_duration(row['eta_s'])}")
        return " | ".join(parts)


def peak_flops_note(device: torch.device) -> Optional[str]:
    """Why the MFU column is absent, or None when it is shown."""
    if device.type != "cuda":
        return "MFU is shown on GPUs only (no peak FLOP/s is defined for a CPU)"
    name = torch.cuda.get_device_name(device)
    return None if peak_flops(name) else f"MFU not shown: no peak FLOP/s is listed for {name} (te_dist/train/estimate.py)"
