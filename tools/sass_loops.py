"""Static instruction counts of a kernel's loops, from its SASS: what an issue-bound kernel spends per iteration.

Compiles one specialisation with NVRTC for sm_<arch> (no GPU needed), disassembles the kernel with
`cuobjdump -sass` (the CUDA toolkit's, or the PyPI package nvidia-cuda-cuobjdump's: `pip download
nvidia-cuda-cuobjdump`, unzip, point VOLTSERVE_CUOBJDUMP at its bin/cuobjdump) and reports every loop, i.e. every
backward branch, with the instructions between its target and the branch and their opcode histogram. The count
is static: a loop body's branches (a uniform fast path next to a slow one) are all counted.

Usage:
    PYTHONPATH=src:. python tools/sass_loops.py gemv_s8 gemv_s8w --gemv-s8 Q4_1 [--arch 90] [--define S8W_UNROLL=2]
    PYTHONPATH=src:. python tools/sass_loops.py gemv gemv --define WTYPE=0 --define MROWS=1
Prints JSON: the kernel's registers (from ptxas) and its loops, innermost first.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[0-7T]\s+")
_BRANCH = re.compile(r"^BRA(?:\.\w+)*\s+(?:!?U?P[0-7T],\s*)?0x([0-9a-f]+)$")


def parse_sass(text: str) -> list[tuple[int, str]]:
    """(address, instruction) for each instruction line of `cuobjdump -sass` output; a predicated instruction
    keeps its "@P0 " prefix."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in _LINE.finditer(text)]


def opcode(instr: str) -> str:
    """The base opcode of an instruction: "@!P1 LDG.E.128.CONSTANT R12, ..." -> "LDG"."""
    return _PRED.sub("", instr).split()[0].split(".")[0]


def loops(instrs: list[tuple[int, str]]) -> list[dict]:
    """Every backward branch before the first unconditional EXIT, as a loop: {"start", "end" (hex addresses),
    "instructions", "opcodes" (count per base opcode, most first)}, smallest first. The blocks after that EXIT
    (the fallbacks of BRA.DIV for a diverged warp's shuffles, the closing self-branch) jump back into the body
    and are not loops."""
    found = []
    for addr, instr in instrs:
        if instr == "EXIT":  # unconditional: a predicated one reads "@P0 EXIT"
            break
        m = _BRANCH.match(_PRED.sub("", instr))
        if m is None or int(m.group(1), 16) > addr:
            continue
        start = int(m.group(1), 16)
        body = [i for a, i in instrs if start <= a <= addr]
        hist = collections.Counter(opcode(i) for i in body)
        found.append({"start": f"0x{start:x}", "end": f"0x{addr:x}", "instructions": len(body),
                      "opcodes": dict(hist.most_common())})
    return sorted(found, key=lambda lp: lp["instructions"])


def find_cuobjdump() -> str:
    """VOLTSERVE_CUOBJDUMP, cuobjdump on PATH, or one installed by a pip package (nvidia/*/bin/cuobjdump).

    Raises:
        SystemExit: none found (the module docstring says where to get one).
    """
    found = os.environ.get("VOLTSERVE_CUOBJDUMP") or shutil.which("cuobjdump")
    if not found:
        hits = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin", "cuobjdump"))
        found = hits[0] if hits else None
    if not found:
        raise SystemExit("no cuobjdump: install the CUDA toolkit or nvidia-cuda-cuobjdump (see this tool's help)")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", help="a kernels.SOURCES key, e.g. gemv_s8")
    ap.add_argument("kernel", help="the entry point, e.g. gemv_s8w")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--gemv-s8", metavar="FMT", help="start from kernels.gemv_s8_spec(FMT, silu=False, rows=1)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=INT", help="add or override a -D")
    args = ap.parse_args()
    from voltserve.backends.cuda import kernels, nvrtc

    spec = kernels.gemv_s8_spec(args.gemv_s8, False, 1) if args.gemv_s8 else {}
    for d in args.define:
        name, _, value = d.partition("=")
        spec[name] = int(value)
    src = kernels.SOURCES[args.op]
    path = nvrtc.ptx_dir() / src.file
    options = nvrtc._options(kernels.defines(args.op, **spec)) + ("--ptxas-options=-v",)
    cubin, log = nvrtc._run_nvrtc(src.file, path.read_bytes(), options, f"--gpu-architecture=sm_{args.arch}", True)
    regs = re.search(rf"entry function '{args.kernel}'.*?Used (\d+) registers", log, re.S)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([find_cuobjdump(), "-sass", "-fun", args.kernel, f.name], check=True,
                              capture_output=True, text=True).stdout
    instrs = parse_sass(sass)
    if not instrs:
        raise SystemExit(f"no SASS for {args.kernel} in {src.file} with {spec}")
    print(json.dumps({"source": src.file, "kernel": args.kernel, "arch": args.arch, "spec": spec,
                      "registers": int(regs.group(1)) if regs else None, "instructions": len(instrs),
                      "loops": loops(instrs)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
