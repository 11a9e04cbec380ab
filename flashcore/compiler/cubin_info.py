"""Read a kernel's resource usage from its cubin (an ELF), and estimate occupancy from it.

The per-kernel facts live in ``.nv.info`` sections: a sequence of records, each a format byte, an
attribute id byte, then a payload whose shape the format gives (none, 1 byte, a 2-byte value, or a
2-byte length and that many bytes), padded with zeros to a multiple of 4 bytes. Attribute ids and
the padding were checked against what ``nvdisasm`` prints for these sections (CUDA 13). Kernel-wide counts that the linker may rewrite (registers,
frame size) sit in the module-wide ``.nv.info``, keyed by the kernel's symbol index.
"""

from __future__ import annotations

import io
import math
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from ..specs import SMEM_PER_SM
from .artifact import Resources
from .ptx_info import parse_reqntid, ptx_target


class EIFormat(IntEnum):
    NVAL = 0x01  # no payload
    BVAL = 0x02  # 1-byte payload
    HVAL = 0x03  # 2-byte payload
    SVAL = 0x04  # 2-byte length, then that many bytes


class EIAttr(IntEnum):
    """The ``.nv.info`` attribute ids flashcore reads or has seen in DSL cubins."""

    MAX_THREADS = 0x05  # .maxntid x, y, z
    PARAM_CBANK = 0x0A
    REQNTID = 0x10  # .reqntid x, y, z
    FRAME_SIZE = 0x11  # symbol index, bytes of stack frame
    MIN_STACK_SIZE = 0x12
    KPARAM_INFO = 0x17
    CBANK_PARAM_SIZE = 0x19
    MAXREG_COUNT = 0x1B
    EXIT_INSTR_OFFSETS = 0x1C
    MAX_STACK_SIZE = 0x23
    REGCOUNT = 0x2F  # symbol index, registers per thread
    CUDA_API_VERSION = 0x37
    NUM_BARRIERS = 0x4C
    SPARSE_MMA_MASK = 0x50
    ANNOTATIONS = 0x55


@dataclass(frozen=True)
class NvInfoRecord:
    fmt: int
    attr: int
    payload: bytes

    def words(self) -> tuple[int, ...]:
        """The payload as little-endian u32s (SVAL payloads are whole words)."""
        n = len(self.payload) // 4
        return struct.unpack_from(f"<{n}I", self.payload)

    @property
    def name(self) -> str:
        try:
            return EIAttr(self.attr).name
        except ValueError:
            return f"0x{self.attr:02x}"


def parse_nv_info(data: bytes) -> list[NvInfoRecord]:
    """Split one ``.nv.info*`` section into records; ValueError if it does not parse."""
    records, pos = [], 0
    while pos < len(data):
        if pos + 2 > len(data):
            raise ValueError(f".nv.info: record header cut off at byte {pos}")
        fmt, attr = data[pos], data[pos + 1]
        pos += 2
        if fmt == EIFormat.NVAL:
            n = 0
        elif fmt == EIFormat.BVAL:
            n = 1
        elif fmt == EIFormat.HVAL:
            n = 2
        elif fmt == EIFormat.SVAL:
            if pos + 2 > len(data):
                raise ValueError(f".nv.info: length of attribute 0x{attr:02x} cut off")
            (n,) = struct.unpack_from("<H", data, pos)
            pos += 2
        else:
            raise ValueError(f".nv.info: unknown record format 0x{fmt:02x} at byte {pos - 2}")
        if pos + n > len(data):
            raise ValueError(f".nv.info: attribute 0x{attr:02x} runs past the section's end")
        records.append(NvInfoRecord(fmt, attr, bytes(data[pos : pos + n])))
        pos = _ceil_to(pos + n, 4)  # every record starts 4-byte aligned (a BVAL has 1 pad byte)
    return records


def read_nv_info(cubin: bytes) -> dict[str, list[NvInfoRecord]]:
    """Every ``.nv.info*`` section of a cubin, by section name (for inspection and tests)."""
    elf = _elf(cubin)
    return {
        s.name: parse_nv_info(s.data())
        for s in elf.iter_sections()
        if s.name == ".nv.info" or s.name.startswith(".nv.info.")
    }


# -- resources -------------------------------------------------------------------------------------
_RESERVED_SMEM = 1024
_RESERVED_SMEM_SYMBOL = ".nv.reservedSmem.offset0"


@dataclass(frozen=True)
class PtxasStats:
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    # ptxas's "Potential Performance Loss" notes (as wgmma serialised for want of registers)
    performance_losses: tuple[str, ...] = ()


