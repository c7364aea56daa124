"""``--log tensorboard``: event files with the metrics rows, or a clear message when the package is absent."""

import sys

import pytest

from te_dist.train.config import ConfigError, config_from_dict
from te_dist.train.preflight import check_logging
from te_dist.train.tensorboard import TensorBoardWriter, tensorboard_missing


def test_writer_writes_every_numeric_field_as_a_scalar(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path)
    rows = [{"step": s, "loss": 4.0 / s, "lr": 1e-3 * s, "grad_norm": 0.5, "mfu": None, "eta_s": 10.0 - s}
            for s in (1, 2, 3)]
    for row in rows:
        writer.write(row)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"train/loss", "train/lr", "train/grad_norm", "train/eta_s"}  # None (no MFU on CPU) is left out
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([4.0, 2.0, 4.0 / 3])


def test_absent_package_gives_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what `import tensorboard` sees without the package
    message = tensorboard_missing()
    assert message is not None and "pip install tensorboard" in message
    with pytest.raises(ConfigError, match="needs the `tensorboard` package"):
        TensorBoardWriter(tmp_path)
    with pytest.raises(ConfigError, match="needs the `tensorboard` package"):
        check_logging(config_from_dict({"train": {"log": "tensorboard"}}))
    check_logging(config_from_dict({}))  # the default sink needs nothing
