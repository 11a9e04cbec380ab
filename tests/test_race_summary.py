"""scripts/race_summary.py: racecheck's reports grouped by (hazard, kernel, instructions), the
documented false patterns told from the rest, and a log that hides reports never passing."""

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "race_summary", Path(__file__).resolve().parent.parent / "scripts" / "race_summary.py")
race_summary = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = race_summary  # (its dataclasses look their module up)
spec.loader.exec_module(race_summary)

WS = "fc_attn_bwd_sm90_f16_d64_m64n128_w8_s2_hopper_0"


def report(hazard, first, second, addr="0x18400"):
    head = f"Potential {hazard} hazard detected at __shared__ {addr} in block (0,0,0) :"
    lines = [f"========= Error: {head}"]
    for kind, thread, kernel, pc in (first, second):
        lines.append(f"=========     {kind} Thread ({thread},0,0) at {kernel}+{pc}")
    return lines + ["=========     Current Value : 0, Incoming Value : ?", "========= "]


def summarise(tmp_path, capsys, *reports, summary=None):
    log = tmp_path / "race.log"
    lines = ["ok  backward (1, 2, 2, 77, 145, 64) causal=False: rel err 3.6e-04"]
    for r in reports:
        lines += r
    if summary:
        lines.append(f"========= RACECHECK SUMMARY: {summary[0]} hazards displayed ({summary[1]} "
                     "errors, 0 warnings)")
    log.write_text("\n".join(lines) + "\n")
    rc = race_summary.main(str(log))
    return rc, capsys.readouterr().out


def test_known_patterns_pass_and_are_grouped(tmp_path, capsys):
    ws = [report("WAR", ("Read", 380, WS, "0x3b60"), ("Write", 0, WS, "0x1320"), f"0x1840{i}")
          for i in range(3)]
    k2 = "fc_attn_fwd_sm90_f16_d64_m64n64_w4_s1_k2_causal_lse_0"
    split = report("RAW", ("Write", 96, k2, "0x5570"), ("Read", 224, k2, "0x55c0"))
    rc, out = summarise(tmp_path, capsys, *ws, split, summary=(4, 4))
    assert rc == 0, out
    assert f"      3 WAR {WS} (Read 0x3b60, Write 0x1320): warp-specialised" in out
    assert "4 reports in 2 groups, 0 not known" in out


def test_the_pattern_names_every_warp_specialised_kernel_and_no_other():
    ws_names = [WS, WS.replace("d64_m64", "d64_m128"), WS.replace("d64", "d128"),
                WS.replace("_hopper", "_hopper_causal_br_softcap")]
    other = [WS.replace("d64", "d96"), WS.replace("d64_m64", "d128_m128"),
             WS.replace("_hopper", "_hopper_varlen"), WS.replace("_hopper", "_hopper_det")]
    for name in ws_names + other:
        r = race_summary.Report("WAR", name, (race_summary.Access("Read", 380, "0x3b60"),
                                              race_summary.Access("Write", 0, "0x1320")))
        assert (race_summary.known(r) is not None) == (name in ws_names), name


def test_anything_else_fails(tmp_path, capsys):
    fwd = "fc_attn_fwd_sm90_f16_d128_m128n128_w8_s1_lse_0"
    cases = [
        report("RAW", ("Write", 5, fwd, "0x100"), ("Read", 70, fwd, "0x200")),  # another kernel
        report("WAR", ("Read", 380, WS, "0x3b60"), ("Write", 40, WS, "0x2000")),  # an MMA warp's
        report("WAR", ("Read", 380, WS.replace("_hopper", "_hopper_det"), "0x3b60"),
               ("Write", 0, WS.replace("_hopper", "_hopper_det"), "0x1320")),  # not ws
        report("RAW", ("Write", 0, WS, "0x1320"), ("Read", 380, WS, "0x3b60")),  # not a WAR
    ]
    for case in cases:
        rc, out = summarise(tmp_path, capsys, case)
        assert rc == 1 and "NOT KNOWN" in out and "1 not known" in out, out


def test_a_log_that_printed_fewer_reports_than_found_fails(tmp_path, capsys):
    ws = report("WAR", ("Read", 380, WS, "0x3b60"), ("Write", 0, WS, "0x1320"))
    rc, out = summarise(tmp_path, capsys, ws, summary=(1, 10240))
    assert rc == 1 and "only 1 of 10240 reports printed" in out
    rc, out = summarise(tmp_path, capsys, summary=(0, 0))
    assert rc == 0 and "0 reports in 0 groups" in out
