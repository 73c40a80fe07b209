#!/usr/bin/env python3
"""Host time per step of each phase, before against after a change, from the logs of `run.sh
bench` runs named `N-before.txt` / `N-after.txt` (one process per mode prints `# MODEL MODE:
host us per step: forward F loss L backward B grads G optimizer O`). A log holds the dtypes in
the order given to run.sh (BURN_GRAPHED_DTYPES): the k-th line of a (model, mode) is the k-th
dtype. Prints, per (model, dtype, mode, phase), each side's runs and mean, and after/before.

    python3 benches/phase_ab.py --dtypes f32,bf16 --phase optimizer DIR [DIR ...]
"""
import argparse
import pathlib
import re
from collections import defaultdict
from statistics import mean

LINE = re.compile(r"^# (.+?) (\S+): host us per step: (.+)$")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--dtypes", default="f32")
    parser.add_argument("--phase", default="optimizer")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    runs = defaultdict(lambda: {"before": [], "after": []})
    for directory in args.dirs:
        for path in sorted(pathlib.Path(directory).glob("*-*.txt")):
            side = path.stem.split("-", 1)[1]
            if side not in ("before", "after"):
                continue
            seen = defaultdict(int)
            for line in path.read_text(errors="replace").splitlines():
                match = LINE.match(line)
                if not match:
                    continue
                model, mode, phases = match.groups()
                values = dict(re.findall(r"(\w+) (\d+)", phases))
                index = seen[(model, mode)]
                seen[(model, mode)] += 1
                if args.phase in values and index < len(dtypes):
                    runs[(model, dtypes[index], mode)][side].append(int(values[args.phase]))
    print(f"host us per step in phase '{args.phase}': runs, mean; after / before")
    for (model, dtype, mode), sides in sorted(runs.items()):
        before, after = sides["before"], sides["after"]
        if not before or not after:
            continue
        ratio = mean(after) / mean(before)
        print(f"{model} {dtype} {mode}: before {before} mean {mean(before):.0f}; "
              f"after {after} mean {mean(after):.0f}; {ratio:.2f}x")


if __name__ == "__main__":
    main()
