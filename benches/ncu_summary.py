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

    python3 benches/ncu_summary.py --steps N --rows FILE.ncu.csv [...] >> families.jsonl

prints instead one JSON line per file (`"kind": "kernel_families"`) for BENCHMARKS.md's table
by kernel family (`report.py --only families`): the device time and launches per step of each
family of `FAMILIES`, labelled with the profiled process's own bench row (framework, model,
dtype, mode, and a Burn row's value check), which ncu passes through into the file. It needs
`PROFILE_GRAPHS=node` (a graph launched whole has no family) and a `PROFILE_COUNT` above the
range's launches (a capped file would give a part of a step).
"""
import collections
import csv
import json
import re
import sys

# Kernel families, by name (case-insensitive), the first that matches; "other" where none does.
# Burn's own kernels carry their family as a prefix (`attention_`, `norm_`, `conv_`, ...);
# burn-cubecl's and PyTorch's are matched by their library names. The order matters: PyTorch's
# fills are `vectorized_elementwise_kernel<.., FillFunctor>` (copies and fills, not
# elementwise), cuBLASLt's split-K reduction belongs to its product, and burn-nn's attention
# and norms have no kernel of their own (matmuls, reductions and elementwise kernels).
FAMILIES = (
    # (cuDNN's flash backward adds its `compute_dot_do_o` prepass and `convert_dq_to_16bits`.)
    ("attention", r"attention_|sdpa|flash|fmha|compute_dot_do_o|convert_dq"),
    ("norms", r"norm_|layer_norm|rms_norm|gammabeta"),
    ("convolutions", r"conv_|conv2d|fprop|dgrad|wgrad|convolve|implicit_gemm|col2im|im2col"),
    ("matmuls", r"matmul|nvjet|gemm|gemv|cublas|cutlass|linear_small_rows"),
    ("loss", r"cross_entropy_|nll_loss|softmax"),
    # PyTorch's embedding backward sorts the ids (cub's radix sort), then sums per segment.
    ("embedding", r"embedding_|indexselect|compute_grad_weight|sum_and_scatter|segment|radix"),
    ("update", r"update_kernel|adam|multi_tensor_apply|schedule_"),
    ("reductions", r"reduce|chunk_sum|pool"),
    # Data movement: copies, fills, gathers and scatters (burn-nn's cross-entropy and
    # embedding), cuDNN's layout changes around its convolutions.
    ("copies", r"copy|pack_|slice|select_assign|fill|full_kernel|zero_kernel|cat_|concat|"
               r"gather|scatter|nchwtonhwc|nhwctonchw|transpose"),
    ("elementwise", r"elemwise|elementwise|binop|unary|cast|relu|gelu|where|mask"),
)


def family_of(name):
    """The family of a kernel named `name` (`FAMILIES`), or "other"."""
    lower = name.lower()
    return next((family for family, pattern in FAMILIES if re.search(pattern, lower)), "other")


def launches(path):
    """ncu's header row, its launch rows and their kernel names in `path`, or None where it
    profiled none. The file also holds the profiled program's own output (ncu passes its
    stdout through); the table starts at ncu's header row."""
    lines = list(csv.reader(open(path, errors="replace")))
    start = next((i for i, r in enumerate(lines) if "Kernel Name" in r), None)
    if start is None:
        return None
    header = lines[start]
    rows = [r for r in lines[start + 1:] if len(r) == len(header)]
    return header, rows, [r[header.index("Kernel Name")] for r in rows]


def summarize(path, steps=None):
    table = launches(path)
    if table is None:
        print(f"{path}: no profiled launches")
        return
    header, rows, names = table
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


def bench_row(path):
    """The profiled process's bench row (the last JSON line with times or an error) in `path`."""
    rows = [json.loads(line) for line in open(path, errors="replace") if line.startswith("{")]
    rows = [r for r in rows if "median_us" in r or "error" in r]
    return rows[-1] if rows else None


def family_row(path, steps):
    """`path`'s launches per step by family as one JSON row labelled with its bench row; raises
    ValueError where the file cannot give one (no launches, a whole graph, no bench row)."""
    table = launches(path)
    if table is None:
        raise ValueError(f"{path}: no profiled launches")
    header, rows, names = table
    if any(n.split("(")[0] == "graph" for n in names):
        raise ValueError(f"{path}: graphs profiled whole (PROFILE_GRAPHS=node gives their kernels)")
    busy = durations_us(header, rows)
    if len(busy) != len(rows):
        raise ValueError(f"{path}: no gpu__time_duration per launch")
    bench = bench_row(path)
    if bench is None:
        raise ValueError(f"{path}: no bench row (the profiled process printed none)")
    nodes = bench.get("graph_kernel_nodes")
    if nodes and len(rows) < nodes * steps:
        # Every step replays the graph's kernel nodes: fewer launches is a capped profile (or
        # a wrong --steps), and its families would be a part of a step.
        raise ValueError(f"{path}: {len(rows)} launches for {steps} steps of a graph of {nodes} "
                         "kernel nodes: raise PROFILE_COUNT, or give the range's steps")
    families = collections.defaultdict(lambda: {"us": 0.0, "launches": 0})
    others = set()
    for name, t in zip(names, busy):
        family = family_of(name)
        cell = families[family]
        cell["us"] += t
        cell["launches"] += 1
        if family == "other":
            others.add(name.split("(")[0][:80])
    out = {"kind": "kernel_families", "profiler": "ncu, base clocks, a graph's kernels each"}
    for k in ("framework", "model", "dtype", "tf32", "mode", "check_passed", "graph_kernel_nodes",
              "error"):
        if k in bench:
            out[k] = bench[k]
    out["steps"] = steps
    out["launches_per_step"] = round(len(rows) / steps, 2)
    out["device_us_per_step"] = round(sum(busy) / steps, 1)
    out["families"] = {f: {"us": round(c["us"] / steps, 1), "launches": round(c["launches"] / steps, 2)}
                       for f, c in sorted(families.items())}
    out["other_kernels"] = sorted(others)
    return out


args = sys.argv[1:]
steps = None
rows_wanted = False
while args[:1] in (["--steps"], ["--rows"]):
    if args[0] == "--steps":
        steps, args = int(args[1]), args[2:]
    else:
        rows_wanted, args = True, args[1:]
if rows_wanted and not steps:
    sys.exit("ncu_summary.py: --rows needs --steps N (the profiled range's steps)")
failed = 0
for path in args:
    if rows_wanted:
        try:
            print(json.dumps(family_row(path, steps)))
        except (OSError, ValueError) as why:
            print(f"ncu_summary.py: {why}", file=sys.stderr)
            failed += 1
    else:
        summarize(path, steps)
sys.exit(1 if failed else 0)
