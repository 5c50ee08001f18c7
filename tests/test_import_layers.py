"""The import layers of pyproject.toml ([tool.importlinter], docs/architecture.md) hold, and lint-imports catches a
violation: a copy of the tree where a core module imports the router (and another imports vLLM) fails."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (pyproject.toml [tool.setuptools] package-dir)
PACKAGES = {"dlmix": "dlmix", "dlmix_kv_connectors": "kv_connectors", "dlmix_vllm": "plugins/vllm",
            "dlmix_sglang": "plugins/sglang", "dlmix_lmdeploy": "plugins/lmdeploy"}


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """Run lint-imports on ``tree`` (its pyproject.toml), importing the packages from ``tree`` only."""
    shim = tree / "_shim"
    shim.mkdir(exist_ok=True)
    for name, folder in PACKAGES.items():
        link = shim / name
        if not link.exists():
            link.symlink_to(tree / folder, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(shim))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)


def _copy_tree(dst: Path) -> Path:
    ign = shutil.ignore_patterns("__pycache__", "*.pyc", "data", ".grimp_cache", ".import_linter_cache")
    for folder in sorted(set(PACKAGES.values())):
        shutil.copytree(ROOT / folder, dst / folder, ignore=ign)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_import_contracts_are_kept(tmp_path):
    r = _lint(_copy_tree(tmp_path / "tree"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 2 kept, 0 broken." in r.stdout


def test_a_core_module_importing_upwards_or_an_engine_breaks_the_contracts(tmp_path):
    tree = _copy_tree(tmp_path / "tree")
    (tree / "dlmix" / "hw" / "_upward.py").write_text("import dlmix.router.server  # a violation\n")
    (tree / "dlmix" / "kv" / "_engine.py").write_text("import vllm  # a violation\n")
    r = _lint(tree)
    assert r.returncode != 0
    assert "Contracts: 0 kept, 2 broken." in r.stdout, r.stdout
    assert "dlmix.hw._upward -> dlmix.router.server" in r.stdout
    assert "dlmix.kv._engine -> vllm" in r.stdout
