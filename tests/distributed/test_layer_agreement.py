"""Layer agreement in one process: the mismatch report, the no-group no-op, the tag in the count exchange.

The multi-rank behaviour (every rank raises the same error, before any transport) is in
test_layer_agreement_multiprocess.py.
"""

import torch

import te_dist as td
from te_dist import recipe as R
from te_dist.distributed.consensus import MismatchError, recipe_payload
from te_dist.distributed.layer_agreement import LayerAgreement, LayerMismatchError, describe_layer_mismatch
from te_dist.moe import AllToAllDispatcher

FIELDS = {"num_experts": "8", "hidden_size": "16", "dtype": "torch.float32"}


def payload(recipe=None, **fields):
    recipe_part = recipe_payload(recipe)
    values = dict(FIELDS, **{k: str(v) for k, v in fields.items()})
    key = "MoELayer(" + ", ".join(f"{k}={v}" for k, v in values.items()) + f", recipe={recipe_part['key']})"
    return {"key": key, "layer": "MoELayer", "fields": values, "recipe": recipe_part}


def test_report_groups_ranks_and_names_fields_and_recipe_settings():
    ref = payload(R.DelayedScaling())
    payloads = [ref, payload(R.DelayedScaling(), num_experts=4), ref, payload(R.DelayedScaling(margin=2), dtype="torch.bfloat16")]
    message, mismatched, fields = describe_layer_mismatch(payloads, [0, 1, 2, 3])
    assert mismatched == [1, 3] and fields == ["num_experts", "dtype", "recipe"]
    assert message.startswith("MoELayer mismatch across the 4 ranks of its expert-parallel group: ranks 1, 3 differ")
    assert "  rank 1 vs rank 0:\n    num_experts: 8 on rank 0, 4 on rank 1\n" in message
    assert "    dtype: torch.float32 on rank 0, torch.bfloat16 on rank 3\n    recipe:\n      margin: 0 on rank 0, 2 on rank 3" in message


def test_report_names_global_ranks_of_a_subgroup():
    message, mismatched, _ = describe_layer_mismatch([payload(), payload(hidden_size=32)], [4, 6])
    assert mismatched == [1] and "hidden_size: 16 on rank 0 (global 4), 32 on rank 1 (global 6)" in message


def test_error_is_a_mismatch_error_with_fields():
    err = LayerMismatchError("m", fields=["top_k"], mismatched_ranks=[1], keys={0: "a", 1: "b"}, global_ranks=[0, 1])
    assert isinstance(err, MismatchError) and err.fields == ["top_k"] and err.mismatched_ranks == [1]


def test_no_group_is_free():
    agreement = LayerAgreement("MoELayer", {"num_experts": 8}, None)
    with td.autocast(recipe=R.Float8CurrentScaling()):
        assert agreement.check(torch.device("cpu")) is None
    agreement.verify([1, 2])  # nothing to agree with: no error, no collective
    layer = td.moe.MoELayer(8, 6, 4, 2, dtype=torch.float32)
    layer(torch.randn(5, 8))
    assert layer.dispatcher.transport == "local"


def test_tag_rides_in_the_count_exchange():
    torch.manual_seed(0)
    dispatcher = AllToAllDispatcher(4, None)
    x = torch.randn(6, 3)
    indices = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2], [1, 1]])
    probs = torch.full((6, 2), 0.5)
    tag = torch.tensor([2**61 + 5], dtype=torch.int64)
    plain = dispatcher.dispatch(x, probs, indices, probs_in_expert=False)
    tagged = dispatcher.dispatch(x, probs, indices, probs_in_expert=False, tag=tag)
    assert plain[3].peer_tags is None and tagged[3].peer_tags == [2**61 + 5]
    assert torch.equal(plain[0], tagged[0]) and torch.equal(plain[1], tagged[1])  # the counts are unchanged
    assert tagged[3].local_expert_sizes == plain[3].local_expert_sizes == [3, 4, 2, 3]
