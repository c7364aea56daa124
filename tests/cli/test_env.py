"""`te-dist env`: versions, backends and a support matrix that agrees with te_dist.support."""

import json

import pytest
import torch

from te_dist import settings, support
from te_dist.cli import SPLIT_ALIGNMENT, env_report, format_env_report
from te_dist.recipe import RECIPE_NAMES, recipe_from_name


def test_report_matches_the_support_predicates():
    report = env_report()
    assert report["versions"]["torch"] == torch.__version__
    matrix = report["support"]["cpu"]
    assert list(matrix) == list(RECIPE_NAMES)
    for name, cells in matrix.items():
        for dtype_name, cell in cells.items():
            dtype = getattr(torch, dtype_name)
            args = (recipe_from_name(name), dtype)
            kwargs = dict(split_alignment=SPLIT_ALIGNMENT, device=torch.device("cpu"))
            assert cell["module"] == support.is_module_grouped_tensor_supported(*args, **kwargs)
            assert cell["op_fuser"] == support.is_op_fuser_grouped_tensor_supported(*args, **kwargs)
    text = format_env_report(report)
    assert all(f"    {name:<10}" in text for name in RECIPE_NAMES)


def test_env_command_on_cpu(run_cli):
    result = run_cli("env", timeout=120).check()
    assert f"torch                  {torch.__version__}" in result.output
    assert "grouped_mm backends on cpu" in result.output
    as_json = json.loads(run_cli("env", "--json", timeout=120).check().output)
    assert set(as_json["support"]) == {"cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))}


@pytest.mark.gpu
def test_env_lists_every_gpu():
    report = env_report()
    assert len(report["devices"]) == 1 + torch.cuda.device_count()
    assert report["versions"]["nccl"] not in (None, "")
    for i in range(torch.cuda.device_count()):
        assert f"grouped_mm backends on cuda:{i}" in report["backends"]
        assert set(report["support"][f"cuda:{i}"]) == set(RECIPE_NAMES)


def test_report_names_the_path_each_recipe_takes():
    report = env_report()
    paths = report["paths"]["cpu"]
    assert list(paths) == list(RECIPE_NAMES)
    assert all(path == ["emulated", "cpu: the float32 reference path"] for name, path in paths.items() if name != "none")
    assert "which path a bf16 MoE expert MLP takes" in format_env_report(report)


def test_report_shows_the_transport_choice_and_its_override():
    with settings.override(ep_transport=None):
        report = env_report()
    assert report["transport"]["requested"] == "auto (transport='auto')"
    assert report["transport"]["auto picks"]["cpu"].startswith("all_to_all")
    with settings.override(ep_transport="peer"):
        report = env_report()
    assert report["transport"]["requested"] == "peer (te_dist.settings.ep_transport='peer')"
    assert "token transport (EP > 1): peer" in format_env_report(report)
    assert report["settings"]["ep_transport"] == {"value": "peer", "source": "te_dist.settings.ep_transport='peer'",
                                                  "env": "TE_DIST_EP_TRANSPORT", "default": None}


def test_env_command_shows_every_switch_and_where_it_comes_from(run_cli):
    """In a fresh process: each field of te_dist.settings with the environment's value where one is set,
    and a bad variable reported, not a crash."""
    out = run_cli("env", timeout=120, env={"TE_DIST_EP_TRANSPORT": "nccl", "TE_DIST_TUNE": "0"}).check().output
    assert "ep_transport       'all_to_all' TE_DIST_EP_TRANSPORT=nccl" in out
    assert "tune               False    TE_DIST_TUNE=0" in out
    assert "token transport (EP > 1): all_to_all (TE_DIST_EP_TRANSPORT=nccl)" in out
    assert all(f"  {f.name:<18} " in out for f in settings.fields())
    bad = run_cli("env", timeout=120, env={"TE_DIST_TUNE": "maybe"}).check().output
    assert "invalid: TE_DIST_TUNE='maybe' (te_dist.settings.tune) is not accepted: expected 0 or 1" in bad