def read_resources(
    cubin: bytes,
    entry: str,
    *,
    ptx: str | None = None,
    arch: str | None = None,
    smem_dynamic: int = 0,
) -> Resources:
    """Registers, stack, shared memory and block size of kernel ``entry`` in ``cubin``.

    Spill bytes are not recorded in a cubin; they come from re-assembling ``ptx`` with the
    ``ptxas`` on PATH (when there is one and ``ptx`` and ``arch`` are given), else None. That
    ptxas may not be the one the DSL used, so treat them as an estimate.
    """
    elf = _elf(cubin)
    text = elf.get_section_by_name(f".text.{entry}")
    if text is None:
        kernels = [s.name[6:] for s in elf.iter_sections() if s.name.startswith(".text.")]
        raise ValueError(f"cubin has no kernel {entry!r}; it has {kernels}")
    sym = _symbol_index(elf, entry)
    attrs = _kernel_attrs(elf, entry, sym)

    registers = _registers(entry, text.header.sh_info >> 24, attrs.get(EIAttr.REGCOUNT))
    frame = attrs.get(EIAttr.FRAME_SIZE)
    stats = ptxas_stats(ptx, arch, entry) if ptx is not None and arch is not None else None
    return Resources(
        registers=registers,
        stack_frame_bytes=frame[-1] if frame else 0,
        spill_store_bytes=stats.spill_store_bytes if stats else None,
        spill_load_bytes=stats.spill_load_bytes if stats else None,
        smem_static_bytes=_static_smem(elf, entry),
        smem_dynamic_bytes=smem_dynamic,
        threads_per_block=_threads(ptx, attrs),
    )


def _elf(cubin: bytes) -> ELFFile:
    try:
        elf = ELFFile(io.BytesIO(cubin))
        elf.num_sections()
    except (ELFError, struct.error) as e:
        raise ValueError(f"not a cubin (ELF parse failed: {e})") from None
    return elf


def _symbol_index(elf: ELFFile, entry: str) -> int | None:
    symtab = elf.get_section_by_name(".symtab")
    if symtab is None:
        return None
    for i, s in enumerate(symtab.iter_symbols()):
        if s.name == entry and s["st_info"]["type"] == "STT_FUNC":
            return i
    return None


def _kernel_attrs(elf: ELFFile, entry: str, sym: int | None) -> dict[int, tuple[int, ...]]:
    """Attribute id -> payload words for ``entry``, from the module-wide and per-kernel sections."""
    out: dict[int, tuple[int, ...]] = {}
    module = elf.get_section_by_name(".nv.info")
    if module is not None:
        for r in parse_nv_info(module.data()):
            w = r.words() if r.fmt == EIFormat.SVAL else ()
            if len(w) >= 2 and w[0] == sym:  # module-wide records name their kernel first
                out[r.attr] = w[1:]
    own = elf.get_section_by_name(f".nv.info.{entry}")
    if own is not None:
        for r in parse_nv_info(own.data()):
            if r.fmt == EIFormat.SVAL:
                w = r.words()
                if r.attr in (EIAttr.REGCOUNT, EIAttr.FRAME_SIZE) and len(w) == 2:
                    w = w[1:]  # keyed like the module-wide form
                out.setdefault(r.attr, w)
            elif r.fmt == EIFormat.HVAL:
                out.setdefault(r.attr, struct.unpack("<H", r.payload))
            elif r.fmt == EIFormat.BVAL:
                out.setdefault(r.attr, (r.payload[0],))
    return out


def _static_smem(elf: ELFFile, entry: str) -> int:
    shared = elf.get_section_by_name(f".nv.shared.{entry}")
    if shared is None:
        return 0
    size = shared.header.sh_size
    # sm_90 cubins that use shared memory start the kernel's section with the 1 KB the system
    # reserves per CTA (user data sits at 0x400); they say so with a reserved-smem symbol. That
    # KB is not the kernel's own: ptxas -v leaves it out, and occupancy() adds it for every arch.
    if size >= _RESERVED_SMEM and _has_symbol(elf, _RESERVED_SMEM_SYMBOL):
        size -= _RESERVED_SMEM
    return size


def _has_symbol(elf: ELFFile, name: str) -> bool:
    symtab = elf.get_section_by_name(".symtab")
    return symtab is not None and any(s.name == name for s in symtab.iter_symbols())


def _registers(entry: str, from_sh_info: int, attr: tuple[int, ...] | None) -> int:
    # Older cubins keep the count in the text section's sh_info high byte; newer ones (as the
    # DSL's) leave it 0 there and only carry EIATTR_REGCOUNT. Where both exist they must agree.
    from_attr = attr[0] if attr else None
    if from_attr is not None and from_sh_info and from_attr != from_sh_info:
        raise ValueError(
            f"cubin disagrees with itself on {entry}'s registers: EIATTR_REGCOUNT says "
            f"{from_attr}, the text section's sh_info says {from_sh_info}"
        )
    regs = from_attr if from_attr is not None else from_sh_info
    if not regs:
        raise ValueError(f"cubin records no register count for {entry}")
    return regs


def _threads(ptx: str | None, attrs: dict[int, tuple[int, ...]]) -> int:
    if ptx is not None:
        req = parse_reqntid(ptx)
        if req is not None:
            return math.prod(req)
    for attr in (EIAttr.REQNTID, EIAttr.MAX_THREADS):  # .maxntid is only an upper bound
        dims = attrs.get(attr)
        if dims:
            return math.prod(dims)
    return 0


