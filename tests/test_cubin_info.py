"""flashcore.compiler.cubin_info against cubins from the CuTe DSL and from ptxas.

The attribute ids, register counts, frame and shared sizes read here were also compared once with
the CUDA driver's own numbers (cuFuncGetAttribute, cuOccupancyMaxActiveBlocksPerMultiprocessor) on
an H100; those tests need a GPU, these do not.
"""

from __future__ import annotations

import dataclasses
import io
import re
import struct
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from flashcore.compiler import cubin_info
from flashcore.compiler.artifact import Resources
from flashcore.compiler.cubin_info import (
    EIAttr,
    EIFormat,
    occupancy,
    parse_nv_info,
    ptxas_stats,
    read_nv_info,
    read_resources,
)
from flashcore.compiler.ptx_info import parse_entry
from tests.kernels import assemble, find_nvdisasm, have_ptxas


def _ptxas_report(report: str) -> dict[str, int]:
    regs = re.search(r"Used (\d+) registers", report)
    frame = re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report
    )
    smem = re.search(r"(\d+) bytes smem", report)
    assert regs and frame
    return {
        "registers": int(regs.group(1)),
        "stack": int(frame.group(1)),
        "stores": int(frame.group(2)),
        "loads": int(frame.group(3)),
        "smem": int(smem.group(1)) if smem else 0,
    }


# -- the DSL's cubin ---------------------------------------------------------------------------
def test_dsl_kernel_resources(dsl_kernel):
    entry, _ = parse_entry(dsl_kernel.ptx)
    r = read_resources(dsl_kernel.cubin, entry, ptx=dsl_kernel.ptx, arch="sm_90", smem_dynamic=4096)
    assert 0 < r.registers <= 255
    assert r.stack_frame_bytes == 0
    assert r.smem_static_bytes == 0
    assert r.smem_dynamic_bytes == 4096
    assert r.threads_per_block == 128
    if have_ptxas():
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0)
        # ptxas on PATH, assembling the same PTX, reports the same registers as the cubin says
        stats = ptxas_stats(dsl_kernel.ptx, "sm_90")
        assert stats is not None and stats.registers == r.registers


def test_block_size_from_cubin_without_ptx(dsl_kernel):
    entry, _ = parse_entry(dsl_kernel.ptx)
    r = read_resources(dsl_kernel.cubin, entry)
    assert r.threads_per_block == 128  # EIATTR_REQNTID
    assert r.spill_store_bytes is None and r.spill_load_bytes is None


def test_spills_none_without_ptxas(dsl_kernel, monkeypatch):
    monkeypatch.setattr(cubin_info.shutil, "which", lambda name: None)
    entry, _ = parse_entry(dsl_kernel.ptx)
    r = read_resources(dsl_kernel.cubin, entry, ptx=dsl_kernel.ptx, arch="sm_90")
    assert r.spill_store_bytes is None and r.spill_load_bytes is None


def test_unknown_entry_and_garbage(dsl_kernel):
    with pytest.raises(ValueError, match="no kernel 'nope'.*kernel_cutlass_k"):
        read_resources(dsl_kernel.cubin, "nope")
    with pytest.raises(ValueError, match="not a cubin"):
        read_resources(b"\x7fELF garbage" * 10, "k")
    with pytest.raises(ValueError, match="not a cubin"):
        read_resources(b"", "k")


# -- hand-written PTX with spills, a stack frame and static shared memory ----------------------
def test_handwritten_kernel_matches_ptxas(spilly_kernel):
    kernel, report = spilly_kernel
    want = _ptxas_report(report)
    assert want["stores"] > 0 and want["stack"] > 0  # the PTX does what it is meant to
    r = read_resources(kernel.cubin, "spilly", ptx=kernel.ptx, arch="sm_90")
    assert r.registers == want["registers"]
    assert r.stack_frame_bytes == want["stack"]
    assert (r.spill_store_bytes, r.spill_load_bytes) == (want["stores"], want["loads"])
    assert r.smem_static_bytes == want["smem"] == 1536
    assert r.threads_per_block == 64


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_static_smem_other_archs(arch, tmp_path):
    # sm_90 cubins put the system's reserved 1 KB at the start of the kernel's shared section;
    # earlier archs do not. Either way the kernel's own static shared memory is reported.
    if not have_ptxas():
        pytest.skip("ptxas is not on PATH")
    from tests.kernels import handwritten_ptx

    ptx = handwritten_ptx().replace(".target sm_90", f".target {arch}")
    cubin, report = assemble(ptx, tmp_path, arch)
    assert read_resources(cubin, "spilly").smem_static_bytes == _ptxas_report(report)["smem"]


