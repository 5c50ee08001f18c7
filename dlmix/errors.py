"""The dlmix error hierarchy: one base class, one configuration error.

Every error dlmix raises on purpose derives from :class:`DlmixError`, so a front end (CLI, launcher) can report any of
them with one ``except DlmixError``. Configuration errors of the router, the launcher and the simulator share
:class:`ConfigError`; each keeps its own subclass (``dlmix.router.config.ConfigError``,
``dlmix.launch.config.ConfigError``, ``dlmix.sim.config.ConfigError``) so code that catches a specific one keeps
working. :class:`ConfigError` also derives from :class:`ValueError`, as all three did before, so
``except ValueError`` clauses still catch it.

This module imports nothing from dlmix: every layer may use it.
"""
from __future__ import annotations

__all__ = ["DlmixError", "ConfigError"]


class DlmixError(Exception):
    """Base class of the errors dlmix raises on purpose (bad input, a failed start, a refused request)."""


class ConfigError(DlmixError, ValueError):
    """A configuration (router YAML or flags, deployment file, simulator deployment or model) is invalid; the
    message names the file or key and says why."""
