#!/usr/bin/env python3
"""Summarizes the CSV that `run.sh profile` gets from Nsight Compute (one row per kernel, or per
graph with `--graph-profiling graph`): launches per distinct kernel, and the launches of one
training step, between two forward-graph launches (graphed runs: two graphs per step).

    python3 benches/ncu_summary.py FILE.ncu.csv [...]

Counts only: ncu serializes launches and fixes clocks, so its durations are not step times.
"""
import collections
import csv
import sys


def summarize(path):
    rows = [r for r in csv.reader(open(path, errors="replace")) if len(r) > 10]
    if not rows:
        print(f"{path}: no profiled launches")
        return
    header, rows = rows[0], rows[1:]
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


for path in sys.argv[1:]:
    summarize(path)
