"""The training job's configuration: nested, keyword-only, validated in one place.

Why one validator: ``te-dist train`` checks the config in the parent process BEFORE it starts
any worker, so a typo or an impossible shape fails at once with a message that names the key
to change, instead of surfacing as one rank's traceback (or a hang) after the launch. The
workers run the same check again (they may be started by a plain ``torchrun``).

YAML layout (every key optional; see ``launchers/configs/*.yaml``)::

    model:    {vocab_size, hidden_size, ffn_hidden_size, num_layers, num_heads,
               num_experts, top_k, activation, expert_bias, aux_loss_coeff, dtype}
    data:     {seq_len, global_batch_size, branching, seed, path, token_dtype, val_fraction, cache_dir}
    train:    {steps, lr, min_lr_ratio, warmup_steps, weight_decay, seed, log_every,
               ckpt_every, keep_last, checkpoint, out_dir, device, threads, log,
               startup_timeout_s, collective_timeout_s, checkpoint_timeout_s, exit_grace_s,
               stop_grace_s, autotune, eval_every, eval_batches, plots}
    parallel: {ep, transport}
    recipe:   "none" | "delayed" | ... | a Recipe.to_dict() mapping ({"type": ..., settings...})
    provenance: {...}   # written by te-dist into config.yaml (versions, ranks); ignored when read

Every key is also a ``--SECTION.KEY VALUE`` flag of ``te-dist train`` (``te_dist.train.args``);
flags reach :func:`load_config` as ``{"section.key": value}`` overrides and pass the same checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..recipe import RECIPE_NAMES, Recipe, recipe_from_name

__all__ = [
    "ModelConfig",
    "DataConfig",
    "TrainConfig",
    "ParallelConfig",
    "JobConfig",
    "ConfigError",
    "load_config",
    "config_from_dict",
    "resolve_recipe",
    "config_fields",
    "recipe_setting_names",
    "closest",
    "DEFAULT_RECIPE",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
ACTIVATIONS = ("swiglu", "gelu", "relu")
DEVICES = ("auto", "cpu", "cuda")
LOGS = ("jsonl", "tensorboard")


def model_dtype(dtype: str, device_type: str) -> str:
    """The torch dtype name ``model.dtype`` means on a ``device_type`` ("cpu" or "cuda") run."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_type == "cuda" else "float32"
TRANSPORTS = ("auto", "all_to_all", "peer")
TOKEN_SUFFIXES = (".bin", ".npy")  # pre-tokenized token files (te_dist/train/token_files.py)
TEXT_SUFFIXES = (".txt", ".jsonl")  # text, read as byte-level tokens (te_dist/train/text_tokens.py)
TOKEN_DTYPES = ("uint16", "uint32")
BYTE_VOCAB_SIZE = 256  # the vocabulary of byte-level tokens: model.vocab_size's default for a text data.path
MAX_VAL_FRACTION = 0.5  # te_dist.moe.TRANSPORTS, spelled here so the check imports no torch
DEFAULT_RECIPE = "current"  # Float8CurrentScaling: stateless FP8 (emulated on CPU), a real recipe key to agree on


class ConfigError(ValueError):
    """A bad training configuration; the message names the key, what was expected and what was given."""


def _f(default, help: str, **kwargs):
    """A config field with the help text ``te-dist train --help`` shows for its ``--SECTION.KEY`` flag."""
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(kw_only=True)
class ModelConfig:
    """A small decoder: embedding, ``num_layers`` x (RMSNorm, causal attention, RMSNorm, MoE), LM head."""

    vocab_size: int = _f(64, "vocabulary size (embedding rows, LM head outputs); checked against a --data.path "
                             f"file's largest token; a text data.path makes the default {BYTE_VOCAB_SIZE} (byte-level tokens)")
    hidden_size: int = _f(128, "model width (a multiple of 128 tiles every recipe's scaling blocks)")
    ffn_hidden_size: int = _f(128, "hidden size of each expert's MLP")
    num_layers: int = _f(2, "transformer blocks")
    num_heads: int = _f(4, "attention heads (must divide hidden_size)")
    num_experts: int = _f(4, "experts per MoE layer (must be divisible by the EP size)")
    top_k: int = _f(2, "experts each token is routed to")
    activation: str = _f("swiglu", f"expert activation, one of {list(ACTIVATIONS)}")
    expert_bias: bool = _f(False, "per-expert biases in both expert GEMMs")
    aux_loss_coeff: float = _f(0.01, "router load-balancing loss weight")
    dtype: str = _f("auto", f"parameter and activation dtype, one of {list(DTYPES)}; auto: bfloat16 on GPUs "
                            "(what the native FP8 expert kernels take), float32 on CPU")
    fp8_dense: bool = _f(False, "the attention projections and the LM head run under the recipe too (te_dist "
                                "BasicLinear: native FP8 kernels where te_dist.settings.fp8_dense_native is on, "
                                "else emulated); false: they stay in the model dtype, only the experts are quantized")


