"""The switchboard: every fast-path switch and tuning knob of te_dist, in one frozen object.

Why one place: a switch read at different moments (per call, when a cache fills, once per process)
or flipped as a module global from outside cannot be reasoned about. Here each field is documented
once (what it switches, its environment variable, its default), read from the environment ONCE per
process on first use (never at ``import te_dist``), and changed in code through one context manager:

    import te_dist
    te_dist.settings.tune                      # the value in force (reads the environment on first use)
    with te_dist.settings.override(fused_casts=False, tune=False):
        ...                                    # both off here, restored on exit (also on an exception)

Precedence: an active ``override`` > ``set_for_process`` (what the older setters such as
``te_dist.quantization.set_fused_casts_enabled`` call) > the environment > the default. The values
are process-wide: every thread sees them, autograd's backward threads included, so an override around
a training step also covers its backward. Overrides nest; each one, on exit, removes exactly the
layer it added (so overrides entered from several threads undo correctly in any order); changes are
made under a lock and readers see one immutable ``Settings`` at a time.

A cache whose answer depends on a field keys on the field itself or on ``generation`` (an int that
changes whenever the values in force change; read it after ``current()``), so a changed setting is
never frozen inside a cache (STYLE.md).
This module is a leaf: it imports nothing of te_dist. docs/settings.md lists every field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

__all__ = ["Settings", "EP_TRANSPORTS", "current", "override", "set_for_process", "source", "generation",
           "from_environ", "fields", "describe"]

generation = 0  # changes whenever the values in force change (module docstring); 0 until first read

EP_TRANSPORTS = ("auto", "all_to_all", "peer")  # what MoELayer(transport=...) and ep_transport accept
_TRANSPORT_ALIASES = {"nccl": "all_to_all"}  # the environment's older spelling

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_FLAG_WORDS = "0 or 1 (also true/false, yes/no, on/off)"


# --------------------------------------------------------------------------- environment parsers
# Each takes the variable's text (stripped, non-empty) and returns the field's value, or raises
# ValueError with what is accepted; the caller adds the variable's name and value.


def _flag(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected {_FLAG_WORDS}")


def _inverted_flag(text: str) -> bool:
    return not _flag(text)


def _auto_flag(text: str) -> Optional[bool]:
    if text.lower() == "auto":
        return None
    try:
        return _flag(text)
    except ValueError:
        raise ValueError(f"expected auto, {_FLAG_WORDS}") from None


def _transport(text: str) -> str:
    name = _TRANSPORT_ALIASES.get(text, text)
    if name not in EP_TRANSPORTS:
        raise ValueError(f"expected one of {', '.join(EP_TRANSPORTS)} (or nccl, read as all_to_all)")
    return name


def _tile(text: str) -> int:
    if not text.isdigit():
        raise ValueError("expected a tile id: a non-negative integer (cutlass_kernels.heuristics.FP8_CONFIGS)")
    return int(text)


_BLOCK_LAUNCH_IDS = (0, 1, 2)  # te_dist.quantization.cuda_blocks.BLOCK_LAUNCHES' ids (its tests hold them equal)
_BLOCK_LAUNCH_WORDS = "0, 1 or 2 (te_dist.quantization.cuda_blocks.BLOCK_LAUNCHES)"


def _block_launch(text: str) -> int:
    if text not in tuple(map(str, _BLOCK_LAUNCH_IDS)):
        raise ValueError(f"expected {_BLOCK_LAUNCH_WORDS}")
    return int(text)


# --------------------------------------------------------------------------- code-value checks
# Each returns None when ``value`` is accepted, else the words for what is.


def _is_bool(value) -> Optional[str]:
    return None if isinstance(value, bool) else "True or False"


def _is_auto_bool(value) -> Optional[str]:
    return None if value is None or isinstance(value, bool) else "None (automatic), True or False"


def _is_transport(value) -> Optional[str]:
    return None if value is None or value in EP_TRANSPORTS else f"None (the layer's argument) or one of {EP_TRANSPORTS}"


def _is_tile(value) -> Optional[str]:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    return None if ok else "None (the rule) or a non-negative int tile id"


def _is_block_launch(value) -> Optional[str]:
    ok = isinstance(value, int) and not isinstance(value, bool) and value in _BLOCK_LAUNCH_IDS
    return None if ok else _BLOCK_LAUNCH_WORDS


def _field(default, *, env: str, parse: Callable[[str], object], check: Callable[[object], Optional[str]], doc: str):
    return dataclasses.field(default=default, metadata={"env": env, "parse": parse, "check": check, "doc": doc})


@dataclasses.dataclass(frozen=True)
class Settings:
    """The values in force (``current()``); each field's metadata holds its variable and its doc."""

    cutlass: bool = _field(
        True, env="TE_DIST_DISABLE_CUTLASS", parse=_inverted_flag, check=_is_bool,
        doc="our CUTLASS SM90 grouped GEMMs (bf16 fused epilogues and measured wins; the native FP8 grouped "
            "GEMMs). False: torch._grouped_mm / cuBLAS per expert, and FP8 expert MLPs run emulated. "
            "TE_DIST_DISABLE_CUTLASS=1 sets False.")
    tune: bool = _field(
        True, env="TE_DIST_TUNE", parse=_flag, check=_is_bool,
        doc="measured grouped-GEMM choices: the first CUDA call of a shape bucket times the candidates. "
            "False: the static rule. Also te_dist.gemm.measure.configure(enabled=...) and train.autotune.")
    ep_transport: Optional[str] = _field(
        None, env="TE_DIST_EP_TRANSPORT", parse=_transport, check=_is_transport,
        doc="the expert-parallel token transport of every MoELayer: None keeps each layer's transport= "
            "argument; 'auto', 'all_to_all' or 'peer' overrides it (set it alike on every rank).")
    fused_casts: Optional[bool] = _field(
        None, env="TE_DIST_FUSED_CASTS", parse=_auto_flag, check=_is_auto_bool,
        doc="the fused Triton casts: None (auto) on CUDA devices of compute capability 8.9+ where triton "
            "imports; True everywhere (CPU tensors need TRITON_INTERPRET=1); False never (the compiled casts).")
    torch_compile: Optional[bool] = _field(
        None, env="TE_DIST_TORCH_COMPILE", parse=_auto_flag, check=_is_auto_bool,
        doc="torch.compile of the casts and the memory-bound glue (SwiGLU, the combine's gather-sum): "
            "None (auto) on CUDA; True also on CPU; False eager everywhere.")
    triton_padding: bool = _field(
        True, env="TE_DIST_TRITON_PADDING", parse=_flag, check=_is_bool,
        doc="the Triton kernels that build the expert-row padding maps on CUDA. False: torch ops "
            "(the reference they are checked against).")
    pad_expert_total_rows: bool = _field(
        True, env="TE_DIST_PAD_EXPERT_TOTAL_ROWS", parse=_flag, check=_is_bool,
        doc="where the expert rows are padded for the native FP8 path (per-tensor recipes: each expert to 16 "
            "rows), the last local expert also takes the zero rows that bring the total to a multiple of 128 "
            "(te_dist.moe.padding.TOTAL_ROWS): the casts' transposed copies then store 128-byte aligned rows. "
            "False: the groups' padding only.")
    early_weight_casts: bool = _field(
        True, env="TE_DIST_EARLY_WEIGHT_CASTS", parse=_flag, check=_is_bool,
        doc="on the native quantized path, MoELayer queues its experts' weight casts while the dispatch's counts "
            "travel to the host (the device copy is read into pinned memory, the casts queued, then the host "
            "waits), so the GPU casts while the host waits and reads; the experts' forward takes those copies "
            "(te_dist.ops.GroupedLinear.prepare_weight). False: the casts are queued in the experts' forward.")
    gather_in_experts: bool = _field(
        True, env="TE_DIST_GATHER_IN_EXPERTS", parse=_flag, check=_is_bool,
        doc="at EP size 1 on the native FP8 path, the experts' first GEMM takes the dispatch's row gather "
            "(te_dist.ops.RowGather). False: the dispatcher copies the rows.")
    cuda_rowcol_cast: bool = _field(
        True, env="TE_DIST_CUDA_ROWCOL_CAST", parse=_flag, check=_is_bool,
        doc="the per-tensor FP8 casts that also write the transposed copy (a grouped weight's dgrad layout) "
            "read x once in a CUDA kernel (te_dist.quantization.cuda_rowcol; built on first use, the Triton "
            "path where it cannot be). False: the Triton cast, then the Triton byte transpose.")
    fp8_gather_transposed: bool = _field(
        True, env="TE_DIST_FP8_GATHER_TRANSPOSED", parse=_flag, check=_is_bool,
        doc="the per-tensor FP8 row gather of the expert rows (gather_in_experts) writes the gathered rows and "
            "their transposed copy (the wgrad operand) in one Triton pass that reads the gathered bytes once "
            "(te_dist.quantization.triton_rowcol.gather_rows_fp8). False: index_select, then the byte transpose.")
    cuda_block_cast: bool = _field(
        True, env="TE_DIST_CUDA_BLOCK_CAST", parse=_flag, check=_is_bool,
        doc="Float8BlockScaling's 1x128 casts that write the columnwise copy (activations and gradients of bf16 or "
            "fp16, gathered rows too) run in the CUDA kernel of te_dist.quantization.cuda_blocks (128x128 tiles, "
            "built on first use; the Triton tile cast where it cannot run). False: the Triton tile cast.")
    cuda_block_cast_launch: int = _field(
        2, env="TE_DIST_CUDA_BLOCK_CAST_LAUNCH", parse=_block_launch, check=_is_block_launch,
        doc="how cuda_block_cast's kernel converts to FP8 (te_dist.quantization.cuda_blocks.BLOCK_LAUNCHES): 0, "
            "one value per conversion, each clamped first; 1, two values per conversion, saturated by the "
            "conversion itself (the same bytes, about half the instructions); 2, as 1 with the amaxes taken from "
            "the 16-bit magnitude bits two at a time (no conversion to float): the fastest on an H100 (the job's "
            "block step 1.012x launch 0's).")
    megatron_row_padding: bool = _field(
        True, env="TE_DIST_MEGATRON_ROW_PADDING", parse=_flag, check=_is_bool,
        doc="te_dist.megatron.GroupedExperts pads each local expert's rows to the native FP8 path's row "
            "multiple (Megatron's dispatchers do not), so FP8 recipes run the native kernels there. False: "
            "unaligned rows run the emulated path.")
    megatron_main_grad_fusion: bool = _field(
        False, env="TE_DIST_MEGATRON_MAIN_GRAD_FUSION", parse=_flag, check=_is_bool,
        doc="te_dist.megatron.GroupedExperts built under config.gradient_accumulation_fusion adds its native FP8 "
            "wgrads into Megatron's main_grad itself (fuse_wgrad_accumulation; grad_added_to_main_grad marked). "
            "False: the experts hand autograd their wgrads and Megatron's DDP hook adds them. Off: not yet run on "
            "a GPU (the accumulating kernels were; Megatron's DDP around them on the CPU).")
    fp8_pad_off_grid: bool = _field(
        True, env="TE_DIST_FP8_PAD_OFF_GRID", parse=_flag, check=_is_bool,
        doc="expert features off the FP8 kernels' 128 grid (gpt-oss's 2880) take the native FP8 path, zero "
            "padded to the grid inside GroupedLinear. False: such layers run the emulated path (fake-quantize, "
            "then the bf16 GEMM), slower on an H100.")
    fp8_pad_lean_copies: bool = _field(
        True, env="TE_DIST_FP8_PAD_LEAN_COPIES", parse=_flag, check=_is_bool,
        doc="with fp8_pad_off_grid, GroupedLinear pads its operands by copying the values and zeroing only "
            "the margins (not a zero fill of the whole padded tensor first) and hands the weight gradient back "
            "as a view of the padded one (autograd's accumulation reads it in place). False: F.pad and a "
            "contiguous copy of the weight gradient.")
    fp8_unpadded_tensor_scales: bool = _field(
        True, env="TE_DIST_FP8_UNPADDED_TENSOR_SCALES", parse=_flag, check=_is_bool,
        doc="under the per-tensor recipes (delayed, current) expert features off the 128 grid but on a multiple "
            "of 16 run the native FP8 kernels unpadded: only block scales tile K and N by 128. False: they are "
            "zero padded as fp8_pad_off_grid says.")
    fp8_dense_native: bool = _field(
        True, env="TE_DIST_FP8_DENSE_NATIVE", parse=_flag, check=_is_bool,
        doc="te_dist.ops.BasicLinear under an FP8 recipe runs its three GEMMs on the quantized grouped kernels "
            "as one group (te_dist.ops.basic.dense_fp8) where they run. False: the emulated path "
            "(fake-quantize, then the GEMM in the input's dtype).")
    fp8_head_loss: bool = _field(
        True, env="TE_DIST_FP8_HEAD_LOSS", parse=_flag, check=_is_bool,
        doc="te-dist train's model under Float8CurrentScaling with a native FP8 LM head: the head and the fused "
            "cross-entropy run as one autograd step whose backward writes the logits' gradient as the head's FP8 "
            "operand in one pass (te_dist.train.head_loss), no bf16 gradient and no cast of it. False: the loss "
            "writes the bf16 gradient and the head's backward casts it.")
    head_loss_lane_max: bool = _field(
        True, env="TE_DIST_HEAD_LOSS_LANE_MAX", parse=_flag, check=_is_bool,
        doc="fp8_head_loss's forward kernel takes each row's largest non-target logit from its per-lane running "
            "maxima and one strided read of the target's lane (te_dist.train.cross_entropy), instead of masking the "
            "target at every element (the same value). False: the per-element mask.")
    fp8_fprop_fast_accum: bool = _field(
        True, env="TE_DIST_FP8_FPROP_FAST_ACCUM", parse=_flag, check=_is_bool,
        doc="the tensor-scaled FP8 forward GEMMs (DelayedScaling, Float8CurrentScaling) on our CUTLASS kernels "
            "accumulate all of K in the tensor cores' accumulator, never promoted into a second fp32 one "
            "(TransformerEngine's default for the forward GEMM; dgrad and wgrad keep the promotion), and take the "
            "fast tiles of cutlass_kernels.heuristics.FP8_CONFIGS. False: every FP8 GEMM promotes.")
    fp8_optimizer_copies: bool = _field(
        True, env="TE_DIST_FP8_OPTIMIZER_COPIES", parse=_flag, check=_is_bool,
        doc="te_dist.optim.AdamWWithFP8Copies writes the FP8 copy of each expert weight (the recipes "
            "te_dist.quantization.optimizer_copy.writes_copy names) in the same pass as its update of the weight, "
            "and offers it to the next forward (te_dist.ops.basic.weight_copy), which then casts nothing. False: "
            "that optimizer is torch.optim.AdamW, and forwards cast.")
    fp8_optimizer_copies_current: bool = _field(
        True, env="TE_DIST_FP8_OPTIMIZER_COPIES_CURRENT", parse=_flag, check=_is_bool,
        doc="with fp8_optimizer_copies, Float8CurrentScaling weights too: the update records the weight's amax and "
            "the copy is cast from it right after (no amax pass). False: those weights are cast in the forward.")
    fp8_optimizer_copies_padded: bool = _field(
        True, env="TE_DIST_FP8_OPTIMIZER_COPIES_PADDED", parse=_flag, check=_is_bool,
        doc="with fp8_optimizer_copies, 128x128 block-scaled weights whose features are off the 128 grid too (the "
            "native path pads them, fp8_pad_off_grid): the update writes the copy of the zero padded weight, so "
            "no forward pads and casts it. False: those weights are padded and cast in the forward.")
    fp8_tile: Optional[int] = _field(
        None, env="TE_DIST_FP8_TILE", parse=_tile, check=_is_tile,
        doc="one CUTLASS FP8 tile (an id of cutlass_kernels.heuristics.FP8_CONFIGS) for every FP8 grouped "
            "GEMM, for tile sweeps. None: the rule (heuristics.fp8_config).")
    fp8_wgrad_tile: Optional[int] = _field(
        None, env="TE_DIST_FP8_WGRAD_TILE", parse=_tile, check=_is_tile,
        doc="the CUTLASS FP8 tile of every FP8 wgrad GEMM (an id of cutlass_kernels.heuristics.FP8_CONFIGS), for A/Bs "
            "of a wgrad tile in the training step; fp8_tile, where set, wins. None: the rule (heuristics.fp8_config).")
    fp8_wgrad_accumulation: bool = _field(
        True, env="TE_DIST_FP8_WGRAD_ACCUMULATION", parse=_flag, check=_is_bool,
        doc="an FP8 wgrad that adds into a gradient (GroupedLinear.fuse_wgrad_accumulation: Megatron's main_grad, or a "
            "later micro-batch's weight.grad; te-dist train sets it on its experts while this is on) runs the CUTLASS "
            "instance whose epilogue reads and writes the gradient (d += the product, bf16 or float32), with no pass "
            "of its own. False: the GEMM writes the product, then one add (autograd's or Megatron's hook's), and "
            "te-dist train leaves its experts' gradients to autograd.")


