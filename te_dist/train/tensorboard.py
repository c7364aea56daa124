"""``--log tensorboard``: the metrics rows as TensorBoard scalars under ``<out>/tensorboard/``.

Why optional: the ``tensorboard`` package (which torch's SummaryWriter needs) is not a
dependency of te_dist; ``te-dist train`` checks for it before starting any rank and says how to
install it, instead of failing on one rank after the launch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from .config import ConfigError

__all__ = ["TensorBoardWriter", "tensorboard_missing", "TENSORBOARD_DIR"]

TENSORBOARD_DIR = "tensorboard"


def tensorboard_missing() -> Optional[str]:
    """None when TensorBoard event files can be written here, else what to do about it."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return ("--log tensorboard needs the `tensorboard` package, which is not installed: "
                "pip install tensorboard (it is part of the `test` extra: pip install -e '.[test]')")
    return None


class TensorBoardWriter:
    """Writes every numeric field of a metrics row as scalar ``train/<field>`` at the row's step."""

    def __init__(self, out_dir):
        problem = tensorboard_missing()
        if problem is not None:
            raise ConfigError(problem)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(out_dir) / TENSORBOARD_DIR
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, row: dict) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self._writer.add_scalar(f"train/{key}", value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
