"""Read what the launcher needs from PTX text: the entry's name and parameters, block size, ISA.

Only the small subset of PTX that the CuTe DSL emits for a kernel header is understood: one
``.entry NAME( .param ... )`` with scalar or ``.b8 NAME[N]`` (struct by value) parameters.
"""

from __future__ import annotations

import re

from .artifact import ParamInfo

# Byte size of each PTX fundamental type a parameter may have.
_TYPE_BYTES = {
    **{f".{k}{b}": b // 8 for k in "usb" for b in (8, 16, 32, 64)},
    ".b128": 16,
    ".f16": 2,
    ".bf16": 2,
    ".f32": 4,
    ".f64": 8,
    ".f16x2": 4,
    ".bf16x2": 4,
    ".pred": 1,
}

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$%][\w$%]*)")
_PARAM = re.compile(
    r"""^\.param
        (?:\s+\.align\s+(?P<align>\d+))?
        \s+(?P<type>\.[a-z0-9]+)
        (?P<attrs>(?:\s+\.ptr(?:\s+\.(?:global|shared|const|local))?(?:\s+\.align\s+\d+)?)?)
        \s+(?P<name>[A-Za-z_$%][\w$%]*)
        \s*(?:\[\s*(?P<count>\d+)\s*\])?$""",
    re.VERBOSE,
)
_REQNTID = re.compile(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_VERSION = re.compile(r"^\s*\.version\s+(\d+\.\d+)", re.MULTILINE)
_TARGET = re.compile(r"^\s*\.target\s+([^\n]+)", re.MULTILINE)


def _strip_comments(ptx: str) -> str:
    return _COMMENTS.sub(" ", ptx)


def _the_entry(ptx: str) -> tuple[str, str, str]:
    """(name, parameter list text, header text up to the body's '{') of the only entry."""
    text = _strip_comments(ptx)
    found = list(_ENTRY.finditer(text))
    if not found:
        raise ValueError("PTX has no .entry (is this a kernel's PTX?)")
    if len(found) > 1:
        names = ", ".join(m.group(1) for m in found)
        raise ValueError(f"PTX has {len(found)} .entry functions ({names}); expected exactly one")
    m = found[0]
    name, rest = m.group(1), text[m.end() :]
    body = rest.find("{")
    if body < 0:
        raise ValueError(f"PTX .entry {name} has no body")
    header = rest[:body]
    params = ""
    stripped = header.lstrip()
    if stripped.startswith("("):
        close = stripped.find(")")
        if close < 0:
            raise ValueError(f"PTX .entry {name}: unterminated parameter list")
        params = stripped[1:close]
        header = stripped[close + 1 :]
    return name, params, header


def _parse_param(decl: str, entry: str) -> ParamInfo:
    m = _PARAM.match(" ".join(decl.split()))
    if not m:
        raise ValueError(f"PTX .entry {entry}: cannot read parameter {decl.strip()!r}")
    ptx_type, name = m.group("type"), m.group("name")
    if ptx_type not in _TYPE_BYTES:
        raise ValueError(f"PTX .entry {entry}: parameter {name} has unknown type {ptx_type}")
    elem = _TYPE_BYTES[ptx_type]
    count = int(m.group("count")) if m.group("count") else 1
    # `.align` before the type aligns the parameter itself; one after `.ptr` is the pointee's.
    align = int(m.group("align")) if m.group("align") else elem
    return ParamInfo(name=name, size=elem * count, align=align, ptx_type=ptx_type)


def parse_entry(ptx: str) -> tuple[str, tuple[ParamInfo, ...]]:
    """The name and parameters (in order) of the PTX's single ``.entry``."""
    name, params, _ = _the_entry(ptx)
    decls = [d for d in params.split(",") if d.strip()]
    return name, tuple(_parse_param(d, name) for d in decls)


def parse_reqntid(ptx: str) -> tuple[int, int, int] | None:
    """The entry's ``.reqntid`` (missing dimensions are 1), or None if it has none."""
    _, _, header = _the_entry(ptx)
    m = _REQNTID.search(header)
    if not m:
        return None
    x, y, z = (int(g) if g else 1 for g in m.groups())
    return (x, y, z)


def ptx_isa_version(ptx: str) -> str:
    """The PTX ISA version from ``.version``, e.g. "8.8"."""
    m = _VERSION.search(_strip_comments(ptx))
    if not m:
        raise ValueError("PTX has no .version directive")
    return m.group(1)


def ptx_target(ptx: str) -> str:
    """The architecture from ``.target``, e.g. "sm_90" or "sm_90a" (other target flags dropped)."""
    m = _TARGET.search(_strip_comments(ptx))
    if not m:
        raise ValueError("PTX has no .target directive")
    parts = [p.strip() for p in m.group(1).split(",")]
    for p in parts:
        if p.startswith(("sm_", "compute_")):
            return p
    return parts[0]
