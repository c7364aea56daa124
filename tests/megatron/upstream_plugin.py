"""pytest plugin: Megatron-Core's own MoE unit tests (pinned in ``upstream*/``) with a chosen experts module.

``upstream_suite.py`` loads it (``-p upstream_plugin``) under torchrun; ``TE_DIST_MCORE_EXPERTS`` picks the arm:

    te_dist     every MoELayer builds te_dist's experts (``te_dist.megatron.experts_spec()``), and a test
                module's own ``GroupedMLP(...)`` builds them too (SequentialMLP(...) stays Megatron's,
                so the checkpoint tests check SequentialMLP <-> te_dist interchange)
    sequential  the control: the same slots build Megatron's local ``SequentialMLP``

Only the setup changes; Megatron's test bodies and assertions are the pinned files, unmodified.
What a CPU run with the megatron-core wheel needs (each applied only where it is missing):
  * gloo instead of NCCL in ``Utils.initialize_distributed``; ``.cuda()`` of modules and tensors,
    ``torch.cuda.current_device/set_device/synchronize`` answer the CPU; the CUDA RNG tracker
    keeps seeds only (CPU initialisation draws from the CPU generator), and activation recompute
    (``tensor_parallel.checkpoint``) saves and restores the CPU generator alone.
  * ``Utils.destroy_model_parallel`` also destroys the groups Megatron forgets: each gloo group keeps
    its threads, and at 2 ranks thousands of them piled up over the run and slowed every test.
  * ``is_te_min_version`` answers False without TransformerEngine (0.16.1 raises TypeError);
    ``get_gpt_layer_with_transformer_engine_spec`` (and 0.19's ``..._submodules``) answers the local one of the same arguments;
    ``transformer_engine.pytorch.fp8`` exists only while ``test_moe_experts.py`` is imported,
    and reports FP8 unavailable.
  * ``megatron.training`` (not in the wheel): ``_set_random_seed`` as in the pinned commit,
    ``parse_args`` an empty namespace, the model builders raise.
  * ``moe_utils.te_general_gemm = None`` (0.16.1 reads it without TransformerEngine).
  * a parallel layout that does not fit the world size is skipped, naming the layout.
  * ``TE_DIST_MCORE_RUN_CUDA_MARKED=1`` (the default on CPU) runs tests that Megatron marks
    ``skipif(not torch.cuda.is_available())`` on the CPU; the control shows which of them a CPU
    cannot run.
  * ``TOO_LARGE_FOR_CPU``: tests skipped for their size (the reason names it).
  * megatron-core 0.19 is a Python 3.12 wheel whose ``megatron.training`` (which its tests import)
    takes ``typing.override``: on Python 3.11 it is ``typing_extensions.override`` (the wheel's pure
    Python unpacked on the path, with triton importable, serves the CPU run of its pinned tests).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import dataclasses
import gc
import importlib
import importlib.util
import inspect
import os
import sys
import types
from datetime import timedelta

import pytest
import torch

from mcore_helpers import CudaMeansCpu, cpu_streams  # tests/megatron is on the path (upstream_suite.py)

if sys.version_info < (3, 12):  # before anything imports megatron.training (module docstring)
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override

ARMS = ("te_dist", "sequential")
ARM = os.environ.get("TE_DIST_MCORE_EXPERTS", "te_dist")
if ARM not in ARMS:
    raise ValueError(f"TE_DIST_MCORE_EXPERTS must be one of {ARMS}, got {ARM!r}")
ON_CPU = not torch.cuda.is_available()
RUN_CUDA_MARKED = ON_CPU and os.environ.get("TE_DIST_MCORE_RUN_CUDA_MARKED", "1") == "1"
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

# Test-name substrings -> why a CPU run skips them (the GPU run does not).
TOO_LARGE_FOR_CPU = {
    "test_moe_layer_discrepancy.py::": "hidden 4096, 8 experts of ffn 16384 (~8.6 GB fp32 weights for the two "
                                       "layers, ~3 TFLOP per forward): GPU only",
}

_CUDA_SKIP_REASON = "CUDA not available"


# ----------------------------------------------------------------------------- experts of the arm
def _arm_experts_spec():
    if ARM == "te_dist":
        from te_dist.megatron import experts_spec

        return experts_spec()
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=1)
    # megatron-core 0.19 returns functools.partial(MoELayer, submodules=...), earlier releases a ModuleSpec
    submodules = spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules
    return submodules.experts


def _arm_grouped_class():
    """What a test module's ``GroupedMLP(num_local_experts, config, pg_collection)`` builds."""
    if ARM == "te_dist":
        from te_dist.megatron import GroupedExperts

        return GroupedExperts

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.moe.experts import SequentialMLP

    def sequential(num_local_experts, config, pg_collection=None):
        _, submodules = LocalSpecProvider().grouped_mlp_modules(False, False)
        return SequentialMLP(num_local_experts, config, submodules, pg_collection=pg_collection)

    return sequential


