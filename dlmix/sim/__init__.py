"""Discrete-event simulator of heterogeneous serving clusters (``dlmix sim``); see ``docs/simulator.md``.

The router's own policy objects place requests on simulated engine instances built from chip profiles
(:mod:`dlmix.sim.engine`, :mod:`dlmix.sim.simulator`); workloads are Mooncake-format traces or a seeded synthetic
shared-prefix generator (:mod:`dlmix.sim.workload`).
"""
from dlmix.sim.config import ConfigError, Deployment, load_deployment, load_model  # noqa: F401
from dlmix.sim.simulator import Simulator, simulate  # noqa: F401
from dlmix.sim.workload import SimRequest, WorkloadError, load_trace, shared_prefix  # noqa: F401
