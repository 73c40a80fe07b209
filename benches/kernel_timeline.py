#!/usr/bin/env python3
"""Per graph replay, from a `benches/kernel_timeline.c` CSV: the span from the first kernel's
start to the last one's end, the kernels' busy time, and the median gap between one kernel's end
and the next one's start (the device's launch latency between dependent nodes); `--list` prints
one replay's kernels. Replays are told apart by a gap of more than `--split` us between graph
kernels; only replays of the most common kernel count are kept.

    python3 benches/kernel_timeline.py [--list] [--split 8] FILE.csv [...]
"""

import argparse
import statistics


def replays(path: str, split_us: float) -> list:
    rows = []
    for line in open(path):
        parts = line.rstrip("\n").split(",", 5)
        if len(parts) == 6 and parts[0].isdigit():
            start, end, stream, graph, node, name = parts
            if graph != "0":
                rows.append((int(start), int(end), int(stream), name))
    rows.sort()
    if not rows:
        return []
    groups, current = [], [rows[0]]
    for before, row in zip(rows, rows[1:]):
        if row[0] - before[1] > split_us * 1000:
            groups.append(current)
            current = []
        current.append(row)
    groups.append(current)
    common = statistics.mode(len(g) for g in groups)
    return [g for g in groups if len(g) == common]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--split", type=float, default=8.0)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    for path in args.files:
        found = replays(path, args.split)
        if not found:
            print(f"{path}: no graph kernels")
            continue
        spans = [(max(r[1] for r in g) - g[0][0]) / 1000 for g in found]
        busy = [sum(r[1] - r[0] for r in g) / 1000 for g in found]
        gaps = [(b[0] - a[1]) / 1000 for g in found for a, b in zip(g, g[1:])]
        streams = sorted({r[2] for g in found for r in g})
        print(f"{path}: {len(found)} replays of {len(found[0])} kernels, span "
              f"{statistics.median(spans):.1f} us, busy {statistics.median(busy):.1f} us, gap "
              f"{statistics.median(gaps):.3f} us (median), streams {streams}")
        if args.list:
            replay = found[len(found) // 2]
            for a, b in zip([None] + replay, replay):
                gap = (b[0] - a[1]) / 1000 if a else 0.0
                print(f"  {(b[0] - replay[0][0]) / 1000:8.2f} gap {gap:6.2f} "
                      f"dur {(b[1] - b[0]) / 1000:6.2f} stream {b[2]} {b[3][:60]}")


if __name__ == "__main__":
    main()