@dataclass(kw_only=True)
class DataConfig:
    """What the model reads: a token or text file (``path``), else synthetic Markov-chain text
    (``branching`` possible successors per token, so the loss can fall)."""

    seq_len: int = _f(32, "tokens per sequence")
    global_batch_size: int = _f(8, "sequences per step, summed over all ranks")
    branching: int = _f(2, "likely successors per token in the synthetic Markov chain")
    seed: int = _f(1234, "data seed (the batch of step s is a pure function of it and s)")
    path: str = _f("", "training data: a token file (.bin: flat tokens as nanoGPT and Megatron write them; .npy) "
                       "or text (.txt; .jsonl with a \"text\" field) read as byte-level tokens; empty: the "
                       "synthetic Markov chain")
    token_dtype: str = _f("uint16", f"element type of a .bin token file, one of {list(TOKEN_DTYPES)} "
                                    "(a .npy file carries its own)")
    val_fraction: float = _f(0.02, "the tail of the data.path file held out for the validation loss "
                                   f"(0 to {MAX_VAL_FRACTION}; 0: no validation)")
    cache_dir: str = _f("", "where text is tokenized to (once; rebuilt when the text changes); "
                            "empty: te_dist_out/token_cache (shared by every run)")


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = _f(60, "total training steps (a resumed run continues up to this step)")
    lr: float = _f(1e-2, "peak learning rate (linear warm-up, then cosine decay)")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr")
    warmup_steps: int = _f(4, "linear warm-up steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    fused_optimizer: bool = _f(True, "CUDA: AdamW's fused kernel, one pass over weights, gradients and states (false: "
                                     "foreach); CPU runs keep the plain loop")
    fp8_optimizer_copies: bool = _f(True, "CUDA, FP8 recipes: te_dist.optim.AdamWWithFP8Copies writes the expert "
                                          "weights' FP8 copies with its update (block scaling; per-tensor scaling on "
                                          "one rank, whose amax all-reduce reduces nothing) and every step's first "
                                          "forward takes them (false: torch's AdamW, the forwards cast)")
    fused_loss: bool = _f(True, "CUDA: the loss's cross-entropy in te_dist.train.cross_entropy's kernels (float32 "
                                "math over the bf16 logits, no float32 copy); false: F.cross_entropy on float32 logits")
    seed: int = _f(0, "model initialisation seed")
    micro_batches: int = _f(1, "micro-batches per optimizer step (gradient accumulation; each rank's share of "
                               "the global batch is split evenly); FP8 weights are cast once per step")
    log_every: int = _f(6, "print a progress line every K steps (metrics.jsonl gets every step)")
    ckpt_every: int = _f(30, "checkpoint every K steps (0: only at the end)")
    keep_last: int = _f(0, "keep only the newest K checkpoints (0: keep all)")
    checkpoint: bool = _f(True, "false: write no checkpoint at all (benchmarks)")
    out_dir: Optional[str] = _f(None, "output dir: config.yaml, metrics.jsonl, checkpoints/, tensorboard/; null: a new "
                                      "directory per run under te_dist_out/ (te_dist_out/latest names the newest)")
    device: str = _f("auto", f"one of {list(DEVICES)}; auto: one GPU per rank when GPUs exist, else CPU")
    threads: int = _f(1, "torch intra-op threads per rank on CPU (fixed, so results are reproducible)")
    log: str = _f("jsonl", f"metrics sinks besides stdout, one of {list(LOGS)} (metrics.jsonl is always written)")
    startup_timeout_s: float = _f(600.0, "start-up (rendezvous, process groups) must end within this, else the launcher "
                                         "names the ranks that had not joined and kills the job")
    collective_timeout_s: float = _f(300.0, "a collective waiting longer on a stuck or dead peer fails on every live rank")
    checkpoint_timeout_s: float = _f(600.0, "a checkpoint save (every rank's shard written, the commit) must end within "
                                            "this, else the job ends with a named error and no half-written checkpoint")
    exit_grace_s: float = _f(60.0, "after the first rank finishes the run, time the others get to exit before they are "
                                   "killed (exit code 3: the run is complete)")
    stop_grace_s: float = _f(8.0, "after SIGINT/SIGTERM, time the ranks get to finish the step (and save) before a kill")
    autotune: bool = _f(True, "measure grouped-GEMM choices per shape bucket on first use (CUDA; docs/kernels.md "
                              "\"Measured entries\"); TE_DIST_TUNE=0 also turns it off")
    eval_every: int = _f(0, "validation loss every N steps and at the last step; 0: ten times a run with a "
                            "data.path (val_fraction > 0), never on the synthetic data (its batches are all new)")
    eval_batches: int = _f(8, "global batches of held-out data one validation reads (the same ones each time)")
    plots: bool = _f(True, "write <out>/plots/loss.png and throughput.png at the end (needs matplotlib: "
                           "pip install -e '.[plot]')")

    def evaluates_at(self, step: int, *, has_val: bool) -> bool:
        """Whether ``step`` ends with a validation loss (``has_val``: the data holds held-out tokens)."""
        every = self.eval_every or (math.ceil(self.steps / 10) if has_val else 0)
        return bool(every) and (step % every == 0 or step == self.steps)


