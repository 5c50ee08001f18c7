"""``dlmix launch``: start a whole local deployment (engine instances + dlmix router) from one YAML file.

Python API::

    from dlmix.launch import Deployment, launch
    with launch(Deployment.from_file("examples/cpu-pd.yaml")) as running:
        running.url, running.router_url, running.instances

See :mod:`dlmix.launch.config` (file format, :class:`ConfigError`) and :mod:`dlmix.launch.runner` (processes,
:class:`LaunchError`, :class:`PortInUseError`, :class:`ProcessFailedError`).
"""
from dlmix.launch.config import ConfigError, Deployment, Instance, RouterSettings  # noqa: F401
from dlmix.launch.runner import (  # noqa: F401
    LaunchError,
    PortInUseError,
    ProcessFailedError,
    RunningDeployment,
    RunningInstance,
    launch,
    plan,
    start,
)

__all__ = ["ConfigError", "Deployment", "Instance", "RouterSettings", "LaunchError", "PortInUseError",
           "ProcessFailedError", "RunningDeployment", "RunningInstance", "launch", "plan", "start"]
