#!/usr/bin/env python3
"""Sets the value-check dumps of one model in two dtypes side by side (BENCHMARKS.md, "Open:
the bf16 transformer's value check").

    python3 benches/check_dump_compare.py REFERENCE.json LOW.json

REFERENCE is a dump of an f32 run (`BURN_GRAPHED_CHECK_DUMP=DIR` on `run.sh bench`), LOW one of
a bf16 run of the same model and mode. Both runs draw their start from the same seed; the
script first says how far the bf16 start lies from the f32 start (bf16 rounding alone is at
most 2^-8 of a value), since a comparison of runs from different starts says nothing. For
every dumped parameter, it then prints which fraction of
its elements the bf16 eager run and the bf16 graphed run leave off from the f32 eager run, by
the value check's measure (more than half a step plus the bf16 noise allowance of the value).
The side with more elements off holds the less precise arithmetic.

Where the two dumps disagree on the parameters, the script stops with exit status 2.
"""

import json
import sys

NOISE_REL = 2e-2  # the value check's bf16 allowance, relative to the value


def load(path):
    with open(path) as f:
        return json.load(f)


def fraction_off(reference, values, lr):
    """The fraction of `values` off from `reference` by more than half a step plus the noise
    (a value that is not finite, `None` in a dump, is off)."""
    off = sum(
        1
        for r, v in zip(reference, values)
        if r is None or v is None or abs(r - v) > 0.5 * lr + NOISE_REL * abs(r)
    )
    return off / max(len(reference), 1)


def start_distance(reference, values):
    """The largest distance of a start value from the reference's, relative to it."""
    return max(
        (abs(r - v) / abs(r) for r, v in zip(reference, values) if r and v is not None),
        default=0.0,
    )


def main(argv):
    if len(argv) != 3:
        print(__doc__)
        return 2
    reference, low = load(argv[1]), load(argv[2])
    lr = reference["lr"]
    params = {p["index"]: p for p in low["params"]}
    rows = []
    start_off = 0.0
    for ref in reference["params"]:
        other = params.get(ref["index"])
        if other is None or other["shape"] != ref["shape"]:
            print(f"parameter {ref['index']}: not in both dumps with one shape", file=sys.stderr)
            return 2
        start_off = max(start_off, start_distance(ref["start"], other["start"]))
        eager_off = fraction_off(ref["eager"], other["eager"], lr)
        graphed_off = fraction_off(ref["eager"], other["graphed"], lr)
        rows.append((ref["index"], ref["shape"], eager_off, graphed_off))
    print(f"reference {reference['label']} ({reference['dtype']}) against {low['dtype']}")
    verdict = "the same draws, rounded" if start_off <= 2.0 ** -8 else "NOT the same start"
    print(f"starts: {low['dtype']} off the f32 start by up to {start_off:.2e} relative: {verdict}")
    print(f"losses, f32 eager: {reference['eager_losses']}")
    print(f"losses, {low['dtype']} eager: {low['eager_losses']}; graphed: {low['graphed_losses']}")
    print()
    print(f"| parameter | shape | {low['dtype']} eager off | {low['dtype']} graphed off |")
    print("| --- | --- | --- | --- |")
    for index, shape, eager_off, graphed_off in sorted(rows, key=lambda row: -max(row[2], row[3])):
        print(f"| {index} | {shape} | {eager_off:.2%} | {graphed_off:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
