"""Kernel sources, compiled without a GPU: every variant for sm_80 and sm_90a, the resource
report, and the host mirrors of the parameter structs."""

import os
import re
import shutil
import subprocess

import pytest

from cuattn import kernels, loader, offline, params
from cuattn.kernels import backward, forward
from cuattn.kernels.variant import HEAD_DIM_BUCKETS, Variant


def test_source_hash_tracks_every_header(tmp_path, monkeypatch):
    """An edit to an included header changes the source string handed to CuPy's cache."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(loader.source_dir(), copy)
    monkeypatch.setattr(loader, "source_dir", lambda: copy)
    loader.source_hash.cache_clear()
    before = loader.translation_unit("merge/merge.cu")
    (copy / "common" / "dtypes.cuh").write_text((copy / "common" / "dtypes.cuh").read_text() + "\n// edit\n")
    loader.source_hash.cache_clear()
    after = loader.translation_unit("merge/merge.cu")
    loader.source_hash.cache_clear()
    assert before != after


_GENERIC_LAMBDA = re.compile(r"\[[^\[\]]*\]\s*\(([^()]*\bauto\b[^()]*)\)")


def test_device_code_has_no_generic_lambdas():
    """NVRTC 12.x and 13.0 / 13.1 refuse generic lambdas in device code ("A function without
    execution space annotations ... is considered a host function"); 13.2+ accept them, so
    only an older NVRTC (the cu12 extra) would find one."""
    found = [
        f"{path.relative_to(loader.source_dir())}: {match.group(0)}"
        for path in sorted(loader.source_dir().rglob("*.cu*"))
        for match in _GENERIC_LAMBDA.finditer(path.read_text())
    ]
    assert not found, found


def test_arch_selection():
    assert loader.arch_for(90) == "sm_90a"
    assert loader.arch_for("80") == "sm_80"
    assert loader.arch_for(89) == "sm_89"
    with pytest.raises(RuntimeError, match="8.0"):
        loader.arch_for(75)


def _contract_errors(source: str, contract) -> str | None:
    """NVRTC's log when a static_assert of ``contract`` fails against ``source``, else None."""
    from cupy.cuda import nvrtc

    checks = [f'static_assert({expr} == {value}, "{source}: {expr} != {value}");' for expr, value in sorted(contract)]
    prog = nvrtc.createProgram(loader.translation_unit(source) + "\n".join(checks) + "\n", "contract.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(loader.compile_options("sm_90a")) + ["-fdevice-syntax-only"])
        return None
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.offline
def test_launch_plans_agree_with_the_kernel_sources():
    """Every constant a launch plan shares with its kernel's source (shared memory, threads,
    rows per CTA, dQ accumulator tiles: Variant.contract) is static_asserted against the C++
    in one NVRTC compile per translation unit; a wrong value fails it."""
    by_source: dict[str, set] = {}
    for v in kernels.all_variants() + kernels.all_variants("sm_86"):
        by_source.setdefault(v.source, set()).update(v.contract)
    assert all(by_source.values()), [src for src, checks in by_source.items() if not checks]
    for source, contract in sorted(by_source.items()):
        errors = _contract_errors(source, contract)
        assert errors is None, errors
    expr, value = forward.variant("bf16", 128, False).contract[0]
    assert expr.endswith("::kSmemBytes") and "kSmemBytes" in _contract_errors("forward/forward.cu", [(expr, value + 16)])


def test_tile_tables_cover_the_head_dim_buckets():
    assert tuple(sorted(forward.TILES)) == HEAD_DIM_BUCKETS
    assert set(forward.WGMMA_TILES) <= set(HEAD_DIM_BUCKETS) and set(backward.WGMMA_FUSED_TILES) <= set(HEAD_DIM_BUCKETS)


def test_variant_uris_are_unique():
    all_v = kernels.all_variants()
    assert len({v.uri for v in all_v}) == len(all_v)
    assert len({v.expression for v in all_v}) == len(all_v)
    assert set(kernels.common_variants()) <= set(all_v)
    assert all((loader.source_dir() / v.source).is_file() for v in all_v)
    assert {v.family for v in all_v} == {family.FAMILY for family in kernels.FAMILIES}


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")
def test_param_struct_layouts_match_the_host_mirrors(tmp_path):
    """static_assert every field offset and struct size of params.cuh against params.py
    (host and device share struct layout; NVRTC has no offsetof)."""
    checks = ["#include <cstddef>", f'#include "{loader.source_dir() / "common" / "params.cuh"}"']
    for struct, dtype in params.C_STRUCTS.items():
        checks.append(f'static_assert(sizeof(cuattn::{struct}) == {dtype.itemsize}, "{struct} size");')
        for name, offset in params.field_offsets(dtype).items():
            checks.append(f'static_assert(offsetof(cuattn::{struct}, {name}) == {offset}, "{struct}.{name}");')
    src = tmp_path / "layout_check.cpp"
    src.write_text("\n".join(checks) + "\n")
    result = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.offline
@pytest.mark.parametrize("arch", offline.DEFAULT_ARCHS)
def test_every_variant_compiles_without_hot_spills(arch, tmp_path):
    reports = offline.compile_all((arch,), jobs=os.cpu_count() or 2)
    table = offline.format_table(reports)
    print(table)
    (tmp_path / f"compile-{arch}.txt").write_text(table)
    assert len(reports) == sum(v.builds_for(arch) for v in kernels.all_variants(arch))
    assert any(r.uri.startswith("forward_wgmma/") for r in reports) == (arch == "sm_90a")
    failed = [f"{r.uri}: {'error' if not r.ok else 'spills'}\n{r.log}" for r in reports if r.failed]
    assert not failed, "\n".join(failed)
    assert all(r.registers > 0 for r in reports)


@pytest.mark.offline
def test_compile_report_flags_errors_and_hot_spills(monkeypatch, tmp_path):
    """The CI gate can fail: a broken kernel and a spilling hot kernel are both reported failed."""
    src = tmp_path / "cuda_src"
    (src / "common").mkdir(parents=True)
    (src / "test").mkdir()
    (src / "test" / "broken.cu").write_text("__global__ void k() { this is not C++; }\n")
    (src / "test" / "spilly.cu").write_text(
        "extern \"C\" __global__ void __launch_bounds__(1024, 2) k(float* x, int n) {\n"
        "  float a[96];\n#pragma unroll\n  for (int i = 0; i < 96; ++i) a[i] = x[i * n];\n"
        "  float s = 0;\n#pragma unroll\n  for (int i = 0; i < 96; ++i) s += a[i] * a[95 - i] / (a[(i * 7) % 96] + 1);\n"
        "  x[threadIdx.x] = s; }\n"
    )
    monkeypatch.setattr(loader, "source_dir", lambda: src)
    loader.source_hash.cache_clear()
    try:
        broken = offline.compile_variant(Variant("test", "broken", "k", "test/broken", hot=True), "sm_80")
        spilly = offline.compile_variant(Variant("test", "spilly", "k", "test/spilly", hot=True), "sm_80")
    finally:
        loader.source_hash.cache_clear()
    assert not broken.ok and broken.failed
    assert spilly.ok and spilly.spills and spilly.failed, spilly.log


@pytest.mark.parametrize("log", [
    "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register"
    " resources for the wgmma pipeline\nUsed 168 registers",
    "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on"
    " compiler-inserted WG.DP in divergent path\nUsed 168 registers",
])
def test_compile_report_flags_serialized_wgmma(log):
    """ptxas serializes wgmma when registers run short (C7512) or a wait or arrive sits in a
    branch it cannot prove warpgroup-uniform (C7518, C7519): a hot kernel fails the gate."""
    report = offline.CompileReport("test/serial", "sm_90a", hot=True, ok=True)
    offline._parse(report, log)
    assert report.wgmma_serialized and report.failed and report.registers == 168
    assert report.failure == "serializes its wgmma instructions (hot kernel)"
    cold = offline.CompileReport("test/serial", "sm_90a", hot=False, ok=True)
    offline._parse(cold, log)
    assert not cold.failed and cold.failure == ""


def test_compile_report_names_why_a_variant_fails():
    """`python -m cuattn compile` prints each failed variant's own reason (it called every
    failure that compiled a spill)."""
    def report(ok=True, **fields):
        return offline.CompileReport("test/x", "sm_90a", hot=True, ok=ok, smem_limit=232448, **fields)

    assert report(ok=False).failure == "failed to compile"
    assert report(dynamic_smem=240000, static_smem=16).failure == "needs 240016 bytes of shared memory, over the target's 232448"
    assert report(spill_stores=8, spill_loads=0).failure == "spills registers (hot kernel)"
    assert report(spill_stores=0, spill_loads=0, dynamic_smem=1024).failure == ""
    assert not offline.CompileReport("test/x", "sm_90a", hot=False, ok=True, spill_stores=8, spill_loads=8, smem_limit=232448).failed


def test_forward_kernel_selection():
    select = forward.select
    assert select("bf16", 128, False, "sm_90a").kernel == "forward_wgmma"
    assert select("f16", 64, True, "sm_90a").uri.endswith("/softcap")
    assert select("bf16", 128, False, "sm_90a", allow_wgmma=False).kernel == "forward"
    assert select("bf16", 128, False, "sm_80").kernel == "forward"
    assert select("bf16", 32, False, "sm_90a").kernel == "forward"  # the portable kernel is faster there
    for bucket, tile in forward.WGMMA_WIDER.items():  # the next wider Hopper tile, its columns zero-padded
        assert select("bf16", bucket, False, "sm_90a") == forward.wgmma_variant("bf16", tile, False)
        assert select("bf16", bucket, False, "sm_80").kernel == "forward"
    assert select("float", 128, False, "sm_90a").kernel == "forward_fp32"
    assert forward.wgmma_variant("bf16", 128, False).builds_for("sm_90a")
    assert not forward.wgmma_variant("bf16", 128, False).builds_for("sm_80")


def test_backward_kernel_selection():
    fused = backward.select_fused
    assert fused("bf16", 128, False, "sm_90a").kernel == "backward_wgmma_fused"
    assert fused("f16", 64, True, "sm_90a").uri.endswith("/softcap")
    assert fused("bf16", 128, False, "sm_90a", allow_wgmma=False) is None
    assert fused("bf16", 128, False, "sm_80") is None
    # Above head_dim 128 the 192 or 256 tile, whose two warpgroups share 64 keys and split the
    # gradients' columns (128 + 64 or 128 + 128): 64 keys per CTA; at 256 no dQ stage of its own,
    # at 192 one for the 64-column share's piece.
    for bucket, tile in ((160, 192), (192, 192), (224, 256), (256, 256)):
        assert fused("bf16", bucket, False, "sm_90a") == backward.fused_variant("bf16", tile, False)
    for tile, stage in ((192, 64 * 64 * 4), (256, 0)):
        wide_variant = backward.fused_variant("bf16", tile, False)
        assert (wide_variant.block_m, wide_variant.threads) == (64, 256)
        assert (f"cuattn::WgmmaFusedTraits<{tile}, 64, 2>::kBlockResident", 64) in wide_variant.contract
        tiles = (2 * 64 + 2 * 2 * 64) * tile * 2 + 2 * 2 * 64 * 4  # K, V, the two-slot Q / dO ring, its lse / delta
        assert wide_variant.dynamic_smem == tiles + 2 * 64 * 64 * 2 + stage + 1024  # dS^T, P^T, the stage, alignment
    wide = backward.BackwardGrid("dense", 3, 200, 300, 8, 2, 192, 600, 900)
    (one_pass, tiles), = [(v, t) for v, t in backward.launches(wide, "bf16", False, "sm_90a", True, 232448, fused=True)
                          if v.kernel == "backward_wgmma_fused"]
    assert [grid for grid, _, _ in tiles] == [(5, 2, 3)]  # 300 keys in blocks of 64
    assert wide.dq_accumulator(backward.hopper_bucket(192))[0][-1] == 192
    assert wide.dq_accumulator(backward.hopper_bucket(224))[0][-1] == 256
    assert fused("float", 64, False, "sm_90a") is None
    select = backward.select
    assert select("backward_dq", "bf16", 128, False, "sm_90a").kernel == "backward_wgmma_dq"
    assert select("backward_dkdv", "bf16", 64, False, "sm_80").kernel == "backward_dkdv"
    assert not backward.fused_variant("bf16", 64, False).builds_for("sm_80")
    # Bucket 96 runs the 128 tile on Hopper (zero-padded columns), its dQ accumulator 128 wide.
    assert fused("bf16", 96, False, "sm_90a") == backward.fused_variant("bf16", 128, False)
    for kernel in ("backward_dq", "backward_dkdv"):
        assert select(kernel, "bf16", 96, False, "sm_90a") == backward.wgmma_variant(kernel, "bf16", 128, False)
        assert select(kernel, "bf16", 96, False, "sm_80").kernel == kernel
    grid = backward.BackwardGrid("dense", 1, 100, 100, 2, 2, 96, 100, 100)
    assert grid.dq_accumulator(backward.hopper_bucket(96))[0][-1] == 128


def test_small_backward_selection_and_grid():
    """backward_small serves dense 16-bit calls of at most 256 rows, head_dim <= 128, without
    sink, dropout or block mask, whose grid (query blocks + key blocks per (head, sequence))
    fits one wave; its one launch puts both roles on x and every query head on y."""
    from cuattn.kernels.backward import BackwardGrid, launches, small_serves

    def grid(batch, sq, sk, hq, hk, d, layout="dense"):
        return BackwardGrid(layout, batch, sq, sk, hq, hk, d, batch * sq, batch * sk)

    sms = lambda: 132  # noqa: E731
    assert small_serves(grid(1, 128, 128, 4, 4, 64), "bf16", False, False, False, sms)
    assert small_serves(grid(2, 256, 1, 8, 2, 128), "f16", False, False, False, sms)
    assert small_serves(grid(66, 64, 64, 1, 1, 64), "bf16", False, False, False, sms)
    assert not small_serves(grid(67, 64, 64, 1, 1, 64), "bf16", False, False, False, sms)  # 134 CTAs
    assert not small_serves(grid(1, 257, 128, 4, 4, 64), "bf16", False, False, False, sms)
    assert not small_serves(grid(1, 128, 257, 4, 4, 64), "bf16", False, False, False, sms)
    assert not small_serves(grid(1, 128, 128, 4, 4, 160), "bf16", False, False, False, sms)
    assert not small_serves(grid(1, 128, 128, 4, 4, 64), "float", False, False, False, sms)
    assert not small_serves(grid(1, 128, 128, 4, 4, 64, "packed"), "bf16", False, False, False, sms)
    assert not small_serves(grid(1, 0, 128, 4, 4, 64), "bf16", False, False, False, sms)
    for flags in ((True, False, False), (False, True, False), (False, False, True)):
        assert not small_serves(grid(1, 128, 128, 4, 4, 64), "bf16", *flags, sms)
    plan = launches(grid(3, 113, 200, 6, 2, 96), "bf16", True, "sm_90a", True, 232448, False, small=True)
    assert len(plan) == 1
    variant, ((xyz, block, batch_offset),) = plan[0]
    assert variant.kernel == "backward_small" and variant.uri.endswith("/softcap")
    assert xyz == (2 + 4, 6, 3) and block == (128, 1, 1) and batch_offset == 0
    with pytest.raises(ValueError):
        launches(grid(1, 64, 64, 1, 1, 64), "bf16", False, "sm_90a", True, 232448, True, small=True)
    # What backward_small cannot compute is refused, not launched without its feature.
    refused = [dict(sink=True), dict(dropout=True), dict(sparse=True), dict(query_splits=2)]
    for kwargs in refused:
        with pytest.raises(ValueError, match="backward_small"):
            launches(grid(1, 64, 64, 1, 1, 64), "bf16", False, "sm_90a", True, 232448, False, small=True, **kwargs)
    for g, c_type in ((grid(1, 64, 64, 1, 1, 64), "float"), (grid(1, 64, 64, 1, 1, 64, "packed"), "bf16"), (grid(1, 64, 64, 1, 1, 160), "bf16")):
        with pytest.raises(ValueError, match="backward_small"):
            launches(g, c_type, False, "sm_90a", True, 232448, False, small=True)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_backward_launch_is_a_listed_variant(arch):
    """Every kernel a backward call can launch (any head-dim bucket, layout, path and option the
    plan takes) is in the list that the offline compile and ``warmup --all`` build, so none
    first compiles inside a user's call (the dQ conversion of the zero-padded Hopper buckets
    was missing once)."""
    from cuattn.kernels.variant import SEQ_LAYOUTS, arch_smem_limit

    listed = {v.uri for v in kernels.all_variants(arch)}
    for c_type in ("f16", "bf16", "float"):
        for bucket in HEAD_DIM_BUCKETS:
            for layout in SEQ_LAYOUTS:
                grid = backward.BackwardGrid(layout, 2, 300, 333, 4, 2, bucket, 600, 666)
                for softcap in (False, True):
                    for dropout, sparse in ((False, False), (True, False)) + (((False, True),) if layout == "dense" else ()):
                        fused = backward.select_fused(c_type, bucket, softcap, arch, layout=layout, dropout=dropout, sparse=sparse) is not None
                        for one_pass in {False, fused}:
                            for variant, _ in backward.launches(grid, c_type, softcap, arch, True, arch_smem_limit(arch), fused=one_pass,
                                                                dropout=dropout, sparse=sparse):
                                assert variant.uri in listed, (variant.uri, layout, one_pass, dropout, sparse)


def test_sum_rows_stores_out_16_bytes_at_a_time():
    """sum_partials writes out, a caller's gradient (dq= / dk= / dv=) that is only 16-byte
    aligned: no 32-byte store may reach it. Eight floats were one st.global.v8 on sm_100 and
    later (two 16-byte stores on sm_80 / sm_90a, so the GPUs tested never faulted)."""
    import importlib.util
    import pathlib

    from cuattn.kernels import merge as merge_kernels

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "ptx_identity.py"
    spec = importlib.util.spec_from_file_location("ptx_identity", path)
    ptx_identity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ptx_identity)  # its ptx(variant, arch): the PTX a variant compiles to
    for c_type, out_type in (("float", "float"), ("float", "bf16"), ("bf16", "bf16")):
        v = merge_kernels.sum_variant(c_type, out_type)
        stores = set(re.findall(r"st\.global\.(v\d)\.(\w\d+)", ptx_identity.ptx(v, "sm_100")))
        assert stores and all(int(n[1:]) * int(w[1:]) <= 128 for n, w in stores), (v.uri, stores)
