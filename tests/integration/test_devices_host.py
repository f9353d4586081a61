"""The device check against this host's torch (gpu_worker/devices.py): here, not in the unit tier, which must not
import torch (`make test-fast` fails a session that does). On a GPU host it checks `cuda` and a device past the last."""

from __future__ import annotations

import pytest

from gpu_worker.devices import check_devices
from shared.config import ModelSpec
from shared.errors import ConfigError
from shared.states import Task


def test_this_host_is_asked_as_torch_sees_it():
    torch = pytest.importorskip("torch")
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/x", device="cuda").validate()
    if torch.cuda.is_available():
        check_devices([spec])
        beyond = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(ConfigError, match=f"model m: device {beyond}, but this host has"):
            check_devices([ModelSpec(name="m", task=Task.GENERATE, source="/x", device=beyond).validate()])
    else:
        with pytest.raises(ConfigError, match="model m: device cuda, but torch sees no CUDA device on this host"):
            check_devices([spec])