def _swap_moe_layer_experts():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.__init__
    spec = _arm_experts_spec()

    def __init__(self, config, submodules=None, *args, **kwargs):
        if submodules is not None:
            submodules = dataclasses.replace(submodules, experts=spec)
        original(self, config, submodules, *args, **kwargs)

    MoELayer.__init__ = __init__


# ----------------------------------------------------------------------------- CPU and wheel setup
def _cpu_device():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):  # seeds only: the CPU generator draws CPU-initialised weights
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = None

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
    # tensor_parallel.checkpoint saves the CUDA generator's state beside the CPU one: there is none.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    CudaMeansCpu().__enter__()  # for the whole run: tests write device="cuda" and .to("cuda")
    cpu_streams()  # the alltoall dispatcher copies its split sizes to the host on a side stream




def _gloo_utils():
    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed():
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                "gloo", rank=Utils.rank, world_size=Utils.world_size, timeout=timedelta(seconds=120)
            )
            torch.distributed.barrier()
        Utils.inited = True

    original = Utils.initialize_model_parallel

    def initialize_model_parallel(*args, **kwargs):
        try:
            original(*args, **kwargs)
        except RuntimeError as err:
            if "is not divisible" not in str(err):
                raise
            pytest.skip(f"layout needs more ranks than {Utils.world_size}: {err}")

    destroy = Utils.destroy_model_parallel

    def destroy_model_parallel():
        destroy()
        _destroy_subgroups()

    if ON_CPU:
        Utils.initialize_distributed = staticmethod(initialize_distributed)
        Utils.destroy_model_parallel = staticmethod(destroy_model_parallel)
    Utils.initialize_model_parallel = staticmethod(initialize_model_parallel)


def _destroy_subgroups():
    """Destroy every process group but the default one (``parallel_state.destroy_model_parallel``
    only forgets them; a gloo group's threads live as long as the group)."""
    from torch.distributed import distributed_c10d as c10d

    if not torch.distributed.is_initialized():
        return
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            torch.distributed.destroy_process_group(group)


def _without_te():
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.utils as mutils

    original = mutils.is_te_min_version
    mutils.is_te_min_version = lambda version, check_equality=True: False
    mutils._te_dist_original_is_te_min_version = original
    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None


def _local_for_te(local_name):
    """Megatron's local layer spec (or 0.19's local submodules) given the arguments a TransformerEngine
    one was given, less those the local builder has no parameter for (TE-only switches)."""
    from megatron.core.models.gpt import gpt_layer_specs

    local = getattr(gpt_layer_specs, local_name)
    accepted = inspect.signature(local).parameters

    def build(*args, **kwargs):
        return local(*args, **{name: value for name, value in kwargs.items() if name in accepted})

    return build


# TransformerEngine builder -> its local counterpart (0.19 adds the *_submodules pair)
_TE_TO_LOCAL = {"get_gpt_layer_with_transformer_engine_spec": "get_gpt_layer_local_spec",
                "get_gpt_layer_with_transformer_engine_submodules": "get_gpt_layer_local_submodules"}


def _set_random_seed(seed_, data_parallel_random_init=False, te_rng_tracker=False,
                     inference_rng_tracker=False, use_cudagraphable_rng=False):
    """megatron/training/initialize.py ``_set_random_seed`` at the pinned commit (BSD-3-Clause, NVIDIA)."""
    import random

    import numpy as np
    from megatron.core import mpu, tensor_parallel

    if seed_ is not None and seed_ > 0:
        seed = seed_ + (100 * mpu.get_pipeline_model_parallel_rank())
        if data_parallel_random_init:
            seed = seed + (10 * mpu.get_data_parallel_rank())
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if torch.cuda.device_count() > 0:
            tensor_parallel.model_parallel_cuda_manual_seed(
                seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng
            )
    else:
        raise ValueError("Seed ({}) should be a positive integer.".format(seed_))


