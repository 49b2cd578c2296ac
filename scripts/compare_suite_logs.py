"""Before / after table of two packages from alternating suite runs (``python -m benchmarks
--impls cuattn`` logs): per case mean(after) / mean(before), per mode the geometric mean and
the lowest ratio.

    python scripts/compare_suite_logs.py --before old1.txt old2.txt --after new1.txt new2.txt
"""

from __future__ import annotations

import argparse
import collections
import math
import re

_LINE = re.compile(r"^(?P<case>\S.*?)\s+cuattn=(?P<value>[\d.]+)\s*$")


def read_log(path: str) -> dict[str, float]:
    values = {}
    for line in open(path):
        m = _LINE.match(line)
        if m:
            values[" ".join(m["case"].split())] = float(m["value"])
    return values


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    args = parser.parse_args(argv)
    before, after = [read_log(p) for p in args.before], [read_log(p) for p in args.after]
    cases = [c for c in before[0] if all(c in run for run in before + after)]
    ratios = collections.defaultdict(list)
    print(f"{'case':<44}{'before':>16}{'after':>16}{'ratio':>8}")
    for case in cases:
        b, a = [run[case] for run in before], [run[case] for run in after]
        ratio = (sum(a) / len(a)) / (sum(b) / len(b))
        ratios[case.split()[0]].append(ratio)
        print(f"{case:<44}{'/'.join(f'{x:.1f}' for x in b):>16}{'/'.join(f'{x:.1f}' for x in a):>16}{ratio:8.3f}")
    print()
    for mode, rs in ratios.items():
        geomean = math.exp(sum(map(math.log, rs)) / len(rs))
        print(f"{mode:<8} {len(rs):3d} cases  geometric mean {geomean:.4f}  lowest {min(rs):.3f}  highest {max(rs):.3f}")


if __name__ == "__main__":
    main()
