"""A pretend CUDA device for the ops layer's CPU tests: launches are recorded, not run."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch


@contextlib.contextmanager
def stubbed_device(launched: list, loaded=None, scratch=None, capturing: bool = False,
                   arch: str = "sm_90"):
    """CPU tensors pass for CUDA device 0 of an ``arch`` GPU with 132 SMs; every launch appends
    (grid, arguments) to ``launched``; ``loaded(device, key)`` (default: a Mock) stands for
    each attention kernel loaded, ``scratch(like, numel, counters=0)`` (default: fresh CPU
    tensors) for the split partials' buffer (and zero arrival counters); ``capturing``:
    whether a CUDA graph is being captured."""
    from flashcore.ops import eager, launcher, plan, serving

    with (mock.patch.object(launcher, "arch_of", return_value=arch),
          mock.patch.object(eager, "arch_of", return_value=arch),
          mock.patch.object(serving, "arch_of", return_value=arch),
          mock.patch.object(plan, "sm_count", return_value=132),
          mock.patch.object(plan, "capturing", return_value=capturing),
          mock.patch.object(launcher, "loaded_kernel", side_effect=loaded),
          mock.patch.object(launcher, "combine_kernel"),
          mock.patch.object(launcher, "launch",
                            side_effect=lambda kern, grid, a, dev: launched.append((grid, a))),
          mock.patch.object(launcher, "scratch",
                            side_effect=scratch or _fresh_scratch),
          mock.patch.object(torch.Tensor, "get_device", return_value=0),
          mock.patch.object(torch.Tensor, "is_cuda", new_callable=mock.PropertyMock,
                            return_value=True)):
        yield


def _fresh_scratch(like, numel: int, counters: int = 0):
    buf = torch.empty(numel)
    return (buf, torch.zeros(counters, dtype=torch.int32)) if counters else buf
