"""setup.py's checks of its environment variables: a bad value stops the build before any compile,
with a message naming the variable (run as pip runs it: `python setup.py`, here `--name`, which
evaluates the extension first)."""
import os
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_setup(tmp_path, **env):
    """`python setup.py --name` in a copy of the files it reads (it writes csrc/generated/ beside
    itself, which must not touch this tree's build). --name only prints the project name, but
    setup.py evaluates the extension, and its checks, first."""
    src = tmp_path / "src"
    for rel in ("setup.py", "pyproject.toml", "README.md", "flash_attn_ext/__init__.py",
                "flash_attn_ext/bench/__init__.py", "csrc/kernels/generate_kernels.py", "csrc/primitives/gen_wgmma.py"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, rel), src / rel)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FLASH_ATTN_EXT_", "CUDA_HOME", "CUDA_PATH"))}
    full.update(env)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=src, env=full, capture_output=True,
                          text=True, timeout=120)


def fake_toolkit(tmp_path):
    """A folder setup.py takes for a CUDA toolkit: bin/nvcc (answering --list-gpu-arch as nvcc 13.0
    does) and lib64/libcudart.so."""
    home = tmp_path / "toolkit"
    (home / "bin").mkdir(parents=True)
    (home / "lib64").mkdir()
    (home / "lib64" / "libcudart.so").write_bytes(b"")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nfor a in 75 80 86 87 88 89 90 100 110 103 120 121; do echo compute_$a; done\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return str(home)


@pytest.mark.parametrize("given", ["130", "86a", "75"])
def test_an_arch_this_nvcc_lacks_is_named_before_compiling(tmp_path, given):
    r = run_setup(tmp_path, CUDA_HOME=fake_toolkit(tmp_path), FLASH_ATTN_EXT_CUDA_ARCHS=given)
    assert r.returncode != 0
    expected = "below sm_80" if given == "75" else f"sm_{given} is not a target of"
    assert "FLASH_ATTN_EXT_CUDA_ARCHS" in r.stderr and expected in r.stderr, r.stderr[-2000:]


def test_a_known_arch_passes_the_target_check(tmp_path):
    r = run_setup(tmp_path, CUDA_HOME=fake_toolkit(tmp_path), FLASH_ATTN_EXT_CUDA_ARCHS="90a")
    # Past the target check: a CPU torch stops it next, by name; a CUDA torch would build.
    assert "is not a target of" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("archs", ["90a", None])
def test_cuda_home_without_nvcc(tmp_path, archs):
    """A CUDA_HOME without bin/nvcc: named, for a CUDA torch (which would build with it); a CPU
    torch builds the CPU-only module whatever CUDA_HOME says, so only an explicit
    FLASH_ATTN_EXT_CUDA_ARCHS stops it, by naming the CPU torch."""
    import torch
    env = {"CUDA_HOME": str(tmp_path / "nowhere")} | ({"FLASH_ATTN_EXT_CUDA_ARCHS": archs} if archs else {})
    r = run_setup(tmp_path, **env)
    if torch.version.cuda is not None:
        assert r.returncode != 0
        assert "CUDA_HOME=" in r.stderr and "has no bin/nvcc" in r.stderr, r.stderr[-2000:]
    elif archs:
        assert r.returncode != 0 and "has no bin/nvcc" not in r.stderr
        assert "FLASH_ATTN_EXT_CUDA_ARCHS" in r.stderr and "torch is a CPU build" in r.stderr, r.stderr[-2000:]
    else:
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip().splitlines()[-1] == "flash_attn_ext"


def test_cuda_home_is_not_needed_without_cuda_archs(tmp_path):
    """FLASH_ATTN_EXT_CUDA_ARCHS=none builds the CPU module alone, CUDA_HOME anywhere: with a CUDA
    torch this is the case that counts (a GPU run keeps it: no "cpu" in its name, conftest's
    GPU_ONLY)."""
    r = run_setup(tmp_path, CUDA_HOME=str(tmp_path / "nowhere"), FLASH_ATTN_EXT_CUDA_ARCHS="none")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "flash_attn_ext"
