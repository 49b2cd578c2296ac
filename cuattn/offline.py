"""Compile kernel variants without a GPU and report their resources.

Uses the same NVRTC and options as the run-time loader, asks ptxas for its report
(``-Xptxas=-v``) and parses registers, spills, stack frame and static shared memory; each
variant's static plus dynamic shared memory is checked against the target's per-block limit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re

from cuattn import loader
from cuattn.kernels import all_variants
from cuattn.kernels.variant import Variant, arch_smem_limit

# sm_86 stands for the 99 KB shared-memory parts (sm_86 / sm_89 / sm_120), which get their own
# backward tiles.
DEFAULT_ARCHS = ("sm_80", "sm_86", "sm_90a")


@dataclasses.dataclass
class CompileReport:
    uri: str
    arch: str
    hot: bool
    ok: bool
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack_bytes: int = -1
    static_smem: int = 0
    dynamic_smem: int = 0  # what every launch passes
    smem_limit: int = 0  # the target's opt-in shared memory per block
    # ptxas made every wgmma wait for the one before: too few registers (C7512), or an
    # arrive / wait in a branch it cannot prove warpgroup-uniform, or accumulators read while in
    # flight (C7514, C7518, C7519, ...): every such message says "are serialized".
    wgmma_serialized: bool = False
    seconds: float = 0.0
    log: str = ""

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def over_smem(self) -> bool:
        return self.static_smem + self.dynamic_smem > self.smem_limit

    @property
    def failure(self) -> str:
        """Why the variant fails the gate ("" where it passes): a compile error, more shared
        memory than the target has per block, or a serialized wgmma or a spill in a kernel
        marked hot."""
        if not self.ok:
            return "failed to compile"
        if self.over_smem:
            return f"needs {self.static_smem + self.dynamic_smem} bytes of shared memory, over the target's {self.smem_limit}"
        if self.hot and self.wgmma_serialized:
            return "serializes its wgmma instructions (hot kernel)"
        if self.hot and self.spills:
            return "spills registers (hot kernel)"
        return ""

    @property
    def failed(self) -> bool:
        return bool(self.failure)


def _parse(report: CompileReport, log: str) -> None:
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        report.stack_bytes, report.spill_stores, report.spill_loads = map(int, m.groups())
    if m := re.search(r"Used (\d+) registers", log):
        report.registers = int(m.group(1))
    if m := re.search(r"(\d+) bytes smem", log):
        report.static_smem = int(m.group(1))
    report.wgmma_serialized = "wgmma.mma_async instructions are serialized" in log


def compile_variant(variant: Variant, arch: str) -> CompileReport:
    """Compile one variant to a cubin for ``arch``; never raises on a compile error."""
    import time

    from cupy.cuda import nvrtc

    report = CompileReport(variant.uri, arch, variant.hot, ok=False, dynamic_smem=variant.dynamic_smem, smem_limit=arch_smem_limit(arch))
    start = time.perf_counter()
    prog = nvrtc.createProgram(loader.translation_unit(variant.source), f"cuattn_{variant.kernel}_unit.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, variant.expression)
        try:
            nvrtc.compileProgram(prog, list(loader.compile_options(arch)) + ["-Xptxas=-v"])
            report.ok = len(nvrtc.getCUBIN(prog)) > 0
        except nvrtc.NVRTCError:
            pass
        report.log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    report.seconds = time.perf_counter() - start
    _parse(report, report.log)
    return report


def compile_all(archs=DEFAULT_ARCHS, variants=None, jobs: int = 2) -> list[CompileReport]:
    """``variants``: None for every variant as tiled for each target, a function of the target
    giving the list, or one list for all targets."""
    pick = all_variants if variants is None else variants if callable(variants) else (lambda arch: variants)
    tasks = [(v, a) for a in archs for v in pick(a) if v.builds_for(a)]
    if not tasks:
        return []
    # The first compile runs alone: NVRTC loads its builtins library lazily, and concurrent
    # first calls were seen to fail to open it.
    first = compile_variant(*tasks[0])
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return [first] + list(pool.map(lambda t: compile_variant(*t), tasks[1:]))


def format_table(reports: list[CompileReport]) -> str:
    rows = [f"{'variant':<48} {'arch':<7} {'regs':>4} {'spill':>6} {'stack':>5} {'smem':>6} {'dsmem':>6} {'s':>5}  status"]
    for r in reports:
        status = ("ERROR" if not r.ok else "SMEM>LIMIT" if r.over_smem else
                  "SERIAL(hot)" if r.failed and r.wgmma_serialized else
                  "SPILL(hot)" if r.failed else ("spill" if r.spills else "ok"))
        rows.append(
            f"{r.uri:<48} {r.arch:<7} {r.registers:>4} {r.spill_stores + r.spill_loads:>6} "
            f"{r.stack_bytes:>5} {r.static_smem:>6} {r.dynamic_smem:>6} {r.seconds:>5.1f}  {status}"
        )
    return "\n".join(rows)
