"""Sums a RESIHP_CPU_PROFILE file (tests/cpu_profile.py): CPU seconds per file and the costliest tests.

    RESIHP_CPU_PROFILE=/tmp/cpu.jsonl make test; python scripts/cpu_profile_report.py /tmp/cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=30, help="how many tests and files to list")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.profile.read_text().splitlines() if line.strip()]
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for record in records:
        entry = files[record["test"].split("::")[0]]
        entry[0] += record["cpu_s"]
        entry[1] += record["wall_s"]
        entry[2] += 1
    total_cpu = sum(r["cpu_s"] for r in records)
    print(f"{len(records)} tests, {total_cpu:.0f} CPU s in all (wall s summed: {sum(r['wall_s'] for r in records):.0f})")
    print(f"\n{'CPU s':>7} {'wall s':>7} {'tests':>5}  file")
    for name, (cpu, wall, count) in sorted(files.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{cpu:7.1f} {wall:7.1f} {count:5d}  {name}")
    print(f"\n{'CPU s':>7} {'wall s':>7}  test")
    for record in sorted(records, key=lambda r: -r["cpu_s"])[:args.top]:
        print(f"{record['cpu_s']:7.1f} {record['wall_s']:7.1f}  {record['test']}")


if __name__ == "__main__":
    main()