def _megatron_training_shim():
    if importlib.util.find_spec("megatron.training") is not None:
        return

    def unavailable(*args, **kwargs):
        raise NotImplementedError("megatron.training is not part of the megatron-core wheel")

    modules = {
        "megatron.training": {},
        "megatron.training.initialize": {"_set_random_seed": _set_random_seed},
        "megatron.training.arguments": {"parse_args": lambda *a, **k: argparse.Namespace()},
        "megatron.training.training": {"get_model": unavailable, "get_args": unavailable},
        "megatron.training.utils": {"unwrap_model": unavailable},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    sys.modules["megatron"].training = sys.modules["megatron.training"]


@contextlib.contextmanager
def _fp8_support_module():
    """``transformer_engine.pytorch.fp8`` answering "no FP8", present only while a test module imports."""
    names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.fp8")
    fp8 = types.ModuleType(names[2])
    fp8.check_fp8_support = lambda: (False, "TransformerEngine is not installed")

    def fp8_autocast(*args, **kwargs):
        raise RuntimeError("TransformerEngine is not installed")

    fp8.fp8_autocast = fp8_autocast
    stubs = [types.ModuleType(names[0]), types.ModuleType(names[1]), fp8]
    sys.modules.update(zip(names, stubs))
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


# Megatron modules the pinned tests import, imported before any stub exists.
_PRELOAD = (
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.transformer_block",
)


def _setup():
    """At plugin import: the pinned conftest files import Megatron's test helpers before pytest_configure."""
    for name in _PRELOAD:
        importlib.import_module(name)
    _megatron_training_shim()
    if not HAVE_TE:
        _without_te()
    if ON_CPU:
        _cpu_device()
    _gloo_utils()
    _swap_moe_layer_experts()


_setup()


# ----------------------------------------------------------------------------- pytest hooks
def pytest_configure(config):
    config.addinivalue_line("markers", "internal: Megatron's marker")
    config.addinivalue_line("markers", "flaky_in_dev: Megatron's marker")
    config.addinivalue_line("markers", "flaky: Megatron's marker")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    needs_stub = not HAVE_TE and isinstance(collector, pytest.Module) and collector.path.name == "test_moe_experts.py"
    with _fp8_support_module() if needs_stub else contextlib.nullcontext():
        yield


def pytest_collection_modifyitems(config, items):
    for item in items:
        if RUN_CUDA_MARKED:
            node = item
            while node is not None:
                node.own_markers[:] = [
                    m for m in node.own_markers
                    if not (m.name == "skipif" and m.kwargs.get("reason") == _CUDA_SKIP_REASON)
                ]
                node = node.parent
        for pattern, reason in TOO_LARGE_FOR_CPU.items():
            if ON_CPU and pattern in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"too large for a CPU run: {reason}"))


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory):
    """tests/unit_tests/conftest.py's fixture (that file also downloads data sets, so it is not pinned)."""
    from tests.unit_tests.dist_checkpointing import TempNamedDir
    from tests.unit_tests.test_utilities import Utils

    tmp_dir = tmp_path_factory.mktemp("ignored", numbered=False).parent.parent / "tmp_dist_ckpt"
    if Utils.rank == 0:
        with TempNamedDir(tmp_dir, sync=False):
            yield tmp_dir
    else:
        yield tmp_dir


@pytest.fixture(autouse=True)
def _finalize_earlier_tests():
    """Run the finalizers of earlier tests' objects now: MoEModelTestContainer.__del__ destroys the
    model-parallel state, and a garbage collection inside a later test would do it mid-test."""
    gc.collect()


@pytest.fixture(autouse=True)
def _arm_module_globals(request, monkeypatch):
    """Direct constructions in a test module build the arm's experts; TE specs answer local ones."""
    module = getattr(request, "module", None)
    if module is None:
        return
    if "GroupedMLP" in vars(module):
        monkeypatch.setattr(module, "GroupedMLP", _arm_grouped_class())
    if not HAVE_TE:
        for te_name, local_name in _TE_TO_LOCAL.items():
            if te_name in vars(module):
                monkeypatch.setattr(module, te_name, _local_for_te(local_name))
