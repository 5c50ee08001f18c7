"""Build hook: ship ``dlmix_lmdeploy.pth`` at the top of site-packages.

LMDeploy has no plugin discovery and spawns its engine processes, so the LMDeploy adapter installs a tiny import hook
from a ``.pth`` file (run by Python's ``site`` module at every start). The hook only watches for ``lmdeploy`` modules
being imported; it imports nothing else (``plugins/lmdeploy/autoload.py``). Everything else is in pyproject.toml.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "dlmix_lmdeploy.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also copies the ``.pth`` file to the root of the build (the wheel's purelib)."""

    def run(self):
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins", "lmdeploy", PTH)
        self.copy_file(src, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return list(super().get_outputs(include_bytecode)) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
