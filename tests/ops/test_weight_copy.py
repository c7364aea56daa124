"""The FP8 weight copy follows the weight, whoever writes it; reuse only where the caller says so.

The native path is forced on CPU (the quantized GEMM's CPU backend multiplies the same quantized
operands the kernels read); on a GPU (``-m gpu``) the predicate decides and the test checks that the
native kernels ran. "The output with the kept copy equals the output with a freshly cast copy" is
checked bit for bit; a fresh cast is a new op holding the weight's current values.
"""

import copy

import pytest
import torch

import te_dist as td
from te_dist import kernels as K
from te_dist import recipe as R
from te_dist.moe import MoELayer
from te_dist.ops import GroupedLinear, OperationFuser
from te_dist.ops.basic import weight_copy

RECIPES = [R.Float8CurrentScaling(), R.Float8BlockScaling()]
SIZES = (128, 0, 128)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    if request.param == "cpu":
        monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)
    return torch.device(request.param)


@pytest.fixture
def casts(monkeypatch):
    """The number of weight casts so far (prepare_quantized_weight calls)."""
    made = []
    real = K.prepare_quantized_weight
    monkeypatch.setattr(K, "prepare_quantized_weight", lambda q: made.append(1) or real(q))
    return made


def _op(device="cpu", seed=0):
    torch.manual_seed(seed)
    return GroupedLinear(3, 256, 128, dtype=torch.bfloat16, device=device)


def _forward(op, x, recipe, requires_grad=False):
    with td.autocast(recipe=recipe), torch.set_grad_enabled(requires_grad):
        y = OperationFuser([op])(x, torch.tensor(SIZES))
    assert op.has_native_weight_copy  # the native path ran (on a GPU: the predicate's answer)
    return y


def _fresh(op, x, recipe):
    """The output of a new op holding ``op``'s current weight values (a fresh cast)."""
    twin = GroupedLinear(op.num_groups, op.in_features, op.out_features, dtype=op.weight.dtype,
                         device=op.weight.device)
    with torch.no_grad():
        twin.weight.copy_(op.weight)
    return _forward(twin, x, recipe)


def _x(device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(SIZES), 256, dtype=torch.bfloat16, generator=g).to(device)


def _optimizer_writer(factory):
    def write(op, step_input, recipe):
        opt = factory([op.weight])
        _forward(op, step_input, recipe, requires_grad=True).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return write


def _data_copy(op, *_):
    op.weight.data.copy_(torch.randn_like(op.weight))


def _data_assign(op, *_):
    op.weight.data = torch.randn_like(op.weight)  # new storage


def _into_flat_buffer(op):
    """Megatron's distributed optimizer keeps the weights as views of one flat parameter buffer."""
    buf = torch.zeros(op.weight.numel() + 64, dtype=op.weight.dtype, device=op.weight.device)
    buf[64:].copy_(op.weight.detach().reshape(-1))
    op.weight.data = buf[64:].view_as(op.weight)
    op.flat_buffer = buf


def _flat_buffer(op, *_):
    """... and writes the updated shards into the buffer through ``.data`` (an all-gather lands there)."""
    op.flat_buffer.data[64:] = torch.randn_like(op.flat_buffer[64:])


def _load(op, *_):
    op.load_state_dict({"weight": torch.randn_like(op.weight)})


WRITERS = {
    "adamw_fused": _optimizer_writer(lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)),
    "adamw_foreach": _optimizer_writer(lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True)),
    "sgd": _optimizer_writer(lambda p: torch.optim.SGD(p, lr=1.0)),
    "data_copy": _data_copy,
    "data_assign": _data_assign,
    "flat_buffer_via_data": _flat_buffer,
    "load_state_dict": _load,
}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("writer", WRITERS, ids=str)
def test_default_copy_follows_every_writer(device, recipe, writer):
    """Default (is_first_microbatch None): after any write, the output equals a fresh cast's."""
    op, x = _op(device), _x(device)
    if writer == "flat_buffer_via_data":
        _into_flat_buffer(op)
    before = _forward(op, x, recipe)
    WRITERS[writer](op, _x(device, 2), recipe)
    after = _forward(op, x, recipe)
    assert not torch.equal(after, before), "the write did not change the weights"
    assert torch.equal(after, _fresh(op, x, recipe))