def test_nv_info_record_ids_match_nvdisasm(dsl_kernel, spilly_kernel, tmp_path):
    """Our record splitting and attribute names agree with what nvdisasm prints."""
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    for i, cubin in enumerate((dsl_kernel.cubin, spilly_kernel[0].cubin)):
        path = tmp_path / f"{i}.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run(
            [nvdisasm, str(path)], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        theirs = re.findall(
            r"nvinfo : (EIATTR_\w+)\s*\n\s*\.align\s+4\s*\n(?:\.L_\d+:\s*\n)?"
            r"\s*/\*[0-9a-f]+\*/\s*\.byte\s+0x([0-9a-f]{2}), 0x([0-9a-f]{2})",
            listing,
        )
        ours = [r for records in read_nv_info(cubin).values() for r in records]
        assert len(theirs) == len(ours) > 0
        for (name, fmt, attr), r in zip(theirs, ours):
            assert (int(fmt, 16), int(attr, 16)) == (r.fmt, r.attr)
            if r.attr in set(EIAttr):
                assert name == f"EIATTR_{EIAttr(r.attr).name}"


# -- registers: the text section's sh_info, EIATTR_REGCOUNT ------------------------------------
def _patched(cubin: bytes, entry: str, *, sh_info_regs: int, drop_regcount: bool) -> bytes:
    elf = ELFFile(io.BytesIO(cubin))
    data = bytearray(cubin)
    for i, s in enumerate(elf.iter_sections()):
        off = elf["e_shoff"] + i * elf["e_shentsize"]
        if s.name == f".text.{entry}":
            (info,) = struct.unpack_from("<I", data, off + 44)  # Elf64_Shdr.sh_info
            struct.pack_into("<I", data, off + 44, (info & 0xFFFFFF) | (sh_info_regs << 24))
        if s.name == ".nv.info" and drop_regcount:
            pos = s["sh_offset"]
            for r in parse_nv_info(s.data()):
                if r.attr == EIAttr.REGCOUNT:
                    data[pos + 1] = 0x7E  # an id nobody reads
                pos += 4 + len(r.payload)  # module-wide records are all SVAL words
    return bytes(data)


def test_registers_from_sh_info_when_no_regcount(dsl_kernel):
    entry, _ = parse_entry(dsl_kernel.ptx)
    real = read_resources(dsl_kernel.cubin, entry).registers
    cubin = _patched(dsl_kernel.cubin, entry, sh_info_regs=real, drop_regcount=True)
    assert read_resources(cubin, entry).registers == real
    with pytest.raises(ValueError, match="no register count"):
        read_resources(_patched(cubin, entry, sh_info_regs=0, drop_regcount=True), entry)


def test_registers_cross_checked(dsl_kernel):
    entry, _ = parse_entry(dsl_kernel.ptx)
    real = read_resources(dsl_kernel.cubin, entry).registers
    agree = _patched(dsl_kernel.cubin, entry, sh_info_regs=real, drop_regcount=False)
    assert read_resources(agree, entry).registers == real
    disagree = _patched(dsl_kernel.cubin, entry, sh_info_regs=real + 1, drop_regcount=False)
    with pytest.raises(ValueError, match="disagrees"):
        read_resources(disagree, entry)


