"""The SASS of one kernel variant around an offset that a sanitizer or a fault names
(`... kernel<...>(params)+0xd0b0`), compiled by this machine's NVRTC exactly as cuattn loads it
(plus line info), disassembled by the CUDA toolkit's nvdisasm:

    PYTHONPATH=. python3 scripts/sass_at.py backward_wgmma_fused/f16/d192/s64wg2c1 0xd0b0 [--arch sm_90a] [--context 40]

The first argument is a variant URI (`python -m cuattn compile --help` lists them) matched
exactly; the SASS lines from --context instructions before the offset to a few after, with the
source lines nvdisasm attributes to them, are printed. Run it on the machine whose NVRTC built
the kernel that was reported (offsets differ between compiler versions).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from cupy.cuda import nvrtc

from cuattn import kernels, loader

parser = argparse.ArgumentParser()
parser.add_argument("uri")
parser.add_argument("offset", type=lambda s: int(s, 16))
parser.add_argument("--arch", default="sm_90a")
parser.add_argument("--context", type=int, default=40)
args = parser.parse_args()

(variant,) = [v for v in kernels.all_variants(args.arch) if v.uri == args.uri] or sys.exit(f"no variant {args.uri} for {args.arch}")
nvdisasm = shutil.which("nvdisasm") or next((p for p in ("/usr/local/cuda/bin/nvdisasm",) if os.path.exists(p)), None)
if nvdisasm is None:
    sys.exit("nvdisasm not found (the CUDA toolkit's bin/)")

prog = nvrtc.createProgram(loader.translation_unit(variant.source), f"cuattn_{variant.kernel}_unit.cu", [], [])
try:
    nvrtc.addNameExpression(prog, variant.expression)
    nvrtc.compileProgram(prog, list(loader.compile_options(args.arch)) + ["-lineinfo"])
    cubin = nvrtc.getCUBIN(prog)
finally:
    nvrtc.destroyProgram(prog)

with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    sass = subprocess.run([nvdisasm, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout.splitlines()

at = [i for i, line in enumerate(sass) if re.search(rf"/\*{args.offset:04x}\*/", line)]
if not at:
    sys.exit(f"no instruction at 0x{args.offset:x} ({len(sass)} lines of SASS)")
instructions = 0
start = at[0]
while start > 0 and instructions < args.context:  # back over --context instructions, keeping their line-info comments
    start -= 1
    instructions += bool(re.search(r"/\*[0-9a-f]{4,}\*/", sass[start]))
print("\n".join(line for line in sass[start:at[0] + 4] if line.strip()))
