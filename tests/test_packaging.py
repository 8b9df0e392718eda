"""Packaging as another project consumes it (#10 item 7): the torch pin, clear import errors,
the version, the wheel's layout and metadata as declared in pyproject.toml."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
import types

import pytest
import torch

import paged_ops
from paged_ops import _build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def fake_info(**kw):
    info = types.SimpleNamespace(VERSION="0.1.0", TORCH_VERSION=torch.__version__,
                                 TORCH_CUDA_VERSION=torch.version.cuda or "", WITH_CUDA=False, CUDA_ARCHS="")
    for k, v in kw.items():
        setattr(info, k, v)
    return info


def test_version_is_the_package_version():
    assert paged_ops.__version__ == pyproject()["project"]["version"]


def test_this_build_matches_this_torch():
    _build.check()  # the installed build was made against the running torch


@pytest.mark.parametrize("built", ["2.9.0", "2.9.0+cu126", "3.0.0+cpu"])
def test_mismatched_torch_is_a_clear_import_error(built):
    with pytest.raises(ImportError, match=rf"built against torch {built.replace('+', '[+]')}.*install torch=="):
        _build.check(fake_info(TORCH_VERSION=built))


def test_local_build_tag_does_not_matter():
    # a +cpu or +cu130 build of the same release has the same C++ ABI for the CPU part
    base = torch.__version__.split("+")[0]
    _build.check(fake_info(TORCH_VERSION=base + "+cpu"))


def test_cuda_build_on_a_cpu_only_torch_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ImportError, match="CPU-only build"):
        _build.check(fake_info(WITH_CUDA=True, TORCH_CUDA_VERSION="13.0"))


def test_source_tree_without_a_build_says_how_to_build(tmp_path):
    # A copy of the package without the build's files, imported past the editable install's finder.
    shutil.copytree(os.path.join(ROOT, "paged_ops"), tmp_path / "paged_ops",
                    ignore=shutil.ignore_patterns("_C*.so", "_build_info.py", "__pycache__"))
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__]\n"
            f"sys.path.insert(0, {str(tmp_path)!r})\n"
            "import paged_ops\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "partially initialized" not in proc.stderr
    assert "no compiled extension" in proc.stderr and "pip install --no-build-isolation" in proc.stderr, \
        proc.stderr[-2000:]


def test_torch_pin_is_the_release_built_against():
    spec = importlib.util.spec_from_file_location("torch_pin", os.path.join(ROOT, "tools", "torch_pin.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    deps = mod.dynamic_metadata({}, {})["dependencies"]
    assert deps[0] == f"torch=={torch.__version__.split('+')[0]}"
    proj = pyproject()
    assert "dependencies" in proj["project"]["dynamic"]
    assert proj["tool"]["dynamic-metadata"][0]["provider"] == {"path": "tools", "module": "torch_pin"}


def test_wheel_layout_and_license():
    proj = pyproject()
    # The engine ships inside the package: a top-level "engine" would collide with users' modules.
    assert proj["tool"]["scikit-build"]["wheel"]["packages"] == {"paged_ops": "paged_ops",
                                                                 "paged_ops/engine": "engine"}
    assert proj["project"]["license"] == "Apache-2.0"
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(500)