def fields() -> Tuple[dataclasses.Field, ...]:
    """The fields of ``Settings`` in order (metadata: env, doc)."""
    return dataclasses.fields(Settings)


_FIELDS: Dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Settings)}


def from_environ(environ: Mapping[str, str]) -> Tuple[Settings, Dict[str, str]]:
    """(the values ``environ`` sets, where each came from): a pure parse; unset or empty variables
    keep the default. Raises ValueError naming the variable, its value and what it accepts."""
    values, sources = {}, {}
    for f in _FIELDS.values():
        env = f.metadata["env"]
        text = environ.get(env, "").strip()
        if not text:
            sources[f.name] = "default"
            continue
        try:
            values[f.name] = f.metadata["parse"](text)
        except ValueError as exc:
            raise ValueError(f"{env}={environ[env]!r} (te_dist.settings.{f.name}) is not accepted: {exc}") from None
        sources[f.name] = f"{env}={text}"
    return Settings(**values), sources


def _checked(changes: Mapping[str, object]) -> Dict[str, object]:
    """``changes`` validated as a whole (nothing applies unless every one is accepted)."""
    for name, value in changes.items():
        f = _FIELDS.get(name)
        if f is None:
            raise TypeError(f"te_dist.settings has no field {name!r}; its fields: {', '.join(_FIELDS)}")
        accepted = f.metadata["check"](value)
        if accepted is not None:
            raise ValueError(f"te_dist.settings.{name} must be {accepted}, received {value!r}")
    return dict(changes)


