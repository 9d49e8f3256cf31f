"""Static SASS statistics of one compiled kernel object (cuobjdump -sass): what each consumer
warpgroup does while it holds its ping-pong turn, and the instruction mix of the main loops.

  turns   each BAR.SYNC ... BAR.ARV section (sm90 forward: WarpgroupTurns::begin / end): its length
          and instruction mix. Everything in it delays the other warpgroups' products, so it should
          hold little beyond the HGMMA issue.
  loops   each backward branch whose body holds >= 4 HGMMA: its length and instruction mix (static:
          every path of the body, rare ones included).

Needs cuobjdump (CUDA toolkit; or the nvidia-cuda-cuobjdump wheel: `pip install
nvidia-cuda-cuobjdump`, then --cuobjdump .../nvidia/cu13/bin/cuobjdump). One instantiation compiles
in seconds without a GPU, e.g. (csrc/generated/ as setup.py writes it):

    nvcc -O3 -std=c++17 --expt-relaxed-constexpr -Icsrc -gencode arch=compute_90a,code=sm_90a \\
        -c csrc/kernels/sm90/instantiations/flash_fwd_hdim64_bf16_sm90.cu -o /tmp/f64.o
    python scripts/sass_stats.py /tmp/f64.o turns
    python scripts/sass_stats.py /tmp/f64.o loops --function 1
"""

import argparse
import collections
import re
import shutil
import subprocess


def functions(obj: str, cuobjdump: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(name, [(address, instruction)]) of every function in the object's SASS."""
    sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, check=True).stdout
    out = []
    for part in sass.split("Function : ")[1:]:
        ins = []
        for line in part.splitlines():
            m = re.match(r"\s*/\*([0-9a-f]{4,6})\*/\s*(.*?)\s*;", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2)))
        out.append((part.splitlines()[0].strip(), ins))
    return out


def full_opcode(instruction: str) -> str:
    """The opcode with its modifiers, without the predicate: '@P0 BAR.ARV R9, 0x100' -> 'BAR.ARV'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def opcode(instruction: str) -> str:
    """The opcode without predicate and modifiers: '@!P0 BRA 0x10' -> 'BRA'."""
    return full_opcode(instruction).split(".")[0]


def mix(body: list[str]) -> str:
    counts = collections.Counter(opcode(x) for x in body)
    return " ".join(f"{k}:{v}" for k, v in counts.most_common())


def turns(ins: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """(index, body) of each BAR.SYNC ... BAR.ARV section (no other BAR.SYNC in between)."""
    out, i = [], 0
    while i < len(ins):
        if full_opcode(ins[i][1]).startswith("BAR.SYNC"):
            j = i + 1
            while j < len(ins) and not full_opcode(ins[j][1]).startswith(("BAR.ARV", "BAR.SYNC")):
                j += 1
            if j < len(ins) and full_opcode(ins[j][1]).startswith("BAR.ARV"):
                out.append((i, [x for _, x in ins[i + 1:j]]))
            i = j
        else:
            i += 1
    return out


def loops(ins: list[tuple[int, str]], min_hgmma: int = 4) -> list[tuple[int, int, list[str]]]:
    """(first, last, body) of each backward branch's body holding >= min_hgmma HGMMA."""
    index = {a: k for k, (a, _) in enumerate(ins)}
    out = []
    for k, (a, s) in enumerate(ins):
        # A branch's target: its last address operand ('BRA 0x10', '@!P0 BRA.U !UP0, 0x10').
        targets = re.findall(r"0x([0-9a-f]+)", s) if opcode(s) == "BRA" else []
        if targets and int(targets[-1], 16) < a and int(targets[-1], 16) in index:
            first = index[int(targets[-1], 16)]
            body = [x for _, x in ins[first:k + 1]]
            if sum(opcode(x) == "HGMMA" for x in body) >= min_hgmma:
                out.append((first, k, body))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("object", help="a compiled .o / .cubin")
    ap.add_argument("what", choices=("turns", "loops"))
    ap.add_argument("--function", type=int, default=None, help="index of the function (default: all)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = ap.parse_args()
    for f, (name, ins) in enumerate(functions(args.object, args.cuobjdump)):
        if args.function is not None and f != args.function:
            continue
        print(f"[{f}] {name[:160]} ({len(ins)} instructions)")
        if args.what == "turns":
            for i, body in turns(ins):
                print(f"  turn at {i}: {len(body)} instructions; {mix(body)}")
        else:
            for first, last, body in loops(ins):
                print(f"  loop {first}..{last}: {len(body)} instructions; {mix(body)}")


if __name__ == "__main__":
    main()
