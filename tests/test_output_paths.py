"""Every command that writes files refuses an unusable output path before its work, with the part of the path that
stands in the way (:mod:`dlmix.paths`). Before, a path under a file (``--out afile/sub``) passed the checks, which
looked only at the path itself: ``dlmix plan`` ran its whole search and then ended in a NotADirectoryError
traceback, as did ``dlmix launch --emit k8s``, ``dlmix models prepare --cache-dir``, and ``dlmix demo --json`` after
every deployment had run."""
from __future__ import annotations

import os
import sys

import pytest
from typer.testing import CliRunner

from dlmix.cli import app
from dlmix.paths import file_problem, folder_problem


@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    return f


def test_folder_problem_names_the_part_that_is_a_file(tmp_path, afile):
    assert folder_problem(tmp_path / "new" / "deeper") is None  # missing folders are created later: fine
    assert folder_problem(tmp_path) is None
    assert folder_problem(afile) == f"{afile} exists and is not a folder"
    assert folder_problem(afile / "sub" / "x") == f"{afile} exists and is not a folder"
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "missing-target")
    assert folder_problem(link / "x") == f"{link} is a link to a missing target"
    assert folder_problem("bad\0name") == "'bad\\x00name' cannot be used: it contains a NUL character"
    assert file_problem("bad\0name") == "'bad\\x00name' cannot be used: it contains a NUL character"


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root may write into any folder")
def test_folder_problem_sees_a_folder_that_is_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        assert folder_problem(ro / "a" / "b") == f"{ro} is not writable"
        assert file_problem(ro / "x.json") == f"{ro} is not writable"
    finally:
        ro.chmod(0o700)


def test_file_problem(tmp_path, afile):
    assert file_problem(tmp_path / "new" / "rows.json") is None
    assert file_problem(afile) is None  # overwritten
    assert file_problem(tmp_path) == f"{tmp_path} is a folder"
    assert file_problem(afile / "rows.json") == f"{afile} exists and is not a folder"


def test_plan_refuses_an_out_under_a_file_before_the_search(afile):
    res = CliRunner().invoke(app, ["plan", "-i", "s4000x2", "-m", "smollm2", "-n", "20", "--out", str(afile / "sub")])
    assert res.exit_code == 2, res.output
    assert f"--out {afile / 'sub'}: {afile} exists and is not a folder" in res.output
    assert not isinstance(res.exception, NotADirectoryError)


def test_sim_refuses_an_out_under_a_file_before_the_runs(afile):
    res = CliRunner().invoke(app, ["sim", "-d", "homog_h100x4", "--limit", "3", "-o", str(afile / "sub")])
    assert res.exit_code == 2 and f"{afile} exists and is not a folder" in res.output, res.output


@pytest.mark.parametrize("flag", [["--emit", "k8s"], ["--log-dir"]])
def test_launch_refuses_an_emit_or_log_folder_under_a_file(tmp_path, afile, flag):
    dep = tmp_path / "dep.yaml"
    dep.write_text("model: m\ninstances:\n  - name: a\n    role: both\n    port: 18001\n    engine: mock\n")
    res = CliRunner().invoke(app, ["launch", str(dep)] + flag + [str(afile / "k8s")])
    assert res.exit_code == 2, res.output
    assert f"{flag[0]} {afile / 'k8s'}: {afile} exists and is not a folder" in res.output, res.output


def test_models_prepare_refuses_a_cache_under_a_file_before_building(afile):
    res = CliRunner().invoke(app, ["models", "prepare", "tiny-llama", "--cache-dir", str(afile / "cache")])
    assert res.exit_code == 2, res.output
    assert f"cannot build tiny-llama in the cache {afile / 'cache'}: {afile} exists and is not a folder" in res.output


@pytest.mark.parametrize("where", ["under-file", "folder"])
def test_demo_refuses_a_json_path_it_could_not_write_before_starting_anything(tmp_path, afile, where):
    target = afile / "rows.json" if where == "under-file" else tmp_path
    from dlmix.demo import run_demo

    # a deployment file that does not exist: had the --json check come after the launch, this would say so instead
    assert run_demo(str(tmp_path / "no-such-deployment.yaml"), json_out=str(target)) == 2
    res = CliRunner().invoke(app, ["demo", "--deployment", str(tmp_path / "no-such.yaml"), "--json", str(target)])
    assert res.exit_code == 2
    want = f"{afile} exists and is not a folder" if where == "under-file" else f"{tmp_path} is a folder"
    assert want in " ".join(res.output.split()), res.output