class _Board:
    """The process's state: the environment's values (read once), lasting code changes, the active
    override layers, and the resulting values in force. Changed only under ``lock``."""

    def __init__(self):
        self.lock = threading.RLock()
        self.base: Optional[Settings] = None  # environment + set_for_process
        self.base_sources: Dict[str, str] = {}
        self.layers: list = []  # one dict per active override, oldest first
        self.values: Optional[Settings] = None  # what readers see
        self.sources: Dict[str, str] = {}

    def load(self) -> Settings:
        with self.lock:
            if self.base is None:
                self.base, self.base_sources = from_environ(os.environ)
                self.publish()
            return self.values

    def publish(self) -> None:
        global generation
        merged, sources = {}, dict(self.base_sources)
        for layer in self.layers:
            merged.update(layer)
            sources.update({name: f"te_dist.settings.{name}={value!r}" for name, value in layer.items()})
        values = dataclasses.replace(self.base, **merged)
        changed = values != self.values
        self.sources = sources
        self.values = values
        if changed:
            generation += 1  # after the values: a reader that sees the new number sees them too


_BOARD = _Board()


def current() -> Settings:
    """The values in force; the first call reads the environment (a bad variable raises here)."""
    values = _BOARD.values
    return values if values is not None else _BOARD.load()


