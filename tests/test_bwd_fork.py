"""The backward's side stream for its dQ kernel (csrc/kernels/bwd_fork.h: flash::BwdFork), host
logic only, on any machine: tests/cpp/bwd_fork_test.cpp compiled against the mock CUDA runtime of
tests/cpp/mock_cuda drives the fork and join, one side stream per (host thread, device, caller's
stream; made while that stream captures too), the fallbacks to running the kernels in sequence
(disabled, every creation call failing, the 48 slots of a thread taken), the join when a launch throws,
and the release of every stream and event at thread exit. The GPU side (the kernels really running
side by side, graph capture, threads) is in tests/test_cuda_backward.py."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cxx():
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def test_bwd_fork_against_mock_runtime(tmp_path):
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler (g++, c++, clang++ or $CXX) to build the mock-runtime test")
    exe = tmp_path / "bwd_fork_test"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O0", "-Wall", "-Wextra", "-Werror", "-pthread",
         "-I", os.path.join(ROOT, "tests", "cpp", "mock_cuda"), "-I", os.path.join(ROOT, "csrc"),
         os.path.join(ROOT, "tests", "cpp", "bwd_fork_test.cpp"), "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-4000:] + run.stderr[-2000:]