@pytest.mark.parametrize("writer", ["adamw_fused", "adamw_foreach", "sgd"])
def test_an_optimizer_step_ends_the_micro_batch_reuse(device, writer):
    """A kept copy is cast anew after any torch optimizer step, even when the caller says False."""
    recipe = R.Float8CurrentScaling()
    op, x = _op(device), _x(device)
    op.is_first_microbatch = True
    _forward(op, x, recipe)
    assert op.is_first_microbatch is False  # the op flips it after the first micro-batch
    WRITERS[writer](op, _x(device, 2), recipe)  # its forward reuses the copy (same weights), then the step
    op.is_first_microbatch = False
    assert torch.equal(_forward(op, x, recipe), _fresh(op, x, recipe))


def test_in_place_and_load_writes_end_the_reuse(device):
    """Writes that bump the version or move the storage end the reuse too."""
    recipe = R.Float8BlockScaling()
    for writer in (_load, _data_assign):
        op, x = _op(device), _x(device)
        op.is_first_microbatch = True
        _forward(op, x, recipe)
        writer(op)
        assert op.is_first_microbatch is False
        assert torch.equal(_forward(op, x, recipe), _fresh(op, x, recipe))


def test_reuse_only_when_the_caller_says_so(device, casts):
    recipe = R.Float8BlockScaling()
    op, x = _op(device), _x(device)
    for _ in range(3):  # default: a cast every forward, nothing kept
        _forward(op, x, recipe)
    assert len(casts) == 3 and not op._weight_copy.kept
    op.is_first_microbatch = True  # gradient accumulation: cast once, reuse for the later micro-batches
    outs = [_forward(op, x, recipe, requires_grad=True) for _ in range(4)]
    assert len(casts) == 4 and op._weight_copy.kept
    assert all(torch.equal(o, outs[0]) for o in outs)
    op.is_first_microbatch = True  # the next optimizer step's first micro-batch casts again
    _forward(op, x, recipe)
    assert len(casts) == 5
    op.is_first_microbatch = None
    _forward(op, x, recipe)
    assert len(casts) == 6 and not op._weight_copy.kept


def test_a_changed_recipe_never_reuses_the_copy(device, casts):
    op, x = _op(device), _x(device)
    op.is_first_microbatch = True
    _forward(op, x, R.Float8CurrentScaling())
    out = _forward(op, x, R.Float8BlockScaling())
    assert len(casts) == 2
    assert torch.equal(out, _fresh(op, x, R.Float8BlockScaling()))


