"""Import hook that makes the LMDeploy adapter active in every Python process, installed by the package.

LMDeploy has no plugin discovery and starts its engine in processes of its own, so ``pip install dlmix`` puts
``dlmix_lmdeploy.pth`` into site-packages; Python's ``site`` module runs its one line at every start, which calls
:func:`install`. ``install`` only adds a finder to ``sys.meta_path`` (nothing is imported); when one of the LMDeploy
modules in :data:`dlmix_lmdeploy.patches.POST_IMPORT` is imported, the finder runs that module's patch right after the
module's own code (:mod:`dlmix_lmdeploy.patches`). A process that never imports LMDeploy is unaffected, and LMDeploy
behaves as before unless ``--migration-backend DLMix`` is selected.

``DLMIX_LMDEPLOY_DISABLE=1`` turns the hook off. ``DLMIX_LMDEPLOY_CPU=1`` also activates the CPU test aid
(:mod:`dlmix_lmdeploy.cpu`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__all__ = ["install", "WATCHED"]

#: LMDeploy modules patched right after they are imported (the patch functions live in dlmix_lmdeploy.patches, which
#: is imported only when one of these is).
WATCHED = frozenset({
    "lmdeploy.pytorch.disagg.config",
    "lmdeploy.pytorch.disagg.backend.backend",
    "lmdeploy.cli.utils",
    "lmdeploy.pytorch.engine.cache_engine.engine",
    "lmdeploy.pytorch.engine.model_agent.agent",
    "lmdeploy.pytorch.engine.engine_loop",
    "lmdeploy.pytorch.engine.engine",
    "lmdeploy.pytorch.backends.selector",
    "lmdeploy.pytorch.engine.mp_engine.zmq_engine",
    "lmdeploy.serve.core.async_engine",
    "lmdeploy.pytorch.paging.block_trie.node",
})

_installed = False


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds a watched module with the other finders, then wraps its loader so the patch runs after it executed."""

    def find_spec(self, name, path, target=None):
        if name not in WATCHED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            from dlmix_lmdeploy.patches import apply

            apply(name, module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    """Add the post-import finder (idempotent). Never raises: a broken hook must not break Python's start."""
    global _installed
    if _installed or os.environ.get("DLMIX_LMDEPLOY_DISABLE") == "1":
        return
    _installed = True
    try:
        sys.meta_path.insert(0, _PostImportFinder())
        if os.environ.get("DLMIX_LMDEPLOY_CPU") == "1":
            from dlmix_lmdeploy.cpu import install as install_cpu

            install_cpu()
    except Exception as e:  # pragma: no cover - defensive: report, never stop the interpreter
        print(f"dlmix_lmdeploy: import hook not installed: {e}", file=sys.stderr)