def source(name: str) -> str:
    """Where the value in force of field ``name`` comes from: ``"default"``, ``"TE_DIST_TUNE=0"``
    or ``"te_dist.settings.tune=False"`` (code: an override or ``set_for_process``)."""
    if name not in _FIELDS:
        raise TypeError(f"te_dist.settings has no field {name!r}; its fields: {', '.join(_FIELDS)}")
    current()
    return _BOARD.sources[name]


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Within the block, the given fields take the given values (process-wide); on exit, also on an
    exception, this layer is removed again. Every value is checked before any applies."""
    layer = _checked(changes)
    with _BOARD.lock:
        _BOARD.load()
        _BOARD.layers.append(layer)
        _BOARD.publish()
        values = _BOARD.values
    try:
        yield values
    finally:
        with _BOARD.lock:
            _BOARD.layers[:] = [other for other in _BOARD.layers if other is not layer]
            _BOARD.publish()


def set_for_process(**changes) -> Settings:
    """Change fields for the rest of the process (below any active override): what the older setters
    (``set_fused_casts_enabled``, ``set_compile_enabled``, ``measure.configure(enabled=...)``) call.
    Code that wants a change for a while uses ``override``. Returns the values in force."""
    checked = _checked(changes)
    with _BOARD.lock:
        _BOARD.load()
        _BOARD.base = dataclasses.replace(_BOARD.base, **checked)
        _BOARD.base_sources.update({name: f"te_dist.settings.{name}={value!r}" for name, value in checked.items()})
        _BOARD.publish()
        return _BOARD.values


def describe() -> Dict[str, dict]:
    """{field: {"value", "source", "env", "default"}} of the values in force (``te-dist env``)."""
    values = current()
    return {name: {"value": getattr(values, name), "source": source(name), "env": f.metadata["env"],
                   "default": f.default} for name, f in _FIELDS.items()}


def __getattr__(name: str):
    """``te_dist.settings.<field>``: the value in force."""
    if name in _FIELDS:
        return getattr(current(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
