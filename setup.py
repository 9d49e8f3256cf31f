"""Build flash_attn_ext._C through torch.utils.cpp_extension (ninja; MAX_JOBS respected).

Environment variables (all optional):
  FLASH_ATTN_EXT_CUDA_ARCHS  ';'-separated SM list, e.g. "80;90a", "90", "8.6", "sm_90a". "90"
                             means sm_90a (wgmma-capable). "none" (or "cpu") builds the CPU-only
                             module. Default: the visible GPU's arch, else "80;90a" (a CPU-only
                             build, with a notice, without a CUDA torch or nvcc; when set by
                             name, that is an error instead).
  FLASH_ATTN_EXT_HDIMS       ','-separated compiled head dims (subset of
                             32,64,96,128,192,256). Default: all. Narrow for dev builds.
  FLASH_ATTN_EXT_PTX         1 (default) embeds portable PTX (compute_80 or compute_90,
                             never 90a) so newer GPUs can JIT the generic path; 0 skips it.
  FLASH_ATTN_EXT_PTXAS_V     1 prints the ptxas resource report (registers, spills).
  CUDA_HOME                  the CUDA toolkit; found automatically otherwise, also when
                             the `nvcc` on PATH is a wrapper script outside the toolkit.
"""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load(name, *path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The one list of (arch path, kernel, head dim, dtype), and the writer of the wgmma widths header.
MANIFEST = _load("flash_attn_ext_manifest", "csrc", "kernels", "generate_kernels.py")
WGMMA = _load("flash_attn_ext_gen_wgmma", "csrc", "primitives", "gen_wgmma.py")
ALL_HDIMS = MANIFEST.HDIMS


def _is_toolkit(path):
    if not path or not os.path.isfile(os.path.join(path, "bin", "nvcc")):
        return False
    return any(
        os.path.exists(os.path.join(path, sub, "libcudart.so"))
        for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                    os.path.join("targets", "sbsa-linux", "lib"))
    )