# -- record parsing --------------------------------------------------------------------------------
def test_parse_every_format_with_padding():
    data = (
        bytes([EIFormat.NVAL, 0x01, 0, 0])  # NVAL: header only, padded
        + bytes([EIFormat.BVAL, EIAttr.NUM_BARRIERS, 3, 0])  # BVAL: 1 byte, padded
        + bytes([EIFormat.HVAL, EIAttr.MAXREG_COUNT])
        + struct.pack("<H", 255)
        + bytes([EIFormat.SVAL, EIAttr.REGCOUNT])
        + struct.pack("<HII", 8, 6, 40)
        + bytes([EIFormat.SVAL, 0x99])
        + struct.pack("<H", 2)
        + b"\xaa\xbb\x00\x00"
    )
    recs = parse_nv_info(data)
    assert [(r.fmt, r.attr, r.payload) for r in recs] == [
        (1, 0x01, b""),
        (2, 0x4C, b"\x03"),
        (3, 0x1B, b"\xff\x00"),
        (4, 0x2F, struct.pack("<II", 6, 40)),
        (4, 0x99, b"\xaa\xbb"),
    ]
    assert recs[3].words() == (6, 40) and recs[3].name == "REGCOUNT" and recs[4].name == "0x99"


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\x04", "header cut off"),
        (b"\x04\x2f\x08", "length .* cut off"),
        (b"\x04\x2f\x08\x00\x01\x02", "runs past"),
        (b"\x07\x2f\x00\x00", "unknown record format 0x07"),
    ],
)
def test_parse_errors(data, match):
    with pytest.raises(ValueError, match=match):
        parse_nv_info(data)


# -- occupancy -------------------------------------------------------------------------------------
def _res(regs: int, threads: int, dyn: int = 0, static: int = 0) -> Resources:
    return Resources(regs, 0, None, None, static, dyn, threads)


@pytest.mark.parametrize(
    "res, arch, ctas, limited_by",
    [
        # (cases checked against cuOccupancyMaxActiveBlocksPerMultiprocessor on an H100)
        (_res(12, 128), "sm_90", 16, "threads"),
        (_res(12, 128, dyn=40000), "sm_90", 5, "shared_memory"),
        (_res(135, 128, dyn=24576), "sm_90", 3, "registers"),
        (_res(237, 256, dyn=98304), "sm_90", 1, "registers"),
        (_res(8, 32), "sm_90", 32, "ctas"),
        (_res(8, 96), "sm_90", 21, "threads"),
        (_res(24, 64, dyn=20000, static=1536), "sm_90", 10, "shared_memory"),
        # (cases worked by hand)
        (_res(8, 32), "sm_89", 24, "ctas"),  # sm_89: 24 CTAs, 48 warps
        (_res(32, 512), "sm_89", 3, "threads"),
        (_res(64, 256, dyn=96 * 1024), "sm_89", 1, "shared_memory"),  # 97 KB of 100 KB
        (_res(255, 256), "sm_80", 1, "registers"),  # 8192 regs/warp -> 8 warps
        (_res(255, 1024), "sm_80", 0, "registers"),  # does not fit at all
        (_res(40, 128, dyn=40 * 1024), "sm_80", 4, "shared_memory"),  # 164 KB // 41 KB
    ],
)
def test_occupancy(res, arch, ctas, limited_by):
    occ = occupancy(res, arch)
    assert (occ["ctas_per_sm"], occ["limited_by"]) == (ctas, limited_by)
    assert occ["warps_per_sm"] == ctas * occ["warps_per_cta"]
    assert occ["limits"][limited_by] == ctas == min(occ["limits"].values())
    assert 0 <= occ["occupancy"] <= 1


def test_occupancy_bad_input():
    assert occupancy(_res(32, 128), "sm_90a")["arch"] == "sm_90"
    with pytest.raises(ValueError, match="sm_75"):
        occupancy(_res(32, 128), "sm_75")
    with pytest.raises(ValueError, match="block size"):
        occupancy(dataclasses.replace(_res(32, 128), threads_per_block=0), "sm_90")


def test_ptxas_report_keeps_its_performance_losses_per_entry():
    """ptxas's "Potential Performance Loss" notes (as wgmma serialised for want of registers,
    which made the FP8 Hopper kernels 1.3x slower once) are read for the entry they name."""
    report = """ptxas info    : Compiling entry function 'a' for 'sm_90a'
ptxas info    : Function properties for a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized \
due to insufficient register resources for the wgmma pipeline in the function 'a'
ptxas info    : Compiling entry function 'b' for 'sm_90a'
ptxas info    : Function properties for b
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 40 registers
"""
    a = cubin_info._parse_ptxas_report(report, "a")
    b = cubin_info._parse_ptxas_report(report, "b")
    assert a is not None and b is not None
    assert a.registers == 168 and len(a.performance_losses) == 1
    assert a.performance_losses[0].startswith("wgmma.mma_async instructions are serialized")
    assert b.performance_losses == () and b.spill_store_bytes == 8
