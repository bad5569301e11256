"""launch/build_horovod.py (`hvd-scale build-horovod`): detection, flags, the cache key, the sdist
check and the command line. Nothing here builds Horovod or installs anything."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hvd_scale.launch import build_horovod as bh

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "build_horovod.py"
BOTH = {"torch": "2.13.0+cpu", "tensorflow-cpu": "2.21.0"}


def fake_env(tmp_path: Path, dists: dict[str, str], **kw) -> bh.Environment:
    scripts = tmp_path / "venv-bin"
    scripts.mkdir(exist_ok=True)
    return bh.Environment(python=sys.executable, python_version="3.11.7",
                          prefix=str(tmp_path / "venv"), base_prefix="/usr",
                          scripts=str(scripts), python_h=True, dists=dict(dists), **kw)


def tool_dir(tmp_path: Path, **tools: str) -> str:
    """A PATH directory holding shell scripts named after ``tools``, printing their text."""
    d = tmp_path / "tools"
    d.mkdir(exist_ok=True)
    for name, output in tools.items():
        p = d / name
        p.write_text(f"#!/bin/sh\necho '{output}'\n")
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(d)


def plan(tmp_path, dists, with_=(), without=(), mpi=True, environ=None):
    path = tool_dir(tmp_path, mpicxx="g++") if mpi else tool_dir(tmp_path)
    return bh.make_plan(fake_env(tmp_path, dists), bh.parse_frameworks(with_, "--with"),
                        bh.parse_frameworks(without, "--without"), path=path,
                        environ=environ or {})


def fix_sha12() -> str:
    return bh.sha256_file(bh.FIX_SCRIPT)[:12]


# ---------------------------------------------------------------------------------------------
# Detection and the build flags

def test_both_frameworks_detected_with_mpi_and_gloo(tmp_path):
    p = plan(tmp_path, BOTH)
    assert (p.torch, p.tensorflow, p.tensorflow_dist, p.mpi) == ("2.13.0", "2.21.0",
                                                                "tensorflow-cpu", True)
    assert p.flags == {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_TENSORFLOW": "1",
                       "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITH_MPI": "1",
                       "HOROVOD_WITHOUT_MXNET": "1"}
    assert p.key == f"horovod-0.28.1-torch-2.13.0-tf-2.21.0-py311-fix-{fix_sha12()}"
    assert p.notes == []


@pytest.mark.parametrize("with_, without, want", [
    (["torch,tensorflow"], [], {"PYTORCH": "WITH", "TENSORFLOW": "WITH"}),
    ([], ["tensorflow"], {"PYTORCH": "WITH", "TENSORFLOW": "WITHOUT"}),
    ([], ["tf"], {"PYTORCH": "WITH", "TENSORFLOW": "WITHOUT"}),
    (["torch"], ["tensorflow"], {"PYTORCH": "WITH", "TENSORFLOW": "WITHOUT"}),
    ([], ["torch"], {"PYTORCH": "WITHOUT", "TENSORFLOW": "WITH"}),
    (["tensorflow"], ["pytorch"], {"PYTORCH": "WITHOUT", "TENSORFLOW": "WITH"}),
    (["torch", "tensorflow"], [], {"PYTORCH": "WITH", "TENSORFLOW": "WITH"}),
])
def test_with_and_without_set_the_horovod_flags(tmp_path, with_, without, want):
    p = plan(tmp_path, BOTH, with_, without)
    for fw, kind in want.items():
        other = "WITHOUT" if kind == "WITH" else "WITH"
        assert p.flags[f"HOROVOD_{kind}_{fw}"] == "1"
        assert f"HOROVOD_{other}_{fw}" not in p.flags
    assert p.flags["HOROVOD_WITH_GLOO"] == "1"
    torch_slot = "2.13.0" if want["PYTORCH"] == "WITH" else "none"
    tf_slot = "2.21.0" if want["TENSORFLOW"] == "WITH" else "none"
    assert p.key.startswith(f"horovod-0.28.1-torch-{torch_slot}-tf-{tf_slot}-py311-fix-")


def test_torch_only_environment(tmp_path):
    p = plan(tmp_path, {"torch": "2.13.0"})
    assert p.flags["HOROVOD_WITH_PYTORCH"] == "1" and p.flags["HOROVOD_WITHOUT_TENSORFLOW"] == "1"
    # torch without TensorFlow gets one more edit (TORCH_ONLY_EDITS), named in the key
    assert p.key == f"horovod-0.28.1-torch-2.13.0-tf-none-py311-fix-{fix_sha12()}-gloo17"
    assert plan(tmp_path, BOTH, without=["tf"]).key == p.key


def test_torch_only_edit_replaces_its_text_exactly_once(tmp_path):
    (_, old, _, _), = bh.TORCH_ONLY_EDITS
    (tmp_path / "CMakeLists.txt").write_text("before\n" + old + "after\n")
    assert len(bh.apply_edits(tmp_path, bh.TORCH_ONLY_EDITS)) == 1
    text = (tmp_path / "CMakeLists.txt").read_text()
    assert "set_target_properties(gloo PROPERTIES CXX_STANDARD 17)" in text
    (tmp_path / "CMakeLists.txt").write_text("another Horovod\n")
    with pytest.raises(bh.BuildError, match="found it 0 times: is this Horovod 0.28.1"):
        bh.apply_edits(tmp_path, bh.TORCH_ONLY_EDITS)


def test_tensorflow_distribution_is_detected_too(tmp_path):
    p = plan(tmp_path, {"tensorflow": "2.21.0"})
    assert (p.torch, p.tensorflow, p.tensorflow_dist) == (None, "2.21.0", "tensorflow")
    assert p.key == f"horovod-0.28.1-torch-none-tf-2.21.0-py311-fix-{fix_sha12()}"


def test_no_mpicxx_builds_without_mpi_and_says_so_in_the_key(tmp_path):
    p = plan(tmp_path, BOTH, mpi=False)
    assert p.flags["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in p.flags
    assert p.key.endswith("-nompi")
    assert any("mpicxx not found" in n for n in p.notes)


def test_without_mpi_even_when_mpicxx_is_there(tmp_path):
    p = plan(tmp_path, BOTH, without=["mpi"])
    assert p.flags["HOROVOD_WITHOUT_MPI"] == "1" and p.key.endswith("-nompi")


def test_with_mpi_fails_without_mpicxx(tmp_path):
    with pytest.raises(bh.BuildError, match="mpicxx is not on PATH"):
        plan(tmp_path, BOTH, with_=["mpi"], mpi=False)


def test_gpu_builds_get_their_own_key(tmp_path):
    p = plan(tmp_path, BOTH, environ={"HOROVOD_GPU_OPERATIONS": "NCCL"})
    assert p.key.endswith("-gpuops-nccl")
    env = fake_env(tmp_path, {"torch": "2.13.0"}, torch_cuda="12.6")
    p = bh.make_plan(env, set(), set(), path=tool_dir(tmp_path, mpicxx="g++"), environ={})
    assert p.key.endswith("-gloo17-cuda12.6")


@pytest.mark.parametrize("dists, with_, without, message", [
    ({"tensorflow-cpu": "2.21.0"}, ["torch"], [], "--with torch: PyTorch is not installed"),
    ({"torch": "2.13.0"}, ["tensorflow"], [], "tensorflow-cpu or tensorflow"),
    ({}, [], [], "nothing to build Horovod for"),
    (BOTH, [], ["torch,tensorflow"], "nothing to build Horovod for"),
])
def test_missing_frameworks_fail_clearly(tmp_path, dists, with_, without, message):
    with pytest.raises(bh.BuildError, match=message) as e:
        plan(tmp_path, dists, with_, without)
    assert e.value.code == 1


@pytest.mark.parametrize("with_, without, message", [
    (["torch"], ["torch"], "both --with and --without name torch"),
    (["mxnet"], [], "unknown 'mxnet'"),
])
def test_bad_choices_are_usage_errors(tmp_path, with_, without, message):
    with pytest.raises(bh.BuildError, match=message) as e:
        plan(tmp_path, BOTH, with_, without)
    assert e.value.code == 2


@pytest.mark.parametrize("version", ["1.4.0", "3.0.0", "0.4.1"])
def test_unsupported_torch_fails_clearly(tmp_path, version):
    with pytest.raises(bh.BuildError, match=rf"PyTorch {version} is not supported.*--without torch"):
        plan(tmp_path, {"torch": version})


def test_untested_torch_gets_a_note_not_an_error(tmp_path):
    p = plan(tmp_path, {"torch": "2.5.1", "tensorflow-cpu": "2.21.0"})
    assert p.torch == "2.5.1"
    assert any("tested with PyTorch 2.13" in n for n in p.notes)


def test_build_environment_overrides_the_callers_horovod_flags(tmp_path):
    p = plan(tmp_path, BOTH, without=["tensorflow"])
    env = fake_env(tmp_path, BOTH)
    out = bh.build_environ(p, env, jobs=3, base={
        "PATH": "/usr/bin", "HOROVOD_WITHOUT_PYTORCH": "1", "HOROVOD_WITH_TENSORFLOW": "1",
        "HOROVOD_GPU_OPERATIONS": "NCCL", "HOME": "/root"})
    assert "HOROVOD_WITHOUT_PYTORCH" not in out and "HOROVOD_WITH_TENSORFLOW" not in out
    assert out["HOROVOD_WITH_PYTORCH"] == "1" and out["HOROVOD_WITHOUT_TENSORFLOW"] == "1"
    assert out["HOROVOD_GPU_OPERATIONS"] == "NCCL" and out["HOME"] == "/root"
    assert out["MAKEFLAGS"] == "-j3"
    assert out["PATH"] == env.scripts + os.pathsep + "/usr/bin"


# ---------------------------------------------------------------------------------------------
# Prerequisites

def test_missing_compiler_and_headers_fail_clearly(tmp_path):
    empty = tool_dir(tmp_path)
    with pytest.raises(bh.BuildError, match="build-essential"):
        bh.check_toolchain(fake_env(tmp_path, BOTH), path=empty, environ={})
    env = fake_env(tmp_path, BOTH)
    env.python_h = False
    path = tool_dir(tmp_path, cc="", **{"c++": ""}, cmake="cmake version 3.25.1")
    with pytest.raises(bh.BuildError, match=r"python3\.11-dev"):
        bh.check_toolchain(env, path=path, environ={})


@pytest.mark.parametrize("cmake, need", [("cmake version 3.25.1", []),
                                         ("cmake version 3.10.2", ["cmake>=3.13"]),
                                         (None, ["cmake>=3.13"])])
def test_cmake_is_pip_installed_only_when_missing_or_old(tmp_path, cmake, need):
    tools = {"cc": "", "c++": ""}
    if cmake:
        tools["cmake"] = cmake
    path = tool_dir(tmp_path, **tools)
    assert bh.check_toolchain(fake_env(tmp_path, BOTH), path=path, environ={}) == need


def test_cuda_torch_without_nvcc_fails_clearly(tmp_path):
    env = fake_env(tmp_path, {"torch": "2.13.0"}, torch_cuda="12.6")
    path = tool_dir(tmp_path, cc="", **{"c++": ""}, cmake="cmake version 3.25.1")
    with pytest.raises(bh.BuildError, match="CUDA 12.6 build.*nvcc"):
        bh.check_toolchain(env, path=path, environ={})


# ---------------------------------------------------------------------------------------------
# The key, the cache and the sdist, on this environment

def test_cache_key_matches_setup_env_sh_for_this_environment():
    """The key launch/setup_env.sh computed (before it called build_horovod.py), so wheels cached
    by earlier set-ups are found."""
    env = bh.probe(sys.executable)
    if not (env.dists.get("torch") and env.dists.get("tensorflow-cpu")):
        pytest.skip("needs torch and tensorflow-cpu, as set up by launch/setup_env.sh")
    if not bh.which("mpicxx", env):
        pytest.skip("needs mpicxx, as set up by launch/setup_env.sh")
    script = f"""
        set -euo pipefail
        PY={sys.executable}
        TORCH_V=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
        TF_V=$("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))')
        PY_V=$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')
        echo "horovod-0.28.1-torch-$TORCH_V-tf-$TF_V-py$PY_V-fix-$(sha256sum {bh.FIX_SCRIPT} | cut -c1-12)"
    """
    want = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          check=True).stdout.strip()
    got = bh.make_plan(env, set(), set(), environ={}).key
    assert got == want
    recorded = Path(sys.prefix) / ".horovod-key"
    if recorded.exists():  # written by setup_env.sh (now through build_horovod.py)
        assert recorded.read_text().strip() == want


def args_for(argv):
    return bh.build_parser().parse_args(argv)


def test_sha256_mismatch_fails_before_building(tmp_path, capsys):
    fake = tmp_path / "horovod-0.28.1.tar.gz"
    fake.write_bytes(b"not horovod")
    cache = tmp_path / "cache"
    code = bh.run(args_for(["--sdist", str(fake), "--cache-dir", str(cache), "--force-rebuild",
                            "--no-install"]))
    err = capsys.readouterr().err
    assert code == 1
    assert f"sha256 mismatch for {fake}" in err
    assert f"expected {bh.HOROVOD_SHA256}" in err
    assert f"got      {bh.sha256_file(fake)}" in err
    assert "refusing to build" in err
    assert not list(cache.glob("wheels/*/*.whl")) and not (cache / "logs").exists()


def test_missing_sdist_file_fails_clearly(tmp_path, capsys):
    code = bh.run(args_for(["--sdist", str(tmp_path / "nope.tar.gz"), "--cache-dir",
                            str(tmp_path), "--force-rebuild", "--no-install"]))
    assert code == 1 and "no such file" in capsys.readouterr().err


def this_environment():
    """(this interpreter's environment, its cache key); skips where no framework is installed."""
    env = bh.probe(sys.executable)
    try:
        return env, bh.make_plan(env, set(), set()).key
    except bh.BuildError as e:
        pytest.skip(f"no framework here: {e}")


def test_cached_wheel_is_used_and_copied_out(tmp_path, capsys):
    _, key = this_environment()
    cache = tmp_path / "cache"
    wheel = cache / "wheels" / key / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"a cached wheel")
    out = tmp_path / "out"
    assert bh.run(args_for(["--cache-dir", str(cache), "--no-install",
                            "--wheel-dir", str(out)])) == 0
    assert (out / wheel.name).read_bytes() == b"a cached wheel"
    printed = capsys.readouterr().out
    assert f"cache key {key}" in printed and f"cached wheel: {wheel}" in printed
    assert "no cached wheel" not in printed and "building the wheel" not in printed


def test_cache_dir_follows_hvd_scale_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_SCALE_CACHE", str(tmp_path / "c"))
    assert bh.cache_root() == tmp_path / "c"
    assert bh.cache_root(str(tmp_path / "d")) == tmp_path / "d"
    monkeypatch.delenv("HVD_SCALE_CACHE")
    assert bh.cache_root() == Path.home() / ".cache" / "hvd_scale"


def test_dry_run_changes_nothing(tmp_path, capsys):
    cache = tmp_path / "cache"
    code = bh.run(args_for(["--dry-run", "--cache-dir", str(cache), "--wheel-dir",
                            str(tmp_path / "out")]))
    printed = capsys.readouterr()
    if code != 0:
        assert "nothing to build Horovod for" in printed.err
        return
    assert "dry run: would build with" in printed.out and "HOROVOD_WITH_GLOO=1" in printed.out
    assert not cache.exists() and not (tmp_path / "out").exists()


def test_an_up_to_date_environment_is_left_alone(tmp_path, capsys):
    env, key = this_environment()
    if bh.installed_key(env) != key:
        pytest.skip("Horovod is not installed here by set-up for this key")
    cache = tmp_path / "empty-cache"
    assert bh.run(args_for(["--cache-dir", str(cache)])) == 0
    assert "already installed: nothing to do" in capsys.readouterr().out
    assert not cache.exists()


def test_wheel_requirements_skip_extras_and_markers(tmp_path):
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("horovod-0.28.1.dist-info/METADATA", "\n".join([
            "Name: horovod", "Requires-Dist: cloudpickle", "Requires-Dist: pyyaml",
            'Requires-Dist: dataclasses; python_version < "3.7"', "Requires-Dist: cffi>=1.4.0",
            'Requires-Dist: torch; extra == "pytorch"']))
    assert bh.wheel_requirements(wheel) == ["cloudpickle", "pyyaml", "cffi"]


# ---------------------------------------------------------------------------------------------
# The command line

def help_text() -> str:
    return bh.build_parser().format_help()


def test_help_says_what_it_does():
    text = " ".join(help_text().split())
    assert text.startswith("usage: hvd-scale build-horovod")
    for sentence in [
        "Build the patched Horovod 0.28.1 wheel for this Python environment's Python, torch and "
        "TensorFlow (once: the wheel is cached), then install it.",
        "Gloo is always built; MPI when mpicxx is on PATH.",
        "$HVD_SCALE_CACHE/wheels/KEY/ (default ~/.cache/hvd_scale)",
        "horovod-0.28.1-torch-2.13.0-tf-2.21.0-py311-fix-dfaf58c223c8",
        "Comma-separated frameworks the wheel must include: torch, tensorflow, mpi.",
        "Comma-separated frameworks to leave out even when installed",
        "Also copy the wheel into DIR",
        "Build even when a wheel is cached for this key",
        "hvd-scale build-horovod --without tensorflow",
    ]:
        assert sentence in text, sentence
    for option in ["--with", "--without", "--install", "--no-install", "--wheel-dir",
                   "--force-rebuild", "--python", "--cache-dir", "--sdist", "--jobs", "--dry-run"]:
        assert option in text


def test_add_arguments_serves_a_subcommand():
    parser = argparse.ArgumentParser(prog="hvd-scale")
    sub = parser.add_subparsers(dest="command")
    bh.add_arguments(sub.add_parser("build-horovod"))
    args = parser.parse_args(["build-horovod", "--with", "torch", "--without", "tensorflow,mpi",
                              "--no-install", "--wheel-dir", "w", "--force-rebuild"])
    assert (args.with_, args.without, args.install, args.wheel_dir, args.force_rebuild) == (
        ["torch"], ["tensorflow,mpi"], False, "w", True)
    assert args.python == sys.executable and args.jobs >= 1


def test_main_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        bh.main(["--help"])
    assert e.value.code == 0
    assert "--force-rebuild" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["script", "module"])
def test_runs_as_a_script_and_as_a_module(tmp_path, how):
    """setup_env.sh runs the file before the project is installed: importing it, and --help, need
    only the stdlib (filelock and packaging are imported where they are used)."""
    cmd = ([sys.executable, "-S", str(SCRIPT)] if how == "script"
           else [sys.executable, "-m", "hvd_scale.launch.build_horovod"])
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Gloo is always built" in out.stdout
