"""Run LMDeploy's PyTorch engine on a CPU-only machine: a test and development aid, off unless
``DLMIX_LMDEPLOY_CPU=1``.

LMDeploy 0.18 has no CPU device; its non-CUDA integrations (Ascend, MACA, CAMB through dlinfer) make the canonical
``cuda`` path work on their device, as its own comments in ``pytorch/engine/cache_engine/engine.py`` say. This module
does the same for the host:

* ``torch.cuda`` streams, events, device queries and memory queries become host no-ops (free memory: the
  ``DLMIX_LMDEPLOY_CPU_FREE_MEM`` bytes, default what the OS reports available);
* ``device="cuda"`` in tensor factories, ``Tensor.to``/``Module.to``, ``.cuda()`` and ``pin_memory`` map to the host;
* LMDeploy's op-backend selector (``pytorch/backends/selector.py`` ``_get_backend``) returns
  :class:`dlmix_lmdeploy.cpu_ops.CpuOpsBackend` for the ``cuda`` device type;
* ``LMDEPLOY_ENABLE_CHECK_ENV=0`` skips LMDeploy's triton/CUDA environment check.

Set ``OMP_NUM_THREADS=1`` per engine on a small machine (otherwise one request took 3-4 s instead of 0.1-0.4 s here).
"""
from __future__ import annotations

import contextlib
import functools
import os
import types

__all__ = ["install", "patch_selector"]

_done = False


def _is_cuda(d) -> bool:
    import torch

    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, torch.device) and d.type == "cuda"


def _host(d, int_is_device: bool = False):
    import torch

    if _is_cuda(d):
        return torch.device("cpu") if isinstance(d, torch.device) else "cpu"
    if int_is_device and isinstance(d, int) and not isinstance(d, bool):
        return "cpu"
    return d


def _factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"], True)
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)
    return wrapper


def _to(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if args:
            args = (_host(args[0], True),) + tuple(args[1:])
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"], True)
        return fn(self, *args, **kwargs)
    return wrapper


class _Stream:
    """A host stand-in for ``torch.cuda.Stream`` (everything is synchronous on the host)."""

    device = None
    cuda_stream = 0

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event:
    """A host stand-in for ``torch.cuda.Event``."""

    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_CURRENT = _Stream()


def _patch_torch() -> None:
    import psutil
    import torch

    c = torch.cuda
    vm = psutil.virtual_memory
    c.Stream, c.Event = _Stream, _Event
    c.stream = lambda s=None: contextlib.nullcontext()
    c.current_stream = c.default_stream = lambda *a, **k: _CURRENT
    for name in ("synchronize", "set_device", "empty_cache", "reset_peak_memory_stats"):
        setattr(c, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
        setattr(c, name, lambda *a, **k: 0)
    c.current_device = lambda: 0
    c.device_count = lambda: 1
    c.mem_get_info = lambda *a, **k: (int(os.environ.get("DLMIX_LMDEPLOY_CPU_FREE_MEM", vm().available)), vm().total)
    c.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        name="cpu", major=0, minor=0, total_memory=vm().total, multi_processor_count=1,
        uuid="00000000-0000-0000-0000-000000000000")
    c.get_device_capability = lambda *a, **k: (0, 0)
    c.get_device_name = lambda *a, **k: "cpu"
    c.is_bf16_supported = lambda *a, **k: True
    if not hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces = lambda: None
    for name in ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
                 "randperm", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                 "randint_like", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor", "tril_indices",
                 "triu_indices", "frombuffer"):
        if hasattr(torch, name):
            setattr(torch, name, _factory(getattr(torch, name)))
    T = torch.Tensor
    T.to = _to(T.to)
    T.cuda = lambda self, *a, **k: self
    T.pin_memory = lambda self, *a, **k: self
    T.is_pinned = lambda self, *a, **k: False
    T.record_stream = lambda self, *a, **k: None
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided"):
        setattr(T, name, _factory(getattr(T, name)))
    torch.nn.Module.to = _to(torch.nn.Module.to)
    torch.nn.Module.cuda = lambda self, *a, **k: self


def patch_selector(module) -> None:
    """Make ``lmdeploy.pytorch.backends.selector._get_backend`` answer the CPU op backend for device type cuda."""
    original = module._get_backend

    def _get_backend():
        from lmdeploy.pytorch.devices import get_device_manager

        if get_device_manager().current_context().device_type == "cuda":
            from .cpu_ops import CpuOpsBackend

            return CpuOpsBackend
        return original()

    module._get_backend = _get_backend


def install() -> None:
    """Activate the CPU aid in this process (idempotent); the selector is patched when LMDeploy imports it."""
    global _done
    if _done:
        return
    _done = True
    os.environ.setdefault("LMDEPLOY_ENABLE_CHECK_ENV", "0")
    _patch_torch()
