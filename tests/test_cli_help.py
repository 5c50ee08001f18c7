"""``dlmix CMD --help`` at 80 columns (a default terminal): every option name of every command is printed whole.
typer's rich help tables cut long ones (``--random-input-l…``, ``--max-num-batched…``); the dlmix CLI uses click's
plain help (:data:`dlmix.cli.app`)."""
from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from dlmix.cli import app

def _leaves(group, path=()):
    for name, c in sorted(group.commands.items()):
        yield from _leaves(c, path + (name,)) if hasattr(c, "commands") else [(path + (name,), c)]


LEAVES = dict(_leaves(typer.main.get_command(app)))


@pytest.mark.parametrize("path", sorted(LEAVES), ids=" ".join)
def test_help_at_80_columns_prints_every_option_name_whole(path):
    names = [n for p in LEAVES[path].params if p.param_type_name == "option" for n in p.opts + p.secondary_opts]
    assert names, path
    res = CliRunner().invoke(app, [*path, "--help"], terminal_width=80)
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80, res.output
    words = set(res.output.replace(",", " ").replace("/", " ").split())
    missing = [n for n in names if n not in words]
    assert not missing, (missing, res.output)


def test_python_dash_m_dlmix_runs_the_cli():
    """``python -m dlmix`` is the ``dlmix`` command (it failed with "No module named dlmix.__main__")."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "dlmix", "models", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "prepare" in p.stdout
