"""A model's device is checked against the host when the worker starts (gpu_worker/devices.py): `cuda` where
torch sees no CUDA is a configuration error naming the model and the setting, before anything loads."""

from __future__ import annotations

import pytest

from gpu_worker.devices import HostDevices, check_devices, device_problem
from shared.config import ModelSpec
from shared.states import Task

CPU_ONLY = HostDevices(cuda=0, mps=False, torch_cuda=None)


@pytest.mark.parametrize("requested, host, says", [
    ("cuda", CPU_ONLY, "device cuda, but torch sees no CUDA device on this host (a CPU-only build of torch)"),
    ("cuda:0", HostDevices(0, False, "12.1"), "no CUDA device on this host (torch built with CUDA 12.1)"),
    ("cuda:2", HostDevices(2, False, "12.1"), "device cuda:2, but this host has 2 CUDA device(s), cuda:0 to cuda:1"),
    ("mps", CPU_ONLY, "device mps, but torch sees no MPS device on this host"),
])
def test_a_device_the_host_lacks_is_named(requested, host, says):
    assert says in (device_problem(requested, host) or "")


@pytest.mark.parametrize("requested, host", [
    ("auto", CPU_ONLY), ("cpu", CPU_ONLY), ("cuda", HostDevices(1, False, "12.1")),
    ("cuda:1", HostDevices(2, False, "12.1")), ("mps", HostDevices(0, True, None)),
])
def test_a_device_the_host_has_is_accepted(requested, host):
    assert device_problem(requested, host) is None


def test_an_echo_model_needs_no_device():
    check_devices([ModelSpec(name="e", task=Task.GENERATE, source="", kind="echo", device="cuda:7").validate()])
