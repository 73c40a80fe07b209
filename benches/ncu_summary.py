#!/usr/bin/env python3
"""Summarizes the CSV that `run.sh profile` gets from Nsight Compute (one row per kernel, or per
graph with `--graph-profiling graph`): launches per distinct kernel, and the launches of one
training step, between two forward-graph launches (graphed runs: two graphs per step).

    python3 benches/ncu_summary.py [--steps N] FILE.ncu.csv [...]

Also the device time of that step: the sum of the launches' `gpu__time_duration` (`run.sh
profile` locks the GPU's clocks at base). ncu serializes launches at base clocks, so this maps
what runs rather than timing the step: whether a step is bound by the device is `run.sh
busy`'s question (BENCHMARKS.md, "The transformer's step, profiled", where removing a kernel
ncu put at 24% of the step did not move the step).

With `--steps N` (the number of steps the profiled range held, i.e. --steps x --reps of the
run, all of them profiled), also the device time per step of each distinct kernel, largest
first: with `PROFILE_GRAPHS=node` this is where a graph's time goes.
"""
import collections
import csv
import sys


def summarize(path, steps=None):
    # The file also holds the profiled program's own output (ncu passes its stdout through);
    # the table starts at ncu's header row.
    lines = list(csv.reader(open(path, errors="replace")))
    start = next((i for i, r in enumerate(lines) if "Kernel Name" in r), None)
    if start is None:
        print(f"{path}: no profiled launches")
        return
    header = lines[start]
    rows = [r for r in lines[start + 1:] if len(r) == len(header)]
    names = [r[header.index("Kernel Name")] for r in rows]
    short = [n.split("(")[0][:48] for n in names]
    counts = collections.Counter(short)
    print(f"{path}: {len(rows)} launches, {len(counts)} distinct")
    for name, n in counts.most_common():
        print(f"  {n:5d}  {name}")
    graphs = [i for i, s in enumerate(short) if s == "graph"]
    if len(graphs) >= 5:
        # Steps start at every other graph launch (forward, backward, forward, ...).
        start, end = graphs[2], graphs[4]
        step = short[start:end]
        outside = [s for s in step if s != "graph"]
        print(f"  one step: {len(step)} launches, {len(step) - len(outside)} graphs, "
              f"{len(outside)} kernels outside graphs "
              f"({sum('copy' in s for s in outside)} copies)")
        print("  " + " | ".join(step))
        busy = durations_us(header, rows[start:end])
        if busy:
            print(f"  device time of that step: {sum(busy):.1f} us "
                  f"(graphs {sum(t for t, s in zip(busy, step) if s == 'graph'):.1f} us)")
    if steps:
        per_kernel(header, rows, names, steps)


def per_kernel(header, rows, names, steps):
    """Device time per step of each distinct kernel over all `rows`, largest first."""
    busy = durations_us(header, rows)
    if not busy:
        return
    total = collections.defaultdict(float)
    launches = collections.Counter()
    for name, t in zip(names, busy):
        total[name] += t
        launches[name] += 1
    print(f"  per step ({steps} steps): {sum(busy) / steps:.1f} us device time, "
          f"{len(rows) / steps:.1f} launches")
    for name, t in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"  {t / steps:8.1f} us {launches[name] / steps:6.1f}x  {name[:100]}")


def durations_us(header, rows):
    """Each row's `gpu__time_duration.sum` in microseconds, or [] when the CSV has none."""
    if "Metric Value" not in header or "Metric Unit" not in header:
        return []
    value, unit = header.index("Metric Value"), header.index("Metric Unit")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    out = []
    for r in rows:
        try:
            out.append(float(r[value].replace(",", "")) * scale[r[unit]])
        except (KeyError, ValueError):
            return []
    return out


args = sys.argv[1:]
steps = None
if args[:1] == ["--steps"]:
    steps, args = int(args[1]), args[2:]
for path in args:
    summarize(path, steps)
