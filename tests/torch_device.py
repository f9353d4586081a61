"""The device the engine-level tests put their models on: `BATCHGATE_TEST_DEVICE` (default cpu), so that a
machine with a GPU runs them on CUDA (`BATCHGATE_TEST_DEVICE=cuda`). The tests' own reference computations
(`generate`, a full forward) run under `with DEVICE:`; the engine under test never does, so a tensor it makes on
the wrong device fails there as it would in a worker."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

DEVICE = torch.device(os.environ.get("BATCHGATE_TEST_DEVICE", "cpu"))


def on_device(fn: Callable[P, R]) -> Callable[P, R]:
    """Run `fn` (a test's reference computation) with `DEVICE` as the default device of new tensors."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        with DEVICE:
            return fn(*args, **kwargs)

    return wrapped
