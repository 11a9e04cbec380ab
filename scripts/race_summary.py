"""compute-sanitizer racecheck's reports, grouped: one line per (hazard, kernel, the two accesses'
instructions) with its count of reports, each group marked as a known pattern judged false
(README, "Sanitizers") or not. Exit status 1 when a group is not known, or when the tool printed
fewer reports than it found (raise --print-limit: an unseen report cannot be judged).

    python scripts/race_summary.py LOG
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass

HAZARD = re.compile(r"Potential (RAW|WAR|WAW) hazard detected at __shared__ 0x[0-9a-f]+ in block")
ACCESS = re.compile(r"(Read|Write) Thread \((\d+),\d+,\d+\) at (\S+?)\+(0x[0-9a-f]+)")
SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?")
# the warp-specialised Hopper backward (``BackwardSpec.warp_specialized``): dense, dQ added in
# bulk, 64 or 128 query rows at d64, 64 at d128
WARP_SPECIALIZED_BWD = re.compile(r"fc_attn_bwd_sm90_\w+?_(d64_m(64|128)|d128_m64)n128_w8_s2"
                                  r"_hopper(?!\w*_(varlen|det))")


@dataclass(frozen=True)
class Access:
    kind: str  # Read or Write
    thread: int  # x of the thread index
    pc: str


@dataclass(frozen=True)
class Report:
    hazard: str  # RAW, WAR or WAW
    kernel: str
    accesses: tuple[Access, Access]  # in the order the tool prints them


def reports(lines) -> tuple[list[Report], tuple[int, int] | None]:
    """The reports in a racecheck log, and its (displayed, found) summary when it has one."""
    found, summary, hazard, accesses = [], None, None, []
    for line in lines:
        if m := HAZARD.search(line):
            hazard, accesses = m.group(1), []
        elif hazard and (m := ACCESS.search(line)):
            accesses.append((Access(m.group(1), int(m.group(2)), m.group(4)), m.group(3)))
            if len(accesses) == 2:
                kernel = accesses[0][1]
                found.append(Report(hazard, kernel, (accesses[0][0], accesses[1][0])))
                hazard = None
        elif m := SUMMARY.search(line):
            summary = (int(m.group(1)), int(m.group(2)))
    return found, summary


def known(report: Report) -> str | None:
    """Which documented false pattern ``report`` is, if any (README, "Sanitizers")."""
    kinds = {a.kind: a for a in report.accesses}
    if "_k2_" in report.kernel and report.hazard == "RAW":
        return "kv_splits=2: groups' row statistics across the CTA barrier"
    if (WARP_SPECIALIZED_BWD.search(report.kernel) and report.hazard == "WAR"
            and kinds.get("Write") and kinds["Write"].thread < 32
            and kinds.get("Read") and kinds["Read"].thread >= 128):
        return "warp-specialised backward: a stage refilled after its empty mbarrier"
    return None


def main(path: str) -> int:
    with open(path, errors="replace") as f:
        found, summary = reports(f)
    groups: Counter = Counter()
    labels: dict[tuple, set] = {}
    for r in found:  # a group is known when each of its reports is, as the same pattern
        key = (r.hazard, r.kernel, tuple((a.kind, a.pc) for a in r.accesses))
        groups[key] += 1
        labels.setdefault(key, set()).add(known(r))
    unknown = 0
    for key, count in groups.most_common():
        hazard, kernel, accesses = key
        where = ", ".join(f"{kind} {pc}" for kind, pc in accesses)
        label = next(iter(labels[key])) if len(labels[key]) == 1 else None
        unknown += label is None
        print(f"{count:7d} {hazard} {kernel} ({where}): {label or 'NOT KNOWN'}")
    print(f"{len(found)} reports in {len(groups)} groups, {unknown} not known")
    unseen = summary is not None and summary[0] < summary[1]
    if unseen:
        print(f"only {summary[0]} of {summary[1]} reports printed: raise --print-limit")
    return 1 if unknown or unseen else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
