"""Import-only stand-in for ``torchvision`` in the SGLang CPU venv (tests and development only).

PyPI's torchvision is linked against CUDA and fails to import next to torch's CPU build, yet SGLang 0.5.23 (its
InternVL helpers) and transformers' video processing import it at module load. This module and every
``torchvision.*`` submodule import; capitalised names are classes that raise when instantiated, so a real use (a
vision model) fails with a clear message. Put on the path by ``scripts/setup_sglang.sh`` only where no real
torchvision is installed.
"""
from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+dlmix.standin"
__path__: list[str] = []  # a package, so submodule imports reach the finder below


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"torchvision stand-in: {type(self).__name__} is not available (no torchvision "
                           "build for this CPU torch)")


def _attr(modname: str, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "InterpolationMode":
        return InterpolationMode
    if name[:1].isupper():
        return type(name, (_Unavailable,), {"__module__": modname})
    return importlib.import_module(f"{modname}.{name}")


class _Sub(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return _attr(self.__name__, name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Sub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


import importlib  # noqa: E402

if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(name: str) -> Any:
    return _attr(__name__, name)