def find_cuda_home():
    """The real toolkit folder (holding bin/nvcc and lib64/libcudart.so), or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        # A wrapper script ("exec /usr/local/cuda-13.0/bin/nvcc "$@"") names the real one.
        try:
            with open(real, "r", errors="ignore") as f:
                head = f.read(4096)
            for m in re.finditer(r"(/[^\s\"']+)/bin/nvcc", head):
                candidates.append(m.group(1))
        except OSError:
            pass
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        if c and _is_toolkit(c):
            return os.path.realpath(c)
    return None


def _env_list(name, default, sep):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return [x.strip() for x in raw.replace(",", sep).replace(";", sep).split(sep) if x.strip()]


def parse_archs(torch):
    raw = os.environ.get("FLASH_ATTN_EXT_CUDA_ARCHS", "").strip().lower()
    if raw in ("none", "cpu", "0"):
        return []
    if raw:
        archs = [a.strip() for a in raw.replace(",", ";").split(";") if a.strip()]
    elif torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        archs = [f"{major}{minor}"]
    else:
        archs = ["80", "90a"]
    out = []
    for given in archs:
        a = given.replace(".", "").replace("sm_", "").replace("sm", "").replace("compute_", "")
        if a == "90":
            a = "90a"  # the Hopper path (wgmma, setmaxnreg) needs the arch-specific target
        if not re.fullmatch(r"\d+a?", a):
            sys.exit(f"FLASH_ATTN_EXT_CUDA_ARCHS: {given!r} is not an SM architecture; expected e.g. '80', '90a', "
                     "'8.6', 'sm_90a' (';'-separated), or 'none' for the CPU-only module")
        if int(re.match(r"\d+", a).group()) < 80:
            sys.exit(f"FLASH_ATTN_EXT_CUDA_ARCHS: sm_{a} is below sm_80, which is not supported")
        out.append(a)
    return sorted(set(out), key=lambda s: int(re.match(r"\d+", s).group()))


def check_archs_known(cuda_home, archs):
    """Exits naming FLASH_ATTN_EXT_CUDA_ARCHS where a target is not one this nvcc compiles for
    (`nvcc --list-gpu-arch`; an arch-specific 'a' target exists from sm_90 on), before any compile."""
    try:
        listed = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"],
                                capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return  # an nvcc without the flag: its own error comes at the first compile
    known = sorted({s[len("compute_"):] for s in listed if re.fullmatch(r"compute_\d+", s)}, key=int)
    for a in archs:
        base = re.match(r"\d+", a).group()
        if base not in known or (a.endswith("a") and int(base) < 90):
            sys.exit(f"FLASH_ATTN_EXT_CUDA_ARCHS: sm_{a} is not a target of {cuda_home}/bin/nvcc (it compiles "
                     f"for {', '.join(known)}; an 'a' suffix only from 90 on)")


def gencode_flags(archs, with_ptx):
    # Portable PTX of the lowest generic arch (never an 'a' target: that would not JIT on
    # other GPUs). When that arch is compiled anyway, its front-end pass also emits the PTX.
    base = re.match(r"\d+", archs[0]).group()
    flags = []
    for a in archs:
        code = f"[sm_{a},compute_{a}]" if (with_ptx and a == base) else f"sm_{a}"
        flags += ["-gencode", f"arch=compute_{a},code={code}"]
    if with_ptx and archs[0] != base:
        flags += ["-gencode", f"arch=compute_{base},code=compute_{base}"]
    return flags


def write_build_config(torch, archs, hdims, cuda_version):
    WGMMA.write(os.path.join(ROOT, "csrc", "generated", "wgmma_ops.cuh"))  # primitives/wgmma.cuh's widths
    path = os.path.join(ROOT, "csrc", "generated", "build_config.h")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = (
        "// Written by setup.py; do not edit.\n#pragma once\n"
        f'#define FLASH_ATTN_EXT_BUILD_ARCHS "{";".join(archs)}"\n'
        f'#define FLASH_ATTN_EXT_BUILD_HDIMS "{",".join(map(str, hdims)) if archs else ""}"\n'
        f'#define FLASH_ATTN_EXT_BUILD_CUDA "{cuda_version}"\n'
        f'#define FLASH_ATTN_EXT_BUILD_TORCH "{torch.__version__}"\n'
    ) + MANIFEST.config_macros(archs, hdims)
    old = open(path).read() if os.path.exists(path) else None
    if old != text:  # keep the mtime when nothing changed, so ninja rebuilds nothing
        with open(path, "w") as f:
            f.write(text)


def kernel_sources(archs, hdims):
    srcs = ["csrc/kernels/dispatch.cu"] + MANIFEST.sources(archs, hdims)
    missing = [s for s in srcs if not os.path.exists(os.path.join(ROOT, s))]
    if missing:
        sys.exit("missing kernel sources (run python csrc/kernels/generate_kernels.py): "
                 + ", ".join(missing))
    return srcs


def build_extension():
    cuda_home = find_cuda_home()
    if cuda_home and not os.environ.get("CUDA_HOME"):
        os.environ["CUDA_HOME"] = cuda_home  # must precede the cpp_extension import
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    archs = parse_archs(torch)
    given_home = os.environ.get("CUDA_HOME", "").strip()
    if archs and torch.version.cuda is not None and given_home and not os.path.isfile(
            os.path.join(given_home, "bin", "nvcc")):
        # torch's CUDA build takes CUDA_HOME as given: say so by name before it fails on bin/nvcc (a CPU
        # torch builds the CPU-only module, below, whatever CUDA_HOME says).
        sys.exit(f"CUDA_HOME={given_home!r} has no bin/nvcc; point it at the CUDA toolkit, unset it (the "
                 "toolkit is then searched on PATH and in /usr/local/cuda*), or build the CPU-only module "
                 "with FLASH_ATTN_EXT_CUDA_ARCHS=none")
    hdims_given = _env_list("FLASH_ATTN_EXT_HDIMS", [str(h) for h in ALL_HDIMS], ",")
    bad = [h for h in hdims_given if not h.isdigit() or int(h) not in ALL_HDIMS]
    if bad:
        sys.exit(f"FLASH_ATTN_EXT_HDIMS: {bad} not in {ALL_HDIMS}")
    hdims = sorted({int(h) for h in hdims_given})  # a head dim given twice is compiled once
    for name in ("FLASH_ATTN_EXT_PTX", "FLASH_ATTN_EXT_PTXAS_V"):
        if os.environ.get(name, "").strip() not in ("", "0", "1"):
            sys.exit(f"{name}: expected 0 or 1, got {os.environ[name]!r}")
    if archs and cuda_home:
        check_archs_known(cuda_home, archs)
    use_cuda = bool(archs) and torch.version.cuda is not None and cuda_home is not None
    if archs and not use_cuda:
        why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA toolkit (nvcc) found"
        if os.environ.get("FLASH_ATTN_EXT_CUDA_ARCHS", "").strip():
            # Asked for by name: an error, not a CPU build that pip's quiet output would hide.
            sys.exit(f"FLASH_ATTN_EXT_CUDA_ARCHS={os.environ['FLASH_ATTN_EXT_CUDA_ARCHS']} asks for CUDA kernels, "
                     f"but {why}; install a CUDA build of torch and the CUDA toolkit (or set CUDA_HOME), or "
                     "build the CPU-only module with FLASH_ATTN_EXT_CUDA_ARCHS=none")
        print(f"flash_attn_ext: building the CPU-only module ({why}); CUDA ops will be absent.")
        archs = []
    write_build_config(torch, archs, hdims, torch.version.cuda if use_cuda else "")

    # No -std for C++: BuildExtension adds the standard this torch's headers are built for
    # (C++17 for older torch, C++20 for newer); mixing standards across torch's ABI is unsafe.
    # -g0: no debug sections (Python's own CFLAGS carry -g: ~14 MB of the CPU module's 15 MB).
    cxx_flags = ["-O3", "-g0"]
    sources = ["csrc/flash_api.cpp", "csrc/kernels/cpu/flash_cpu.cpp"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if not use_cuda:
        ext = CppExtension("flash_attn_ext._C", sources, include_dirs=include_dirs,
                           extra_compile_args={"cxx": cxx_flags})
        return ext, BuildExtension

    nvcc_flags = [
        "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-Xfatbin", "-compress-all",
    ] + gencode_flags(archs, os.environ.get("FLASH_ATTN_EXT_PTX", "1").strip() != "0")
    if os.environ.get("FLASH_ATTN_EXT_PTXAS_V", "0").strip() == "1":
        nvcc_flags += ["-Xptxas", "-v"]
    ext = CUDAExtension(
        "flash_attn_ext._C",
        sources + kernel_sources(archs, hdims),
        include_dirs=include_dirs,
        define_macros=[("FLASH_ATTN_EXT_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags + ["-DFLASH_ATTN_EXT_WITH_CUDA"],
                            "nvcc": nvcc_flags},
    )
    return ext, BuildExtension


ext, build_cls = build_extension()
setup(
    ext_modules=[ext],
    cmdclass={"build_ext": build_cls.with_options(use_ninja=True)},
)
