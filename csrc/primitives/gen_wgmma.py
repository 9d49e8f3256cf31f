"""Writes csrc/generated/wgmma_ops.cuh: the Wgmma<Element, N> specializations of
csrc/primitives/wgmma.cuh, one per (16-bit type, width N). An inline-asm statement names every
accumulator register of m64nNk16 (N / 2 of them) in literal text, so each width is written out
here instead of by hand. setup.py (and benchmarks/tune_kernels.py) run it before compiling.

    python csrc/primitives/gen_wgmma.py [OUT_PATH]
"""
import os
import sys

# wgmma N widths the kernels use: 64 and 128 (backward; forward S and O), 80 / 112 (forward key
# tiles of head dims 256 / 192, ../shared/HOPPER.md §1.1), 192 / 256 (the backward roles kernels'
# dK / dV of head dims 192 / 256); 96, 144 and 176 for the tuning harness (benchmarks/tune_kernels.py
# fwd90 rows; FA3's d128 non-causal 128 x 176 measured slower here).
WIDTHS = [64, 80, 96, 112, 128, 144, 176, 192, 256]
TYPES = [("__half", "f16"), ("__nv_bfloat16", "bf16")]

HEADER = """// Written by csrc/primitives/gen_wgmma.py; do not edit. Included by primitives/wgmma.cuh.
// Wgmma<Element, N>::ss / rs for N = {widths}: D(64xN) (+)= A(64x16) * B(16xN), A from shared
// memory (ss, K-major descriptor) or registers (rs), B from shared memory; kTransB 0 = B K-major,
// 1 = N-major; accumulate 0 overwrites D.
#pragma once

namespace flash {{
"""

SPEC = """
template <>
struct Wgmma<{el}, {n}> {{
  template <int kTransB>
  static __device__ __forceinline__ void ss(float (&d)[{r}], uint64_t desc_a, uint64_t desc_b, int accumulate) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r2}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {regs}, %{r}, %{r1}, p, 1, 1, 0, %{r3};\\n}}\\n"
                 : {outs}
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB));
  }}
  template <int kTransB>
  static __device__ __forceinline__ void rs(float (&d)[{r}], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r5}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {regs}, {{%{r}, %{r1}, %{r2}, %{r3}}}, %{r4}, p, 1, 1, %{r6};\\n}}\\n"
                 : {outs}
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB));
  }}
}};
"""


def text():
    out = [HEADER.format(widths=", ".join(map(str, WIDTHS)))]
    for n in WIDTHS:
        r = n // 2
        regs = "{" + ", ".join(f"%{i}" for i in range(r)) + "}"
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
        for el, ty in TYPES:
            out.append(SPEC.format(el=el, ty=ty, n=n, r=r, r1=r + 1, r2=r + 2, r3=r + 3, r4=r + 4, r5=r + 5,
                                   r6=r + 6, regs=regs, outs=outs))
    out.append("\n}  // namespace flash\n")
    return "".join(out)


def write(path):
    """Writes the header to `path` unless it already holds the same text (keeps ninja's mtimes)."""
    new = text()
    if not (os.path.exists(path) and open(path).read() == new):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(new)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    write(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "generated", "wgmma_ops.cuh"))
