"""LMDeploy adapter of dlmix: the ``DLMix`` migration backend for LMDeploy's DistServe PD (docs/engines/lmdeploy.md).

Loaded by the import hook the package installs (:mod:`dlmix_lmdeploy.autoload`); this package imports nothing at
import time so that the hook stays free for processes that never use LMDeploy.
"""
