"""The choice of token transport (CPU, no process group: the group's size, backend and the agreement
are stood in for): MoELayer's ``transport`` argument, the ``te_dist.settings.ep_transport`` override
(TE_DIST_EP_TRANSPORT; its parsing: tests/test_settings.py), forced transports that cannot run, and the
agreement gathered once per (group, device)."""

import pytest
import torch
import torch.distributed as dist

from te_dist import settings
from te_dist.moe import MoELayer, TransportSelector
from te_dist.moe.transports import AllToAllDispatcher, PeerDispatcher, base
from te_dist.moe.transports.peer import availability


class _Group:
    group_name = "test-ep-group"


@pytest.fixture
def two_ranks(monkeypatch):
    """A stand-in EP group of two ranks on one backend; returns a setter for the backend and the
    list of what each rank contributed to the (stood-in) agreement."""
    monkeypatch.setattr(base, "group_size", lambda group: 2)
    monkeypatch.setattr(base, "group_rank", lambda group: 0)
    monkeypatch.setattr(availability, "group_size", lambda group: 2)
    availability.forget_agreements()
    backend = {"name": "gloo"}
    gathered = []

    def gather(out, mine, group=None):
        gathered.append(mine)
        out[0], out[1] = mine, ("host-b", "")  # rank 1 on another host, able to run

    monkeypatch.setattr(dist, "get_backend", lambda group: backend["name"])
    monkeypatch.setattr(dist, "all_gather_object", gather)
    with settings.override(ep_transport=None):
        yield backend, gathered
    availability.forget_agreements()


def test_layer_validates_the_transport_argument():
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'all_to_all', 'peer'\), got 'nccl'"):
        MoELayer(8, 16, 4, 2, transport="nccl")
    layer = MoELayer(8, 16, 4, 2, transport="peer")
    assert layer.transport == "peer" and isinstance(layer.dispatcher, TransportSelector)


def test_one_rank_is_local_whatever_is_asked():
    """A group of one moves nothing: even a forced peer transport runs the (identity) all-to-all."""
    layer = MoELayer(8, 16, 4, 2, transport="peer")
    x = torch.randn(5, 8)
    with settings.override(ep_transport="peer"):
        out = layer(x)
    assert layer.dispatcher.transport == "local" and out.shape == x.shape


def test_auto_and_all_to_all_without_nccl(two_ranks):
    _, gathered = two_ranks
    dev = torch.device("cpu")
    for transport in ("auto", "all_to_all"):
        assert isinstance(TransportSelector(8, _Group(), transport).choose(dev, 64), AllToAllDispatcher)
    assert gathered == []  # the backend alone decided: no collective


def test_forced_peer_names_the_reasons(two_ranks):
    backend, _ = two_ranks
    dev = torch.device("cpu")
    with pytest.raises(ValueError, match=r"transport='peer' but peer rows cannot run: the EP group runs gloo, not "
                                         r"nccl; rows of 24 bytes \(a multiple of 16 is needed\)"):
        TransportSelector(8, _Group(), "peer").choose(dev, 24)
    with settings.override(ep_transport="peer"):  # the override names itself as the source
        with pytest.raises(ValueError, match="te_dist.settings.ep_transport='peer' but peer rows cannot run"):
            TransportSelector(8, _Group(), "all_to_all").choose(dev, 64)
    backend["name"] = "nccl"
    assert isinstance(TransportSelector(8, _Group(), "auto").choose(dev, 24), AllToAllDispatcher)  # rows too narrow


def test_the_setting_overrides_the_argument_between_calls_and_is_validated(two_ranks):
    backend, _ = two_ranks
    backend["name"] = "nccl"
    selector = TransportSelector(8, _Group(), "peer")
    with settings.override(ep_transport="all_to_all"):
        assert isinstance(selector.choose(torch.device("cpu"), 64), AllToAllDispatcher)
    with pytest.raises(RuntimeError, match="transport='peer' but peer rows are unavailable"):
        selector.choose(torch.device("cpu"), 64)  # the layer's own argument again
    with pytest.raises(ValueError, match=r"te_dist.settings.ep_transport must be None \(the layer's argument\) or "
                                         r"one of \('auto', 'all_to_all', 'peer'\), received 'nccl'"):
        with settings.override(ep_transport="nccl"):  # the environment's alias is not a value in code
            pass
    assert settings.current().ep_transport is None


def test_agreement_is_gathered_once_and_forced_peer_names_every_rank(two_ranks):
    """The first 'auto' choice gathers every rank's host and support once; later calls reuse the
    answer, and a forced peer transport raises with the gathered reasons."""
    backend, gathered = two_ranks
    backend["name"] = "nccl"
    dev = torch.device("cpu")
    auto = TransportSelector(8, _Group(), "auto")
    assert isinstance(auto.choose(dev, 64), AllToAllDispatcher)
    assert isinstance(auto.choose(dev, 64), AllToAllDispatcher)
    assert len(gathered) == 1  # agreed once per (group, device)
    with pytest.raises(RuntimeError, match="transport='peer' but peer rows are unavailable: rank 0: tensors on cpu; "
                                           "ranks on 2 hosts"):
        TransportSelector(8, _Group(), "peer").choose(dev, 64)
    assert len(gathered) == 1


def test_peer_dispatcher_needs_more_than_one_rank():
    with pytest.raises(ValueError, match="needs an EP group of more than one rank, got ep_size=1"):
        PeerDispatcher(4, None)