_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_LOSS = re.compile(r"Potential Performance Loss: (.*?) in the function '([^']+)'")


def ptxas_stats(ptx: str, arch: str, entry: str | None = None) -> PtxasStats | None:
    """Assemble ``ptx`` with ``ptxas -v`` and read its report for ``entry`` (default: the only
    entry it compiles). None when ptxas is missing, fails, or reports nothing for the entry."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    target = ptx_target(ptx)
    # a PTX for sm_90a cannot be assembled as plain sm_90: keep the suffix the PTX asks for
    arch = target if target.startswith(arch) else arch
    with tempfile.TemporaryDirectory(prefix="flashcore-ptxas-") as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        try:
            proc = subprocess.run(
                [exe, f"-arch={arch}", "-v", "-o", str(out), str(src)],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
    if proc.returncode != 0:
        return None
    return _parse_ptxas_report(proc.stdout + proc.stderr, entry)


def _parse_ptxas_report(report: str, entry: str | None) -> PtxasStats | None:
    frames: dict[str, tuple[int, int, int]] = {}
    regs: dict[str, int] = {}
    losses: dict[str, list[str]] = {}
    current = compiling = None
    for line in report.splitlines():
        if m := _PTXAS_LOSS.search(line):
            losses.setdefault(m.group(2), []).append(m.group(1))
        elif m := _PTXAS_ENTRY.search(line):
            compiling = m.group(1)
        elif m := _PTXAS_FUNC.search(line):
            current = m.group(1)
        elif (m := _PTXAS_FRAME.search(line)) and current is not None:
            frames[current] = tuple(int(g) for g in m.groups())  # type: ignore[assignment]
        elif (m := _PTXAS_REGS.search(line)) and compiling is not None:
            regs.setdefault(compiling, int(m.group(1)))
    if entry is None:
        if len(regs) != 1:
            return None
        entry = next(iter(regs))
    if entry not in frames or entry not in regs:
        return None
    stack, stores, loads = frames[entry]
    return PtxasStats(regs[entry], stack, stores, loads, tuple(losses.get(entry, ())))


# -- occupancy -------------------------------------------------------------------------------------
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are handed to warps in blocks of 256
SMEM_ALLOC_UNIT = 128
SMEM_RESERVED_PER_CTA = 1024  # the driver keeps 1 KB of shared memory per CTA (sm_80 onwards)
MAX_THREADS_PER_SM = {"sm_80": 2048, "sm_89": 1536, "sm_90": 2048}
MAX_CTAS_PER_SM = {"sm_80": 32, "sm_89": 24, "sm_90": 32}


def _ceil_to(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def occupancy(resources: Resources, arch: str) -> dict[str, Any]:
    """Theoretical CTAs and warps per SM, each resource's limit, and which limit binds.

    ``limited_by`` names the smallest limit (ties go to registers, then shared memory, then
    threads, then the CTA cap). ``ctas_per_sm`` is 0 when one CTA does not fit at all.
    """
    base = arch[:-1] if arch[-1:] in ("a", "f") else arch  # sm_90a runs as sm_90
    if base not in MAX_THREADS_PER_SM:
        raise ValueError(f"no occupancy data for {arch!r}; known: {sorted(MAX_THREADS_PER_SM)}")
    if resources.threads_per_block <= 0:
        raise ValueError("occupancy needs a fixed block size (threads_per_block is 0)")
    warps = -(-resources.threads_per_block // 32)
    max_warps = MAX_THREADS_PER_SM[base] // 32

    regs_per_warp = _ceil_to(resources.registers * 32, REG_ALLOC_UNIT)
    by_regs = (REGS_PER_SM // regs_per_warp) // warps if regs_per_warp else MAX_CTAS_PER_SM[base]
    smem = resources.smem_static_bytes + resources.smem_dynamic_bytes
    smem_per_cta = _ceil_to(smem, SMEM_ALLOC_UNIT) + SMEM_RESERVED_PER_CTA
    limits = {
        "registers": by_regs,
        "shared_memory": SMEM_PER_SM[base] // smem_per_cta,
        "threads": max_warps // warps,
        "ctas": MAX_CTAS_PER_SM[base],
    }
    limited_by = min(limits, key=limits.__getitem__)  # first smallest, in the order above
    ctas = limits[limited_by]
    return {
        "arch": base,
        "threads_per_block": resources.threads_per_block,
        "warps_per_cta": warps,
        "registers_per_warp": regs_per_warp,
        "smem_per_cta": smem_per_cta,
        "ctas_per_sm": ctas,
        "warps_per_sm": ctas * warps,
        "max_warps_per_sm": max_warps,
        "occupancy": ctas * warps / max_warps,
        "limits": limits,
        "limited_by": limited_by,
    }