def test_the_flag_is_checked(device):
    op, x = _op(device), _x(device)
    op.is_first_microbatch = 1
    with pytest.raises(TypeError, match="is_first_microbatch must be None, True or False, got 1"):
        _forward(op, x, R.Float8CurrentScaling())
    layer = MoELayer(256, 128, 4, 2, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        layer(_x(device)[:8], is_first_microbatch="yes")


def test_moe_layer_hands_the_flag_to_both_expert_gemms(device, casts):
    layer = MoELayer(256, 128, 4, 2, dtype=torch.bfloat16, device=device)
    x = _x(device)
    with td.autocast(recipe=R.Float8CurrentScaling()):
        layer(x)  # default: both GEMMs cast, nothing kept
        assert len(casts) == 2 and not layer.fc1._weight_copy.kept
        layer(x, is_first_microbatch=True)
        assert layer.is_first_microbatch is False and layer.fc2.is_first_microbatch is False
        assert len(casts) == 4 and layer.fc1._weight_copy.kept and layer.fc2._weight_copy.kept
        layer(x)  # the later micro-batches: the setting stays False, the copies are reused
        assert len(casts) == 4
        layer.is_first_microbatch = None
        layer(x)
        assert len(casts) == 6 and layer.fc1.is_first_microbatch is None


def test_the_step_count_comes_from_a_global_optimizer_hook(device):
    op, x = _op(device), _x(device)
    op.is_first_microbatch = True
    _forward(op, x, R.Float8CurrentScaling())  # the first kept copy installs the hook
    before = weight_copy.optimizer_steps()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    opt.step()
    assert weight_copy.optimizer_steps() == before + 1
    # a deep copy of the op (FSDP-style parameter swaps build new modules) casts for itself
    twin = copy.deepcopy(op)
    twin.is_first_microbatch = False
    assert torch.equal(_forward(twin, x, R.Float8CurrentScaling()), _fresh(op, x, R.Float8CurrentScaling()))


def _prepare(op, recipe):
    """What MoELayer does while its dispatch's counts travel (te_dist.settings.early_weight_casts)."""
    from te_dist.autocast import get_recipe_key

    with td.autocast(recipe=recipe):
        op.ensure_recipe_state(recipe, get_recipe_key())
        op.prepare_weight()


@pytest.mark.parametrize("flag", [None, True])
def test_a_prepared_copy_goes_to_the_next_forward_only(device, casts, flag):
    recipe = R.Float8CurrentScaling()
    op, x = _op(device), _x(device)
    op.is_first_microbatch = flag
    _prepare(op, recipe)
    assert len(casts) == 1
    out = _forward(op, x, recipe)  # takes the prepared copy: no cast of its own
    assert len(casts) == 1
    assert torch.equal(out, _fresh(op, x, recipe))  # (the twin's cast: 2)
    op.is_first_microbatch = flag
    _forward(op, x, recipe)  # the next forward decides for itself again (flag True: casts and keeps anew)
    assert len(casts) == 3


@pytest.mark.parametrize("writer", ["adamw_fused", "data_assign", "load_state_dict"])
def test_a_write_between_prepare_and_forward_is_seen(device, casts, writer):
    """A prepared copy is of the weight's values when it was made: a write the key sees (an optimizer
    step, new storage, a version bump) sends the forward to a fresh cast."""
    recipe = R.Float8BlockScaling()
    op, x = _op(device), _x(device)
    _prepare(op, recipe)
    WRITERS[writer](op, _x(device, 2), recipe)
    made = len(casts)
    assert torch.equal(_forward(op, x, recipe), _fresh(op, x, recipe))
    assert len(casts) == made + 2  # its own cast, and the fresh twin's


def test_a_kept_copy_is_what_prepare_hands_on(device, casts):
    recipe = R.Float8CurrentScaling()
    op, x = _op(device), _x(device)
    op.is_first_microbatch = True
    first = _forward(op, x, recipe)
    _prepare(op, recipe)  # a later micro-batch (False): the kept copy, no cast
    assert len(casts) == 1
    assert torch.equal(_forward(op, x, recipe), first) and len(casts) == 1


def _aligned_on_any_device(monkeypatch):
    """The layer's native row alignment where the test forces the native path (CPU included)."""
    from te_dist.moe import layer as layer_module

    monkeypatch.setattr(layer_module, "native_row_alignment", lambda x, recipe, linears: 16)


@pytest.mark.parametrize("first", [None, True])
def test_moe_layer_casts_its_expert_weights_during_the_read(device, casts, monkeypatch, first):
    """early_weight_casts: both weight casts run inside the dispatch's read (during_read), the experts take
    those copies (2 casts a forward, not 4), and the output is the one with the switch off, bit for bit."""
    from te_dist import settings
    from te_dist.moe.transports import base

    _aligned_on_any_device(monkeypatch)
    torch.manual_seed(0)
    layer = MoELayer(256, 128, 4, 2, dtype=torch.bfloat16, device=device)
    x = _x(device)
    during = []
    real_read = base.read_counts

    def read(counts, during_read=None):
        def watched():
            before = len(casts)
            during_read()
            during.append(len(casts) - before)
        return real_read(counts, None if during_read is None else watched)

    monkeypatch.setattr("te_dist.moe.transports.all_to_all.read_counts", read)
    recipe = R.Float8CurrentScaling()
    with td.autocast(recipe=recipe):
        with settings.override(early_weight_casts=False):
            want = layer(x, is_first_microbatch=first)
        assert during == [] and len(casts) == 2
        with settings.override(early_weight_casts=True):
            got = layer(x, is_first_microbatch=first)
            assert during == [2] and len(casts) == 4
            if first:  # a later micro-batch: the kept copies, no cast, during the read or after it
                layer(x)
                assert during == [2, 0] and len(casts) == 4
    assert torch.equal(got, want)


def test_read_counts_runs_the_work_once_and_reads(device):
    from te_dist.moe.transports.base import read_counts

    counts = torch.arange(6, device=device) - 1
    called = []
    assert read_counts(counts, lambda: called.append(torch.ones(3, device=device).sum())) == [-1, 0, 1, 2, 3, 4]
    assert len(called) == 1 and read_counts(counts) == counts.tolist()
