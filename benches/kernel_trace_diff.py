#!/usr/bin/env python3
"""Which kernels a graphed run's graphs launch per step that the eager run does not, and back.

Reads the file that `train_step --kernel-trace FILE` appends to (one `## LABEL: N launches`
section per run, then `### PHASE: ...` tables of `US us  Nx  (K untimed)  KERNEL` rows, and a
`### recorded ...` list of the launches issued while a graph recorded). Kernels are compared by
the trace's short type name, so a different autotune candidate shows as a different kernel
(e.g. `DirectConv2dKernel`, burn-cubecl's fallback convolutions, against `MatmulEntry | ...`).

Per step:
  eager   = launches of the eager run's `timed` phase / --timed-steps (steps x reps of that run)
  graphed = launches of the graphed run's two recordings (`capture: forward capture` and
            `capture: backward capture`): one forward and one backward, i.e. one step
            without the optimizer (the eager column includes the optimizer's kernels)

    python3 benches/kernel_trace_diff.py kt.txt --timed-steps 3 \
        [--eager 'cnn 2conv b32 32x32 eager'] [--graphed 'cnn 2conv b32 32x32 graphed_loss_static_multi_adam']

Without --eager/--graphed, the first section whose mode (the label's last word) starts with
"eager" and the first whose mode starts with "graphed" are compared: run the eager mode of
the graphed mode's optimizer (e.g. `eager_multi_adam` beside `graphed_loss_static_multi_adam`)
so that only the graphs' own differences stand out. Exits 1 when a section or phase is
missing.
"""

import argparse
import re
import sys
from collections import Counter

SECTION = re.compile(r"^## (?P<label>.*): \d+ launches$")
PHASE = re.compile(r"^### (?P<phase>.*?): \d+ launches")
ROW = re.compile(r"^\s+[\d.]+ us\s+(?P<n>\d+)x\s+\(\d+ untimed\)\s+(?P<kernel>.*)$")
RECORDINGS = ("capture: forward capture", "capture: backward capture")


def parse(path):
    """{label: {phase: Counter(kernel -> launches)}}"""
    runs, label, phase = {}, None, None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if m := SECTION.match(line):
                label, phase = m["label"], None
                runs[label] = {}
            elif label is not None and (m := PHASE.match(line)):
                phase = m["phase"]
                runs[label].setdefault(phase, Counter())
            elif line.startswith("### "):
                phase = None  # the `recorded` list: the recording phases hold the same launches
            elif label is not None and phase is not None and (m := ROW.match(line)):
                runs[label][phase][m["kernel"]] += int(m["n"])
    return runs


def pick(runs, wanted, test, what):
    if wanted is not None:
        if wanted not in runs:
            sys.exit(f"kernel_trace_diff: no section '{wanted}' (have: {', '.join(runs)})")
        return wanted
    for label in runs:
        if test(label):
            return label
    sys.exit(f"kernel_trace_diff: no {what} section (have: {', '.join(runs)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--timed-steps", type=int, required=True,
                        help="steps x reps of the eager run's timed phase")
    parser.add_argument("--eager")
    parser.add_argument("--graphed")
    args = parser.parse_args()

    runs = parse(args.trace)
    mode = lambda label: label.split()[-1]
    eager_label = pick(runs, args.eager, lambda l: mode(l).startswith("eager"), "eager")
    graphed_label = pick(runs, args.graphed, lambda l: mode(l).startswith("graphed"), "graphed")
    timed = runs[eager_label].get("timed")
    if timed is None:
        sys.exit(f"kernel_trace_diff: '{eager_label}' has no timed phase")
    recorded = Counter()
    for phase in RECORDINGS:
        if phase not in runs[graphed_label]:
            sys.exit(f"kernel_trace_diff: '{graphed_label}' has no '{phase}' phase")
        recorded.update(runs[graphed_label][phase])

    eager = {k: n / args.timed_steps for k, n in timed.items()}
    kernels = sorted(set(eager) | set(recorded), key=lambda k: (-(eager.get(k, 0) + recorded[k]), k))
    print(f"# per step: eager = '{eager_label}' timed / {args.timed_steps}; "
          f"graphed = '{graphed_label}' recordings")
    print(f"{'eager':>8} {'graphed':>8}  kernel")
    only = Counter()
    for kernel in kernels:
        e, g = eager.get(kernel, 0.0), recorded[kernel]
        side = "graphs" if g and not e else "eager" if e and not g else None
        only[side] += 1
        mark = f"  <- {side} only" if side else ""
        print(f"{e:>8.2f} {g:>8d}  {kernel[:140]}{mark}")
    print(f"# {only['graphs']} kernel(s) only in the graphs, "
          f"{only['eager']} only in eager steps (optimizer kernels included)")


if __name__ == "__main__":
    main()
