"""The resolved configuration of a run: every field it trains with (defaults filled in), and how it was made.

Why one function: ``te-dist train`` prints it at start, rank 0 saves it as ``<out>/config.yaml``,
every checkpoint keeps it in ``meta.json`` and a resume compares the two (run_dir.plan_run). All of them call
:func:`resolved_config`, so they cannot drift apart. The result is plain data (YAML/JSON-ready),
and a saved ``config.yaml`` is itself a valid ``--config`` (its ``provenance`` key is ignored
when read), so a run can be repeated from its output directory.

No torch import here: the CLI parent prints the config within a second of starting.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Optional

from .config import PROVENANCE, JobConfig, resolve_recipe

__all__ = ["resolved_config", "versions", "config_yaml", "write_config_yaml", "summary_lines"]

CONFIG_FILE = "config.yaml"


def _package_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


@functools.lru_cache(maxsize=1)
def _git_describe() -> Optional[str]:
    """``git describe --always --dirty`` of the source checkout te_dist runs from (None for an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        proc = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--tags"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def versions() -> dict:
    """te_dist, torch (from package metadata: no torch import) and git-describe versions."""
    from .. import __version__

    return {"te_dist": __version__, "torch": _package_version("torch"), "git": _git_describe()}


def resolved_config(cfg: JobConfig, *, world_size: Optional[int] = None) -> dict:
    """The run's config as a plain dict: the sections with every field, the recipe as its full
    ``to_dict()`` (a short name expanded), and ``provenance`` (versions; ranks when known)."""
    recipe = resolve_recipe(cfg.recipe)
    out = cfg.to_dict()
    out["recipe"] = recipe.to_dict() if recipe is not None else "none"
    out[PROVENANCE] = {**versions(), "world_size": world_size}
    return out


def config_yaml(resolved: dict) -> str:
    import yaml

    header = "# te-dist resolved config: `te-dist train --config config.yaml` repeats this run\n"
    return header + yaml.safe_dump(resolved, sort_keys=False, default_flow_style=False)


def write_config_yaml(out_dir, resolved: dict) -> Path:
    """Write ``<out_dir>/config.yaml`` whole or not at all (temp file, then an atomic rename)."""
    path = Path(out_dir) / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
    tmp.write_text(config_yaml(resolved))
    tmp.replace(path)
    return path


def _scalar(value) -> str:
    """A value as YAML writes it (``null``, ``true``), so the printout reads like config.yaml."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def summary_lines(resolved: dict, prefix: str = "[te-dist] config ") -> list:
    """One compact line per section (the start-up printout; config.yaml has the same data as YAML)."""
    lines = []
    for section, values in resolved.items():
        if isinstance(values, dict):
            body = " ".join(f"{k}={_scalar(v)}" for k, v in values.items())
        else:
            body = _scalar(values)
        lines.append(f"{prefix}{section}: {body}")
    return lines
