"""Device parametrisation for the quantization tests: CPU always, CUDA under the ``gpu`` marker."""

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)
