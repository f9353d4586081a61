"""Whether this host has the device each model asks for (`device:` in the model file), checked when the worker
starts, before it listens or reads a request: a model on `cuda` where torch sees no CUDA is a configuration
error naming the model and the setting, not a failure mid-load.

The config accepts the device names (shared/config_checks.py: auto, cpu, cuda, cuda:<index>, mps); only the
worker, which imports torch anyway to load a model, can tell whether the host has them. An echo model loads
nothing, so a worker of echo models alone never imports torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.config import ModelSpec
from shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HostDevices:
    """What torch sees on this host."""

    cuda: int  # CUDA devices (0: none, or torch built without CUDA)
    mps: bool
    torch_cuda: str | None  # the CUDA version torch was built with; None: a CPU-only build


def device_problem(requested: str, host: HostDevices) -> str | None:
    """Why `requested` (a name the config accepts) is not on `host`, or None ('auto' and 'cpu' always are)."""
    kind, _, index = requested.partition(":")
    if kind == "cuda":
        if host.cuda == 0:
            build = f"torch built with CUDA {host.torch_cuda}" if host.torch_cuda else "a CPU-only build of torch"
            return (f"device {requested}, but torch sees no CUDA device on this host ({build}); use device auto "
                    "(CUDA when present, else CPU) or cpu")
        if index and int(index) >= host.cuda:
            return (f"device {requested}, but this host has {host.cuda} CUDA device(s), cuda:0 to "
                    f"cuda:{host.cuda - 1}")
    if kind == "mps" and not host.mps:
        return "device mps, but torch sees no MPS device on this host; use device auto or cpu"
    return None


def host_devices() -> HostDevices:
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return HostDevices(cuda=cuda, mps=bool(torch.backends.mps.is_available()), torch_cuda=torch.version.cuda)


def check_devices(specs: Iterable[ModelSpec]) -> None:
    """A ConfigError for the first model (with weights) whose device this host lacks."""
    wanting = [spec for spec in specs if not spec.echo and spec.device not in ("auto", "cpu")]
    if not wanting:
        return
    host = host_devices()
    for spec in wanting:
        problem = device_problem(spec.device, host)
        if problem:
            raise ConfigError(f"model {spec.name}: {problem}")
