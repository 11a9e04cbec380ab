"""flashcore.compiler.ptx_info against PTX emitted by the CuTe DSL and hand-written PTX."""

from __future__ import annotations

import re

import pytest

from flashcore.compiler.artifact import ParamInfo
from flashcore.compiler.ptx_info import parse_entry, parse_reqntid, ptx_isa_version, ptx_target
from tests.kernels import handwritten_ptx

HEADER = ".version 8.0\n.target sm_90\n.address_size 64\n"


def _ptx(entry_header: str) -> str:
    return HEADER + entry_header + "\n{\n\tret;\n}\n"


def test_dsl_entry(dsl_kernel):
    name, params = parse_entry(dsl_kernel.ptx)
    assert name.startswith("kernel_cutlass_k")
    assert [(p.ptx_type, p.size, p.align) for p in params] == [
        (".b8", 48, 8),
        (".b8", 48, 8),
        (".f32", 4, 4),
    ]
    assert [p.name for p in params] == [f"{name}_param_{i}" for i in range(3)]


def test_dsl_header_directives(dsl_kernel):
    assert parse_reqntid(dsl_kernel.ptx) == (128, 1, 1)
    assert re.fullmatch(r"\d+\.\d+", ptx_isa_version(dsl_kernel.ptx))
    assert ptx_target(dsl_kernel.ptx) == "sm_90"


def test_handwritten_forms():
    name, params = parse_entry(handwritten_ptx())
    assert name == "spilly"  # the ".entry" inside a comment is ignored
    assert params == (
        ParamInfo("spilly_out", 8, 8, ".u64"),
        ParamInfo("spilly_n", 4, 4, ".u32"),
        ParamInfo("spilly_scale", 4, 4, ".f32"),
        ParamInfo("spilly_blob", 24, 8, ".b8"),
    )
    assert parse_reqntid(handwritten_ptx()) == (64, 1, 1)
    assert ptx_isa_version(handwritten_ptx()) == "8.0"


@pytest.mark.parametrize(
    "decl, expected",
    [
        (".param .u64 p", ParamInfo("p", 8, 8, ".u64")),
        (".param .s32 p", ParamInfo("p", 4, 4, ".s32")),
        (".param .b16 p", ParamInfo("p", 2, 2, ".b16")),
        (".param .f64 p", ParamInfo("p", 8, 8, ".f64")),
        (".param .align 16 .b8 p[64]", ParamInfo("p", 64, 16, ".b8")),
        (".param .align 8 .b32 p[3]", ParamInfo("p", 12, 8, ".b32")),
        # the .align after .ptr is the pointee's, not the parameter's
        (".param .u64 .ptr .global .align 16 p", ParamInfo("p", 8, 8, ".u64")),
    ],
)
def test_param_forms(decl, expected):
    assert parse_entry(_ptx(f".visible .entry k(\n\t{decl}\n)")) == ("k", (expected,))


def test_no_params_and_multiline_spacing():
    assert parse_entry(_ptx(".entry k()")) == ("k", ())
    assert parse_entry(_ptx(".entry k")) == ("k", ())
    spaced = _ptx(".entry   k (\n  .param\t.align 8\n .b8   p [ 16 ] ,\n .param .u32 q\n)")
    assert parse_entry(spaced)[1] == (ParamInfo("p", 16, 8, ".b8"), ParamInfo("q", 4, 4, ".u32"))


def test_no_entry():
    with pytest.raises(ValueError, match="no .entry"):
        parse_entry(HEADER + ".visible .func f()\n{\n\tret;\n}\n")


def test_two_entries_named():
    two = _ptx(".entry a()") + _ptx(".entry b()").replace(HEADER, "")
    with pytest.raises(ValueError, match=r"2 \.entry.*\ba\b.*\bb\b"):
        parse_entry(two)


def test_bad_param():
    with pytest.raises(ValueError, match="unknown type .v4"):
        parse_entry(_ptx(".entry k(.param .v4 p)"))
    with pytest.raises(ValueError, match="cannot read parameter"):
        parse_entry(_ptx(".entry k(.param p)"))


def test_reqntid_forms():
    assert parse_reqntid(_ptx(".entry k()")) is None
    assert parse_reqntid(_ptx(".entry k()\n.reqntid 256")) == (256, 1, 1)
    assert parse_reqntid(_ptx(".entry k()\n.maxnreg 32\n.reqntid 32, 4")) == (32, 4, 1)
    assert parse_reqntid(_ptx(".entry k()\n.reqntid 8,4,2")) == (8, 4, 2)


def test_version_and_target():
    assert ptx_target(".version 7.8\n.target sm_90a, texmode_independent\n") == "sm_90a"
    assert ptx_isa_version("// .version 1.0\n.version 8.5\n") == "8.5"
    with pytest.raises(ValueError, match=".version"):
        ptx_isa_version(".target sm_90\n")
    with pytest.raises(ValueError, match=".target"):
        ptx_target(".version 8.0\n")