@dataclass(kw_only=True)
class ParallelConfig:
    ep: Optional[int] = _f(None, "expert-parallel size; null: every rank of the job")
    transport: str = _f("auto", f"how tokens move between EP ranks, one of {list(TRANSPORTS)} (docs/moe.md \"Transports\")")


@dataclass(kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recipe: Union[str, dict] = "current"  # DEFAULT_RECIPE

    def to_dict(self) -> dict:
        return {
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            "train": dataclasses.asdict(self.train),
            "parallel": dataclasses.asdict(self.parallel),
            "recipe": self.recipe,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    # ------------------------------------------------------------------ validation
    def validate(self, *, world_size: Optional[int] = None) -> "JobConfig":
        """Raise ConfigError naming the offending key; ``world_size`` adds the layout checks."""
        m, d, t = self.model, self.data, self.train
        for section_name, section in (("model", m), ("data", d), ("train", t), ("parallel", self.parallel)):
            _check_types(section_name, section)
        _positive("model.vocab_size", m.vocab_size, minimum=2)
        for key in ("hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_experts", "top_k"):
            _positive(f"model.{key}", getattr(m, key))
        if m.hidden_size % m.num_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}")
        if m.top_k > m.num_experts:
            raise ConfigError(f"model.top_k={m.top_k} exceeds model.num_experts={m.num_experts}")
        _choice("model.activation", m.activation, ACTIVATIONS)
        if m.aux_loss_coeff < 0:
            raise ConfigError(f"model.aux_loss_coeff must be >= 0, got {m.aux_loss_coeff}")
        _choice("model.dtype", m.dtype, DTYPES)
        _positive("data.seq_len", d.seq_len, minimum=2)
        _positive("data.global_batch_size", d.global_batch_size)
        _positive("data.branching", d.branching)
        if d.branching >= m.vocab_size:
            raise ConfigError(f"data.branching={d.branching} must be < model.vocab_size={m.vocab_size}")
        _check_data(d, t)
        _positive("train.steps", t.steps)
        if not t.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {t.lr}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        _positive("train.keep_last", t.keep_last, minimum=0)
        if t.warmup_steps < 0 or t.weight_decay < 0 or t.ckpt_every < 0:
            raise ConfigError(
                f"train.warmup_steps, train.weight_decay and train.ckpt_every must be >= 0, got "
                f"{t.warmup_steps}, {t.weight_decay}, {t.ckpt_every}"
            )
        for key in ("startup_timeout_s", "collective_timeout_s", "checkpoint_timeout_s", "exit_grace_s", "stop_grace_s"):
            if not getattr(t, key) > 0:
                raise ConfigError(f"train.{key} must be > 0 seconds, got {getattr(t, key)}")
        _positive("train.log_every", t.log_every)
        _positive("train.threads", t.threads)
        _positive("train.micro_batches", t.micro_batches)
        _choice("train.device", t.device, DEVICES)
        _choice("train.log", t.log, LOGS)
        if self.parallel.ep is not None:
            _positive("parallel.ep", self.parallel.ep)
        _choice("parallel.transport", self.parallel.transport, TRANSPORTS)
        recipe = resolve_recipe(self.recipe)  # raises ConfigError for an unknown name or setting
        block = _RECIPE_BLOCK.get(type(recipe).__name__)
        if block is not None:
            for key in ("hidden_size", "ffn_hidden_size"):
                if getattr(m, key) % block:
                    raise ConfigError(
                        f"model.{key}={getattr(m, key)} is not a multiple of {block}, which the "
                        f"{type(recipe).__name__} recipe's scaling blocks need (or pick another recipe)"
                    )
        if world_size is not None:
            self.layout(world_size)
        return self

    def layout(self, world_size: int) -> tuple:
        """(ep_size, sequences per rank) for ``world_size`` ranks; raises ConfigError when impossible."""
        ep = self.parallel.ep if self.parallel.ep is not None else world_size
        m, d = self.model, self.data
        if world_size % ep:
            raise ConfigError(f"parallel.ep={ep} does not divide the number of ranks ({world_size}); use --ep or --nproc")
        if m.num_experts % ep:
            raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by parallel.ep={ep}")
        if d.global_batch_size % world_size:
            raise ConfigError(
                f"data.global_batch_size={d.global_batch_size} is not divisible by the number of ranks ({world_size})"
            )
        micro = self.train.micro_batches
        if (d.global_batch_size // world_size) % micro:
            raise ConfigError(
                f"train.micro_batches={micro} does not divide the sequences per rank "
                f"(data.global_batch_size={d.global_batch_size} over {world_size} ranks = {d.global_batch_size // world_size})"
            )
        return ep, d.global_batch_size // world_size


# ---------------------------------------------------------------------- helpers

PROVENANCE = "provenance"  # top-level key of a saved config.yaml: how the run was made, not what it runs

# Block-scaled recipes quantize the GEMMs' K and N dims in blocks of this many elements.
_RECIPE_BLOCK = {"Float8BlockScaling": 128, "MXFP8BlockScaling": 32, "NVFP4BlockScaling": 16}

_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig}


def _check_types(section_name: str, section) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        expected = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        key = f"{section_name}.{f.name}"
        if expected == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{key} must be an int, got {type(value).__name__} {value!r}")
        if expected == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ConfigError(f"{key} must be a number, got {type(value).__name__} {value!r}")
        if expected == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {type(value).__name__} {value!r}")
        if expected == "str" and not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {type(value).__name__} {value!r}")
        if expected == "Optional[int]" and value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{key} must be an int or null, got {type(value).__name__} {value!r}")
        if expected == "Optional[str]" and value is not None and not isinstance(value, str):
            raise ConfigError(f"{key} must be a string or null, got {type(value).__name__} {value!r}")


def data_kind(path: str) -> Optional[str]:
    """"text", "tokens", or None for the synthetic data (an empty ``data.path``); by the file's suffix."""
    if not path:
        return None
    suffix = Path(path).suffix.lower()
    return "text" if suffix in TEXT_SUFFIXES else "tokens" if suffix in TOKEN_SUFFIXES else suffix


def _check_data(d: "DataConfig", t: "TrainConfig") -> None:
    """The shape of the data settings (the file itself is checked by te_dist.train.datasets)."""
    kind = data_kind(d.path)
    if kind not in (None, "text", "tokens"):
        raise ConfigError(f"data.path {d.path}: expected a token file ({', '.join(TOKEN_SUFFIXES)}) or text "
                          f"({', '.join(TEXT_SUFFIXES)}), got a {kind or 'suffix-less'} file")
    _choice("data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    if not 0 <= d.val_fraction <= MAX_VAL_FRACTION:
        raise ConfigError(f"data.val_fraction must be in [0, {MAX_VAL_FRACTION}], got {d.val_fraction}")
    _positive("train.eval_every", t.eval_every, minimum=0)
    _positive("train.eval_batches", t.eval_batches)
    if kind is not None and d.val_fraction == 0 and t.eval_every:
        raise ConfigError(f"train.eval_every={t.eval_every} needs held-out data, but data.val_fraction is 0; "
                          f"set data.val_fraction (e.g. 0.02) or train.eval_every 0")


def _positive(key: str, value: int, *, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")


def resolve_recipe(spec) -> Optional[Recipe]:
    """The Recipe a config's ``recipe`` entry names: a short name or a ``Recipe.to_dict()`` mapping."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in RECIPE_NAMES:
            raise ConfigError(f"recipe must be one of {list(RECIPE_NAMES)} or a Recipe.to_dict() mapping, got {spec!r}")
        return recipe_from_name(spec)
    if isinstance(spec, dict):
        try:
            return Recipe.from_dict(spec)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"recipe: {exc}") from None
    raise ConfigError(f"recipe must be a name or a mapping, got {type(spec).__name__} {spec!r}")


def _section_from_dict(name: str, data) -> Any:
    cls = _SECTIONS[name]
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"config section {name!r} must be a mapping, got {type(data).__name__} {data!r}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in config section {name!r}{_did_you_mean(unknown, allowed)}; "
                          f"expected some of {allowed}")
    data = dict(data)
    for f in dataclasses.fields(cls):
        # YAML 1.1 reads "3e-3" (no dot) as a string; accept it for float settings.
        if f.type == "float" and isinstance(data.get(f.name), str):
            try:
                data[f.name] = float(data[f.name])
            except ValueError:
                raise ConfigError(f"{name}.{f.name} must be a number, got {data[f.name]!r}") from None
    return cls(**data)


def config_from_dict(data: dict) -> JobConfig:
    """Build (not yet validate) a JobConfig from a plain mapping, rejecting unknown keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(data).__name__}")
    allowed = [*_SECTIONS, "recipe", PROVENANCE]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown top-level config key(s) {unknown}{_did_you_mean(unknown, allowed)}; "
                          f"expected some of {allowed}")
    sections = {name: _section_from_dict(name, data.get(name)) for name in _SECTIONS}
    model_given = data.get("model") if isinstance(data.get("model"), dict) else {}
    if data_kind(sections["data"].path) == "text" and "vocab_size" not in model_given:
        sections["model"].vocab_size = BYTE_VOCAB_SIZE  # byte-level tokens: the vocabulary the text needs
    return JobConfig(**sections, recipe=data.get("recipe", DEFAULT_RECIPE))


def load_config(path: Optional[Union[str, Path]] = None, *, overrides: Optional[dict] = None) -> JobConfig:
    """Read a YAML (or JSON) file, apply ``{"section.key": value}`` overrides, validate (shape only)."""
    data: dict = {}
    if path is not None:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        data = loaded if loaded is not None else {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    data = {k: (dict(v) if isinstance(v, dict) and k != "recipe" else v) for k, v in data.items()}
    overrides = dict(overrides or {})
    if "recipe" in overrides:
        data["recipe"] = overrides.pop("recipe")
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if section == "recipe":
            data["recipe"] = _with_recipe_setting(data.get("recipe", DEFAULT_RECIPE), key, value)
            continue
        sec = data.setdefault(section, {})
        if not isinstance(sec, dict):
            raise ConfigError(f"config section {section!r} must be a mapping, got {sec!r}")
        sec[key] = value
    return config_from_dict(data).validate()


# ------------------------------------------------------------------ keys and flags


def closest(name: str, candidates, n: int = 3) -> list:
    """The valid names nearest to a misspelt ``name`` (for "did you mean" hints)."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.6)


def _did_you_mean(unknown, allowed) -> str:
    hints = sorted({c for u in unknown for c in closest(u, allowed)})
    return f" (did you mean {', '.join(map(repr, hints))}?)" if hints else ""


def config_fields() -> list:
    """``(dotted key, type name, default, help)`` for every field of every section, in YAML order."""
    out = []
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f"{section}.{f.name}", str(f.type), default, f.metadata.get("help", "")))
    return out


def recipe_setting_names() -> dict:
    """{setting name: help} over every recipe class (the ``--recipe.KEY`` flags)."""
    names = {}
    for recipe_name in RECIPE_NAMES:
        recipe = recipe_from_name(recipe_name)
        for setting in getattr(type(recipe), "_SETTINGS", ()):
            names.setdefault(setting.name, setting.doc)
    return names


def _with_recipe_setting(spec, key: str, value) -> dict:
    """``spec`` (a recipe name or mapping) as a mapping with setting ``key`` replaced by ``value``."""
    recipe = resolve_recipe(spec)
    if recipe is None:
        raise ConfigError(f"recipe.{key} was given but the recipe is 'none'; pick one with --recipe NAME")
    mapping = dict(spec) if isinstance(spec, dict) else recipe.to_dict()
    allowed = [name for name in mapping if name != "type"]
    if key not in allowed:
        raise ConfigError(f"recipe.{key} is not a setting of {mapping['type']}{_did_you_mean([key], allowed)}; "
                          f"its settings are {allowed}")
    mapping[key] = value
    return mapping
