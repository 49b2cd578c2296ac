"""Whether kernel variants compile to the same code in two source trees: prints one digest of
each (variant, arch)'s PTX, so that a change meant to leave a kernel alone (a template flag
off, a struct field appended) can be checked without a GPU (same PTX, same ptxas: same SASS).
Left out of the digest: the kernel parameter's size and the offsets of its loads (a field
appended to AttnParams changes the first, and shifts BackwardParams' fields after it), and
global constants that no code names.

    PYTHONPATH=<tree> python scripts/ptx_identity.py [uri-substring ...] > digests.txt

Run it once per tree and diff the outputs.
"""

import hashlib
import re
import sys

from cupy.cuda import nvrtc

from cuattn import kernels, loader

ARCHS = ("sm_80", "sm_90a")


def ptx(variant, arch: str) -> str:
    options = [o.replace("-arch=sm_", "-arch=compute_") for o in loader.compile_options(arch)]
    prog = nvrtc.createProgram(loader.translation_unit(variant.source), "unit.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, variant.expression)
        nvrtc.compileProgram(prog, options)
        text = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = text.decode() if isinstance(text, bytes) else text
    # The kernel's own code: comments, .global constants that no code names (static constexpr
    # members, which NVRTC declares whether or not the code reads them) and the parameter's byte
    # count left out, and mangled names (which spell every template argument, defaulted ones
    # too, and the file's hash) numbered in order of appearance.
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("//")]
    declared = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.global \.align \d+ \.\w+ (\w+)(\[\d*\])?( = .*)?;$", line))}
    named = {name for name in declared if any(name in line for j, line in enumerate(lines) if j != declared[name])}
    lines = [line for i, line in enumerate(lines) if i not in {declared[name] for name in declared.keys() - named}]
    names: dict[str, str] = {}
    lines = [re.sub(r"_Z\w+", lambda m: names.setdefault(m.group(0), f"sym{len(names)}"), line) for line in lines]
    lines = [re.sub(r"\.b8 (\w+)\[\d+\]", r".b8 \1[]", line) for line in lines]
    lines = [re.sub(r"\+-?\d+\]", "+N]", line) if "ld.param" in line else line for line in lines]
    return "\n".join(lines)


def main(patterns):
    for arch in ARCHS:
        for v in kernels.all_variants(arch):
            if v.builds_for(arch) and (not patterns or any(p in v.uri for p in patterns)) and "/dropout" not in v.uri:
                print(arch, v.uri, hashlib.sha256(ptx(v, arch).encode()).hexdigest()[:16], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
