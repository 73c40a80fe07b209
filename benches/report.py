"""(Over 600 lines: it reads every results file since the first session, so it keeps the tables
those rows fill; the docs generate theirs from it.)

Turns the JSON lines of `run.sh bench` (benches/train_step/ and benches/torch_reference.py)
into BENCHMARKS.md's tables and a PNG plot.

Tables, in order (one whose modes no row has is left out):

"Whole step", the headline: per model and dtype with a Burn `whole_step` row, one graph per
training step (forward, loss, backward, update) on both sides: Burn's `whole_step` and
`whole_step_floor` (the same graph replayed with no input copy: the device's floor), their
ratio and their value checks, against PyTorch's make_graphed_callables with the loss inside
and fused Adam (`graphed_loss_fused_adam`), its whole-network capture with capturable fused
Adam (`whole_step_fused_adam`) and the fused one's floor (`whole_step_floor_fused_adam`), and
the ratios of Burn's whole step to each, the same f32 arithmetic on both sides; in f32 also
both sides with TF32 matrix products (rows `"tf32": true`, mode suffix `_tf32`: Burn's `--tf32
on`, PyTorch's `--tf32`). Burn rows without a "tf32" key come from before the bench had
`--tf32`: cubecl's autotune ran most of their f32 products as TF32, and they stand in the TF32
columns too (`burn_tf32`). A file without a TF32 row has no TF32 columns (`has_tf32`).

Check columns (`check_cell`): "passed N/N" where every round's value check passed, "FAILED k
of N" where a round's check failed (a failed check leaves a failure row with `"error"` and no
times, counted against its key's rounds), "unchecked" where a round ran without one (rows
from before every round was checked).

"Time to the first trained step": rows of `benches/first_step.py` (modes `first_step_eager`,
`first_step_graphed`, `first_step`: eager, `Graphed` / make_graphed_callables, `GraphedStep` /
whole-network capture), marked `"single"`: one measurement each, in seconds, from model
creation to the end of the first trained step, setup included. A Burn row holds three
processes (cold, autotune picks imported, warm), from which the table splits the cold time
into tuning, compiling and the warm rest. Single rows enter no other table nor the plot.

"Goal": per model and dtype, the best graphed Burn (static hand-outs with MultiTensorAdam, else
the fastest graphed mode) against graphed PyTorch with fused Adam (else its default Adam), each
framework's graphed/eager speedup, the memory that graphed runs reserve beyond eager ones, and
the value check of that Burn row (`check_passed`, see benches/train_step/checks.rs; with the number of
autotune keys cubecl decided unmeasured, `autotune_unmeasured`, of that row and of Burn's eager
row, if any: their kernels are cubecl's first candidates, not measured winners, so their times
are not what autotuning would give).

"Adam, with the copy costs": burn and torch with plain Adam (eager, graphed, copy costs, memory).

"Fused Adam", when the results hold `*_fused_adam` modes of the step-by-step runs (not those of
whole steps nor of the loss inside the graphs, which have tables of their own): burn graphed
with Adam / FusedAdam / FusedAdam + OutputPolicy::Static against torch graphed with Adam /
Adam(fused=True), the best burn graphed FusedAdam over torch graphed, and the eager numbers;
the plot adds those graphed fused-Adam series.

"Multi-tensor Adam", with `*_multi_adam` modes (again not the loss-inside one): burn graphed
static with FusedAdam per parameter and with MultiTensorAdam against torch graphed; the plot
adds the MultiTensorAdam series.

"Loss inside the graphs", then the A/B tables of `AB_PARTS`.

"Inference", with `inference*` rows: per model and dtype, the forward alone (no loss, no
backward) at the training batch (`inference`, `inference_graphed`) and at batch 1
(`inference_b1`, `inference_graphed_b1`): eager and graphed Burn (`Graphed::inference`) against
eager and graphed PyTorch (`torch.cuda.graph`, eval mode, no grad), the ratio of the graphed
calls and each side's graphed/eager speedup. Inference rows enter no other table nor the plot.

"Data parallel", with `ddp_*` rows (`"ranks"`: R GPUs, each on a batch of the model's size):
per model and dtype, each framework's data-parallel modes (Burn and PyTorch: `ddp_eager`,
`ddp_graphed`, `ddp_whole_step`) with the median step, the samples per
second of all ranks (R * batch * 1e6 / median; the batch is the model name's `bN`) and the
scaling efficiency: those samples per second over R times the same framework's one-GPU samples
per second (batch * 1e6 / median) in the mode of `DDP_BASELINES` (Burn: `eager_multi_adam`,
`graphed_static_multi_adam`, `whole_step` (also for the process modes `ddp_whole_step_in_graph`
and `ddp_whole_step_processes`, the threads' `ddp_whole_step_threads_in_graph`, and their
`_overlap` variants); PyTorch: `eager_fused_adam`, `graphed_fused_adam`, and
`whole_step_fused_adam` for `ddp_whole_step`), "-" where that row is missing. Data-parallel rows enter no other table nor the
plot.

"Kernel families": rows of `benches/ncu_summary.py --rows` (`"kind": "kernel_families"`, one
per profiled process): per model, dtype and what was profiled (whole step, inference call),
each side's device time and launches per step by kernel family, at ncu's base clocks with
launches serialized (a map of where device time goes, not a step's time), with the profiled
Burn process's value check. They enter no other table.

"Failed runs": rows with an `error` (a run that printed its failure instead of times: a failed
value check, a run that ended before its row, a capture PyTorch refused), which enter no
table.

`--only NAME` prints one table (whole_step, first_step, inference, ddp, failed, ...). `--docs
README.md BENCHMARKS.md` checks the generated tables of markdown files: each sits between
`<!-- report.py NAME FILES -->` and `<!-- end report.py -->` and must equal what `--only NAME`
prints for those results files (paths from the repository root); `--write` rewrites them. An
xtask test runs the check, so that no table in the docs is edited by hand.

Several results files may be given (e.g. one per machine session): rows are keyed by
(framework, model, dtype, mode), a later file's row replacing an earlier one's. Rows of a
Burn run with fusion optimizations removed (`fusion_removed`) get the mode "MODE without
NAMES", which the tables leave out.

Rounds (`BURN_GRAPHED_ROUNDS=N bash run.sh bench`, both sides alternating N times): the rows of
one key in one file are merged into the median over rounds of each round's median, shown as
"median [lowest-highest round median] xN"; the goal table then adds the lowest and highest
per-round ratio of Burn to PyTorch, since a machine's speed drifts between rounds by more than
the difference of the two medians (BENCHMARKS.md). Every round's value check is kept.

    python3 benches/report.py bench.jsonl --table benches/results/table.md --plot benches/results/train_step.png

Needs matplotlib for the plot (`pip install matplotlib`); the table needs nothing.
"""
import argparse
import json
import re
from collections import OrderedDict


def load(paths):
    # Rows of all files, the devices named, the failed runs' rows (`error`, no times; the last
    # one of a key) and the profiles' kernel-family rows (their own table). Within a file, rows
    # of the same (framework, model, dtype, mode) are rounds (`BURN_GRAPHED_ROUNDS`, a
    # data-parallel row's rank count included in the key) and are merged by `merge_rounds`; a
    # later file's rows replace an earlier file's of the same key, keeping the first one's place.
    by, devices, failed, families = OrderedDict(), [], [], OrderedDict()
    for path in paths:
        rounds = OrderedDict()
        for line in open(path):
            line = line.strip()
            if line.startswith("# device:"):
                device = line.split(":", 1)[1].strip()
                if device not in devices:
                    devices.append(device)
            elif line.startswith("{"):
                row = json.loads(line)
                if row.get("kind") == "kernel_families":
                    # A profile's device time by kernel family: its own table only; a later
                    # file's profile of the same key replaces an earlier one's, in its place.
                    families[(row["framework"], row["model"], row["dtype"], row["mode"])] = row
                    continue
                if row.get("nvrtc_output") == "ptx":
                    # A first step with kernels compiled to PTX and JIT-compiled by the driver
                    # (cubecl-cuda 0.11.3's way; `CUBECL_CUDA_DUMP_PTX` set), beside the cubins
                    # of the carried crate: its own row.
                    row["mode"] += "_ptx"
                if row.get("tf32"):
                    # PyTorch with TF32 matrix products (`--tf32`): its own mode beside the
                    # plain-f32 row of the same run.
                    row["mode"] += "_tf32"
                if row.get("fastpath") is False:
                    # PyTorch with nn.TransformerEncoderLayer's inference fast path off
                    # (BURN_GRAPHED_TORCH_FASTPATH=off: the exact GELU, as the model defines
                    # it): its own mode beside the default row.
                    row["mode"] += "_no_fastpath"
                # A first step at another cubecl autotune effort than cubecl's default
                # (`first_step.py --autotune-level`): its own row.
                if autotune_suffix(row.get("autotune_level")):
                    row["mode"] += autotune_suffix(row["autotune_level"])
                if "stopped_after_s" in row:
                    # A first step stopped past `first_step.py --process-timeout`: a lower
                    # bound, shown in its table, not a failure.
                    row["median_us"] = float("nan")
                elif "error" in row or "median_us" not in row:
                    failed.append(row)
                    continue
                if row.get("cache"):
                    # A first step of an older file with cubecl's kernel cache cold or warm: one
                    # mode each.
                    row["mode"] += f"_{row['cache']}"
                if row.get("fusion_removed"):
                    # A variant of burn (BURN_GRAPHED_FUSION_REMOVE): its own mode, so that it
                    # neither replaces nor merges with the stock rows.
                    row["mode"] += f" without {row['fusion_removed']}"
                # A data-parallel row's rank count is part of its key: 2 and 4 GPUs are
                # different runs, not rounds of one.
                rounds.setdefault((row["framework"], row["model"], row["dtype"], row["mode"],
                                   row.get("ranks")), []).append(row)
        for k, rows in rounds.items():
            by[k] = merge_rounds(rows)
    # A failed round (a failed value check leaves a failure row instead of its times) counts
    # against its key's rounds, in the check column.
    for row in failed:
        k = (row.get("framework"), row.get("model"), row.get("dtype"), row.get("mode"),
             row.get("ranks"))
        if k in by:
            by[k]["failed_rounds"] = by[k].get("failed_rounds", 0) + 1
    return list(by.values()), "; ".join(devices) or None, failed, list(families.values())


def merge_rounds(rows):
    # One row for several rounds of the same run: the median over rounds of each round's
    # median, with the lowest and highest round medians as its spread (instead of one round's
    # p10-p90), the memory of the first round (later ones reuse its warm pools) and every
    # round's value check (`checks`: True, False or None for an unchecked row, in round
    # order). `round_us` keeps every round's median, in round order, for the per-round ratios
    # of the goal table.
    checks = [r.get("check_passed") for r in rows]
    if len(rows) == 1:
        return dict(rows[0], checks=checks)
    in_order = [r["median_us"] for r in rows]
    low_to_high = sorted(in_order)
    merged = dict(rows[0])
    merged.update(median_us=median(low_to_high), p10_us=low_to_high[0], p90_us=low_to_high[-1],
                  rounds=len(rows), round_us=in_order, checks=checks)
    return merged


def check_cell(row):
    # The value checks of a (merged) row: "passed N/N" where every round's check passed,
    # "FAILED k of N" where a round's check failed (its times are not in the row), "unchecked"
    # where a round ran without one; "n/a" for no row. Eager Burn and PyTorch rows have no check
    # (eager Burn is the reference; PyTorch is not compared with Burn's values).
    if not row:
        return "n/a"
    checks = row.get("checks", [row.get("check_passed")])
    if row.get("check_must_fail"):
        # A mode that skips a copy on purpose (timing only): its check must fail, and a round
        # whose check passed left a failure row (the check was blind to the skipped copy).
        caught = sum(1 for c in checks if c is False)
        total = len(checks) + row.get("failed_rounds", 0)
        return f"wrong on purpose, caught {caught}/{total}"
    failed = row.get("failed_rounds", 0) + sum(1 for c in checks if c is False)
    total = len(checks) + row.get("failed_rounds", 0)
    if failed:
        return f"FAILED {failed} of {total}"
    if any(c is None for c in checks):
        return "unchecked"
    return f"passed {total}/{total}"


def median(values):
    # `values` sorted.
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def key(row):
    return (row["model"], row["dtype"])


def group(rows):
    # (model, dtype) -> {(framework, mode): row}, in first-seen order.
    by = OrderedDict()
    for row in rows:
        by.setdefault(key(row), {})[(row["framework"], row["mode"])] = row
    return by


def num(value, fmt, unit=""):
    # A missing measurement (NaN) prints as n/a, not as a number.
    return "n/a" if value != value else format(value, fmt) + unit


def medians(r):
    # The median of (framework, mode) in one model's rows `r`; NaN where missing.
    def us(framework, mode):
        row = r.get((framework, mode))
        return row["median_us"] if row else float("nan")
    return us


def cells(r):
    # The "median (p10-p90)" cell of (framework, mode) in one model's rows `r`; for a row of
    # several rounds, "median [lowest-highest round median] xN".
    def cell(framework, mode):
        return row_cell(r.get((framework, mode)))
    return cell


def row_cell(row):
    # The cell of one (merged) row, as `cells` prints it; "n/a" for none.
    if not row:
        return "n/a"
    if row.get("rounds", 1) > 1:
        return (f"{row['median_us']:.0f} us [{row['p10_us']:.0f}-{row['p90_us']:.0f}] "
                f"x{row['rounds']}")
    return f"{row['median_us']:.0f} us ({row['p10_us']:.0f}-{row['p90_us']:.0f})"


def burn_tf32(r, mode):
    # Burn's row of `mode` with TF32 matrix products, to set beside PyTorch's TF32 row: the
    # `--tf32 on` row (its mode suffixed `_tf32`), or, in files from before the bench had
    # `--tf32` (Burn rows without "tf32"), the plain row itself, whose f32 products cubecl's
    # autotune ran mostly on TF32 tensor cores (BENCHMARKS.md, "Arithmetic"). None otherwise:
    # a `--tf32 off` row is never compared with a TF32 one.
    row = r.get(("burn", mode + "_tf32"))
    if row:
        return row
    row = r.get(("burn", mode))
    return row if row and "tf32" not in row else None


def tf32_cell(r, mode):
    # The cell of `burn_tf32(r, mode)`: "as plain (autotune)" for a legacy row.
    row = burn_tf32(r, mode)
    if row and "tf32" not in row:
        return "as plain (autotune)"
    return row_cell(row)


def tf32_us(r, mode):
    row = burn_tf32(r, mode)
    return row["median_us"] if row else float("nan")


def round_ratios(a, b):
    # "lowest-highest" of a's round medians over b's, round by round, where both rows have the
    # same number of rounds (more than one); "" otherwise.
    ra, rb = (a or {}).get("round_us"), (b or {}).get("round_us")
    if not ra or not rb or len(ra) != len(rb):
        return ""
    ratios = sorted(x / y for x, y in zip(ra, rb))
    return f" [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


def header(text):
    # A markdown table's header line and its separator, one "---" per column of `text`.
    return [text, "|" + " --- |" * (text.count("|") - 1)]


def has_tf32(rows):
    # Whether any row ran TF32 matrix products: a `--tf32` row of either side, or a Burn row
    # from before the bench had `--tf32` (its f32 products mostly TF32, `burn_tf32`). Tables
    # leave out their TF32 columns otherwise.
    return any(row["mode"].endswith("_tf32")
               or (row["framework"] == "burn" and row["dtype"] == "f32" and "tf32" not in row)
               for row in rows)


def whole_step_table(rows):
    # One graph per training step on both sides: Burn's whole step and its floor against
    # PyTorch's make_graphed_callables (loss inside, fused Adam) and whole-network capture
    # (capturable fused Adam), with the same f32 arithmetic on both sides: plain f32 products,
    # and, in f32, TF32 products in columns of their own (`burn_tf32`; only where a row ran
    # TF32), as ratios of medians (of round medians when merged); the check column covers every
    # Burn row of the line.
    by = group(rows)
    tf32_columns = has_tf32(rows)
    out = header(
        "| model | dtype | burn whole step | burn floor | burn / own floor | burn checks "
        "| torch make_graphed_callables (fused) | torch whole step (fused) "
        "| torch floor (fused) | burn / torch mgc | burn / torch whole step "
        + ("| burn whole step, TF32 | torch whole step (fused, TF32) "
           "| burn / torch whole step, TF32 |" if tf32_columns else "|")
    )
    for (model, dtype), r in by.items():
        if ("burn", "whole_step") not in r:
            continue
        us, cell = medians(r), cells(r)
        bw = us("burn", "whole_step")
        tf32 = dtype == "f32"
        checked = ["whole_step", "whole_step_floor"]
        if ("burn", "whole_step_tf32") in r:
            checked.append("whole_step_tf32")
        checks = [check_cell(r.get(("burn", m))) for m in checked]
        line = (
            f"| {model} | {dtype} | {cell('burn', 'whole_step')} | {cell('burn', 'whole_step_floor')} "
            f"| {num(bw / us('burn', 'whole_step_floor'), '.2f')} | {'; '.join(checks)} "
            f"| {cell('torch', TORCH_LOSS)} | {cell('torch', 'whole_step_fused_adam')} "
            f"| {cell('torch', 'whole_step_floor_fused_adam')} "
            f"| {num(bw / us('torch', TORCH_LOSS), '.2f')} "
            f"| {num(bw / us('torch', 'whole_step_fused_adam'), '.2f')} |"
        )
        if tf32_columns:
            line += (
                f" {tf32_cell(r, 'whole_step') if tf32 else '-'} "
                f"| {cell('torch', 'whole_step_fused_adam_tf32') if tf32 else '-'} "
                f"| {num(tf32_us(r, 'whole_step') / us('torch', 'whole_step_fused_adam_tf32'), '.2f') if tf32 else '-'} |"
            )
        out.append(line)
    return "\n".join(out) + "\n"


def fused_layers_table(rows):
    # The whole step of the models with burn_graphed::nn's fused layers (`--models
    # transformer_fused,lm_fused`, mode `whole_step_fused_layers`) beside the same model with
    # burn-nn's layers and PyTorch's whole-network capture (fused capturable Adam; in f32 also
    # with TF32); the check column covers the fused whole step and its floor.
    by = group(rows)
    out = header(
        "| model | dtype | burn whole step, burn-nn layers | burn whole step, fused layers "
        "| fused floor | fused checks | torch whole step (fused) "
        "| torch whole step (fused, TF32) | fused / burn-nn layers | fused / torch whole step "
        "| fused / torch whole step, TF32 |"
    )
    for (model, dtype), r in by.items():
        if ("burn", "whole_step_fused_layers") not in r:
            continue
        us, cell = medians(r), cells(r)
        fused = us("burn", "whole_step_fused_layers")
        tf32 = dtype == "f32"
        checks = [check_cell(r.get(("burn", m)))
                  for m in ("whole_step_fused_layers", "whole_step_floor_fused_layers")]
        out.append(
            f"| {model} | {dtype} | {cell('burn', 'whole_step')} "
            f"| {cell('burn', 'whole_step_fused_layers')} "
            f"| {cell('burn', 'whole_step_floor_fused_layers')} | {'; '.join(checks)} "
            f"| {cell('torch', 'whole_step_fused_adam')} "
            f"| {cell('torch', 'whole_step_fused_adam_tf32') if tf32 else '-'} "
            f"| {num(fused / us('burn', 'whole_step'), '.2f')} "
            f"| {num(fused / us('torch', 'whole_step_fused_adam'), '.2f')} "
            f"| {num(tf32_us(r, 'whole_step_fused_layers') / us('torch', 'whole_step_fused_adam_tf32'), '.2f') if tf32 else '-'} |"
        )
    return "\n".join(out) + "\n"


# Burn's modes and PyTorch's modes of the same work, as `tf32_table` pairs them: (what, Burn's
# mode, whose fused-layer row it reads (suffix `FUSED`), PyTorch's mode); in the rows each is
# suffixed `_tf32`.
TF32_PAIRS = (
    ("whole step", "whole_step", "whole_step_fused_adam"),
    ("whole step, floor", "whole_step_floor", "whole_step_floor_fused_adam"),
    ("inference, training batch", "inference_graphed", "inference_graphed"),
    ("inference, batch 1", "inference_graphed_b1", "inference_graphed_b1"),
)


def tf32_table(rows):
    # Burn's fused layers and PyTorch, both with TF32 matrix products (`"tf32": true` rows of
    # both sides, run together): each mode of `TF32_PAIRS` beside its PyTorch counterpart, and,
    # where PyTorch also ran with its transformer fast path off (the exact GELU the model
    # defines, as Burn computes it: rows suffixed `_tf32_no_fastpath`), beside that one too.
    no_fastpath = any(row["mode"].endswith("_tf32_no_fastpath") for row in rows)
    out = header("| model | dtype | what | burn, fused layers, TF32 | burn checks "
                 "| torch, TF32 | burn / torch |"
                 + (" torch, TF32, fast path off | burn / torch, fast path off |"
                    if no_fastpath else ""))
    for (model, dtype), r in group(rows).items():
        us, cell = medians(r), cells(r)
        for what, burn_mode, torch_mode in TF32_PAIRS:
            burn_mode, torch_mode = burn_mode + FUSED + "_tf32", torch_mode + "_tf32"
            if ("burn", burn_mode) not in r:
                continue
            line = (
                f"| {model} | {dtype} | {what} | {cell('burn', burn_mode)} "
                f"| {check_cell(r.get(('burn', burn_mode)))} | {cell('torch', torch_mode)} "
                f"| {num(us('burn', burn_mode) / us('torch', torch_mode), '.2f')} |"
            )
            exact = torch_mode + "_no_fastpath"
            if no_fastpath and ("torch", exact) in r:
                line += (f" {cell('torch', exact)} "
                         f"| {num(us('burn', burn_mode) / us('torch', exact), '.2f')} |")
            elif no_fastpath:
                line += " - | - |"
            out.append(line)
    return "\n".join(out) + "\n"


def has_tf32_fused(rows):
    # Whether a Burn fused-layer row ran with TF32 products (`tf32_table`).
    return any(row["framework"] == "burn" and row["mode"].endswith(FUSED + "_tf32")
               for row in rows)


def launches_table(rows):
    # The kernel nodes of each graphed row's graphs ("graph_kernel_nodes": Burn's from
    # `stats().graphs`, PyTorch's from the kept cudaGraph_t, both counted with cuGraphGetNodes
    # and cuGraphNodeGetType), its median time and the time per kernel node: on the GPU a
    # dependent kernel node costs about a microsecond of its own, so the count bounds a small
    # model's step from below. A Burn row's check column is its value check.
    out = header("| model | dtype | side | mode | kernel nodes | median | us per kernel node "
                 "| checks |")
    counted = sorted((r for r in rows if "graph_kernel_nodes" in r),
                     key=lambda r: (r["model"], r["dtype"], r["mode"], r["framework"]))
    for r in counted:
        nodes = r["graph_kernel_nodes"]
        per_node = num(r["median_us"] / nodes, ".2f") if nodes else "-"
        checks = check_cell(r) if r["framework"] == "burn" else "-"
        out.append(f"| {r['model']} | {r['dtype']} | {r['framework']} | {r['mode']} | {nodes} "
                   f"| {r['median_us']:.0f} us | {per_node} | {checks} |")
    return "\n".join(out) + "\n"


def has_whole_step(rows):
    return any(r["framework"] == "burn" and r["mode"] == "whole_step" for r in rows)


# (`first_step_cold`, `first_step_warm`: older files, a process each.)
FIRST_STEP_MODES = ("first_step", "first_step_graphed", "first_step_eager", "first_step_cold",
                    "first_step_warm")

# The training loops a first step is timed in (`benches/first_step.py`), in column order.
FIRST_STEP_LOOPS = ("first_step_eager", "first_step_graphed", "first_step")


# Kernel families in column order (benches/ncu_summary.py's FAMILIES, then "other").
FAMILY_COLUMNS = ("matmuls", "attention", "norms", "convolutions", "loss", "embedding",
                  "elementwise", "reductions", "copies", "update", "other")

def families_table(rows):
    # Device time (us) and launches per step of each kernel family, a row per model, dtype,
    # what was profiled and side: Burn with burn-nn's layers, Burn with `burn_graphed::nn`'s
    # (`_fused_layers` modes), PyTorch. "launches" also names the graph's kernel nodes (a step
    # launches them all, plus the input copies outside the graph). A Burn process's check is
    # the bench's value check of the row it profiled.
    out = header("| model | dtype | what | side | " + " | ".join(FAMILY_COLUMNS)
                 + " | total | launches (graph nodes) | check |")

    def what(mode):
        base = mode.removesuffix(FUSED)
        if base.startswith("inference"):
            return "inference, batch 1" if base.endswith("_b1") else "inference"
        return base.replace("_fused_adam", "").replace("_", " ")

    def side(r):
        if r["framework"] == "torch":
            return "PyTorch"
        return "Burn, fused layers" if r["mode"].endswith(FUSED) else "Burn, burn-nn layers"

    order = {"Burn, burn-nn layers": 0, "Burn, fused layers": 1, "PyTorch": 2}
    keyed = sorted(rows, key=lambda r: (r["model"], r["dtype"], what(r["mode"]), order[side(r)]))
    for r in keyed:
        fams = r.get("families", {})
        cells = []
        for f in FAMILY_COLUMNS:
            c = fams.get(f)
            cells.append(f"{c['us']:.0f} ({c['launches']:g})" if c else "-")
        nodes = r.get("graph_kernel_nodes")
        launches = f"{r['launches_per_step']:g}" + (f" ({nodes})" if nodes is not None else "")
        if "error" in r:
            check = "FAILED"
        elif r["framework"] == "burn":
            check = check_cell({"checks": [r.get("check_passed")]})
        else:
            check = "-"
        out.append(f"| {r['model']} | {r['dtype']} | {what(r['mode'])} | {side(r)} | "
                   + " | ".join(cells)
                   + f" | {r['device_us_per_step']:.0f} | {launches} | {check} |")
    return "\n".join(out) + "\n"


def autotune_suffix(level):
    # The mode suffix of a row at cubecl autotune effort `level`: none at cubecl's default.
    return "" if level in (None, "balanced") else f" (autotune {level})"


def first_step_table(rows):
    # Model creation to the end of the first trained step (setup included), one measurement
    # per process, in seconds: a row per model, dtype and layers (burn-nn's, or the fused
    # `_fused_layers`). A Burn measurement (`benches/first_step.py`) is three processes: cold
    # (fresh cubecl environment), with the cold process's autotune picks imported, and warm;
    # for the whole step, tuning is cold - picks, compiling picks - warm.
    by = group(rows)
    out = header(
        "| model | dtype | layers | Burn eager, cold / warm | `Graphed`, cold / warm "
        "| `GraphedStep`, cold / warm | its cold: tuning + compiling + rest "
        "| its autotune keys / kernels compiled | Burn checks "
        "| PyTorch eager / make_graphed_callables / whole-network capture |"
    )

    def s(us, fmt=".1f"):
        return num(us / 1e6, fmt, " s")

    def pair(b):
        if not b:
            return "n/a"
        if "stopped_after_s" in b:
            done = ""
            if "kernels_compiled_so_far" in b:
                kernels, keys = b["kernels_compiled_so_far"], b["keys_tuned_so_far"]
                done = (f"; {kernels} kernel{'s' * (kernels != 1)} compiled, "
                        f"{keys} key{'s' * (keys != 1)} tuned")
            if "first_step_s_before_stop" in b:
                # The step had ended; the stop came in its value check: a time, unchecked.
                done = (f"; its first step ended at {b['first_step_s_before_stop']:.1f} s, "
                        f"unchecked{done}")
            return f"> {b['stopped_after_s']:.0f} s (stopped{done}) / n/a"
        if "cold_median_us" not in b:
            # A row of one process (`run.sh bench --modes first_step`): cold or warm as its
            # cache was.
            return f"{s(b['median_us'], '.2f')} (one process)"
        return f"{s(b['cold_median_us'])} / {s(b['warm_median_us'], '.2f')}"

    def checks_of(b):
        if "cold_median_us" in b:
            return [b.get(f"{k}_check_passed") for k in ("cold", "picks", "warm")]
        return b.get("checks", [b.get("check_passed")])

    for (model, dtype), r in by.items():
        def torch(tf32):
            return " / ".join(s(r[("torch", m + tf32)]["median_us"], ".1f")
                              if ("torch", m + tf32) in r else "n/a" for m in FIRST_STEP_LOOPS)
        # TF32 products (`first_step.py --tf32 on`: rows suffixed `_tf32`, beside PyTorch's
        # TF32 rows) and cubecl's autotune efforts other than its default, each a row of its own.
        levels = sorted({row["autotune_level"] for row in r.values()
                         if autotune_suffix(row.get("autotune_level"))})
        variants = [(layers + (", TF32" if tf32 else "")
                     + (f", autotune `{level}`" if level else ""), tf32,
                     {m: r.get(("burn", m + suffix + tf32 + autotune_suffix(level)))
                      for m in FIRST_STEP_LOOPS})
                    for layers, suffix in (("burn-nn", ""), ("fused", "_fused_layers"))
                    for tf32 in ("", "_tf32")
                    for level in [None] + levels]
        variants = [v for v in variants if any(v[2].values())]
        for tf32 in ("", "_tf32"):
            if (not any(v[1] == tf32 for v in variants)
                    and any(("torch", m + tf32) in r for m in FIRST_STEP_LOOPS)):
                variants.append(("-" + (", TF32" if tf32 else ""), tf32,
                                 dict.fromkeys(FIRST_STEP_LOOPS)))
        for layers, tf32, burn in variants:
            whole = burn["first_step"]
            split = counts = "n/a"
            if whole and "cold_median_us" in whole and whole.get("split_valid", True):
                cold, picks, warm = (whole[f"{k}_median_us"] for k in ("cold", "picks", "warm"))
                split = f"{s(cold - picks)} + {s(picks - warm)} + {s(warm, '.2f')}"
                compiled = whole.get("cold_kernels_compiled")
                kept = whole.get("picks_kernels_compiled")
                tuned = whole.get("cold_keys_tuned")
                if None not in (compiled, kept, tuned):
                    # The kernels compiled cold that a process with the picks did not compile:
                    # those only the tuning compiled (its candidates, their helpers).
                    counts = f"{tuned} / {compiled} ({compiled - kept} for tuning only)"
            elif whole and "cold_median_us" in whole:
                split = counts = "n/a (the picks process tuned, or the warm one compiled)"
            # Eager Burn is the reference: no check. A missing check is "unchecked", not failed.
            checks = [c for m, b in burn.items()
                      if b and m != "first_step_eager" and "stopped_after_s" not in b
                      for c in checks_of(b)]
            check = check_cell({"checks": checks}) if checks else "-"
            out.append(
                f"| {model} | {dtype} | {layers} | {pair(burn['first_step_eager'])} "
                f"| {pair(burn['first_step_graphed'])} | {pair(whole)} | {split} | {counts} "
                f"| {check} | {torch(tf32)} |")
    return "\n".join(out) + "\n"


def table(rows):
    by = group(rows)
    out = header(
        "| model | dtype | burn eager | burn graphed | torch eager | torch graphed "
        "| burn graphed / torch graphed | burn speedup | torch speedup "
        "| burn input copy | burn param copy | reserved MiB burn eager / graphed "
        "| reserved MiB torch eager / graphed |"
    )
    for (model, dtype), r in by.items():
        us, cell = medians(r), cells(r)

        def mem(framework, mode):
            row = r.get((framework, mode))
            return f"{row['reserved_mib']:.0f}" if row else "n/a"

        be, bg = us("burn", "eager"), us("burn", "graphed")
        te, tg = us("torch", "eager"), us("torch", "graphed")
        input_copy = bg - us("burn", "graphed_no_input_copy")
        param_copy = bg - us("burn", "graphed_no_param_copy")
        out.append(
            f"| {model} | {dtype} | {cell('burn', 'eager')} | {cell('burn', 'graphed')} "
            f"| {cell('torch', 'eager')} | {cell('torch', 'graphed')} | {num(bg / tg, '.2f')} "
            f"| {num(be / bg, '.2f', 'x')} | {num(te / tg, '.2f', 'x')} "
            f"| {num(input_copy, '.0f', ' us')} | {num(param_copy, '.0f', ' us')} "
            f"| {mem('burn', 'eager')} / {mem('burn', 'graphed')} "
            f"| {mem('torch', 'eager')} / {mem('torch', 'graphed')} |"
        )
    return "\n".join(out) + "\n"


# Burn's graphed modes, best first: the goal table takes the first one a model has.
BURN_GRAPHED_BEST = ["graphed_static_multi_adam", "graphed_static_fused_adam",
                     "graphed_fused_adam", "graphed"]


GOAL_MODES = {"eager", "graphed", "graphed_fused_adam", *BURN_GRAPHED_BEST}
ADAM_MODES = {"eager", "graphed", "graphed_no_input_copy", "graphed_no_param_copy"}


def goal_table(rows):
    by = group(rows)
    out = header(
        "| model | dtype | burn eager (Adam) | best burn graphed | torch eager (Adam) "
        "| torch graphed | burn graphed / torch graphed [per round] | burn speedup "
        "| torch speedup | graphed extra MiB burn / torch | burn values vs eager |"
    )
    for (model, dtype), r in by.items():
        us, cell = medians(r), cells(r)
        best = next((m for m in BURN_GRAPHED_BEST if ("burn", m) in r), None)
        torch = "graphed_fused_adam" if ("torch", "graphed_fused_adam") in r else "graphed"
        bg = us("burn", best) if best else float("nan")
        tg = us("torch", torch)

        def extra(framework, mode):
            return extra_mib(r, framework, mode)

        row = r.get(("burn", best)) if best else None
        if row is None or "check_passed" not in row:
            checked = "not checked"
        elif row["check_passed"]:
            checked = f"ok ({row['check_param_off'] * 100:.2f}% off)"
        else:
            checked = "**FAILED**"
        # Autotune keys decided without a measurement (BENCHMARKS.md, "The CNN in bf16"): the
        # first candidates of their sets, often the slowest kernels.
        if row is not None and row.get("autotune_unmeasured"):
            checked += f", {row['autotune_unmeasured']} unmeasured autotune key(s)"
        eager_row = r.get(("burn", "eager"))
        if eager_row is not None and eager_row.get("autotune_unmeasured"):
            checked += f"; eager: {eager_row['autotune_unmeasured']} unmeasured autotune key(s)"
        out.append(
            f"| {model} | {dtype} | {cell('burn', 'eager')} "
            f"| {cell('burn', best) if best else 'n/a'} ({best or '-'}) "
            f"| {cell('torch', 'eager')} | {cell('torch', torch)} ({torch}) "
            f"| {num(bg / tg, '.2f')}{round_ratios(r.get(('burn', best)), r.get(('torch', torch)))} "
            f"| {num(us('burn', 'eager') / bg, '.1f', 'x')} "
            f"| {num(us('torch', 'eager') / tg, '.1f', 'x')} "
            f"| {extra('burn', best) if best else 'n/a'} / {extra('torch', torch)} | {checked} |"
        )
    return "\n".join(out) + "\n"


def extra_mib(r, framework, mode):
    """Reserved MiB of `mode` over the eager run of the same model and framework, as text."""
    g, e = r.get((framework, mode)), r.get((framework, "eager"))
    return f"{g['reserved_mib'] - e['reserved_mib']:.0f}" if g and e else "n/a"


def own_table(mode):
    """Whether `mode` is one of the modes with tables of their own (whole steps, the loss inside
    the graphs, first steps), which the fused- and multi-tensor-Adam tables do not show even
    where the name ends in `fused_adam` or `multi_adam`."""
    return mode.startswith(("whole_step", "graphed_loss", "first_step"))


def has_modes(rows, modes):
    """Whether any row has one of `modes` (a table with none of them is left out)."""
    return any(row["mode"] in modes for row in rows)


def has_fused(rows):
    return any(row["mode"].endswith("fused_adam") and not own_table(row["mode"]) for row in rows)


def fused_table(rows):
    by = group(rows)
    out = header(
        "| model | dtype | burn graphed (Adam) | burn graphed (FusedAdam) "
        "| burn graphed static (FusedAdam) | burn graphed guarded (FusedAdam) "
        "| torch graphed (Adam) | torch graphed (fused Adam) "
        "| best burn graphed / torch graphed (Adam) | best burn graphed / torch graphed (fused) "
        "| burn eager (Adam) | burn eager (FusedAdam) | torch eager (fused Adam) |"
    )
    for (model, dtype), r in by.items():
        us, cell = medians(r), cells(r)

        # The fastest of burn's graphed FusedAdam variants; NaN only if all are missing
        # (min() with a NaN would depend on argument order, so drop NaNs first).
        fused = [v for v in (us("burn", "graphed_fused_adam"),
                             us("burn", "graphed_static_fused_adam"),
                             us("burn", "graphed_guarded_fused_adam")) if v == v]
        best = min(fused) if fused else float("nan")
        tg, tgf = us("torch", "graphed"), us("torch", "graphed_fused_adam")
        out.append(
            f"| {model} | {dtype} | {cell('burn', 'graphed')} "
            f"| {cell('burn', 'graphed_fused_adam')} | {cell('burn', 'graphed_static_fused_adam')} "
            f"| {cell('burn', 'graphed_guarded_fused_adam')} "
            f"| {cell('torch', 'graphed')} | {cell('torch', 'graphed_fused_adam')} "
            f"| {num(best / tg, '.2f')} | {num(best / tgf, '.2f')} "
            f"| {cell('burn', 'eager')} | {cell('burn', 'eager_fused_adam')} "
            f"| {cell('torch', 'eager_fused_adam')} |"
        )
    return "\n".join(out) + "\n"


def has_multi(rows):
    return any(row["mode"].endswith("multi_adam") and not own_table(row["mode"]) for row in rows)


def multi_table(rows):
    # burn graphed static with FusedAdam per parameter and with MultiTensorAdam against torch
    # graphed with Adam and Adam(fused=True), as ratios of medians.
    by = group(rows)
    out = header(
        "| model | dtype | burn graphed static (FusedAdam) | burn graphed static (MultiTensorAdam) "
        "| torch graphed (Adam) | torch graphed (fused Adam) "
        "| burn multi / torch (Adam) | burn multi / torch (fused Adam) |"
    )
    for (model, dtype), r in by.items():
        us, cell = medians(r), cells(r)
        multi = us("burn", "graphed_static_multi_adam")
        tg, tgf = us("torch", "graphed"), us("torch", "graphed_fused_adam")
        out.append(
            f"| {model} | {dtype} | {cell('burn', 'graphed_static_fused_adam')} "
            f"| {cell('burn', 'graphed_static_multi_adam')} "
            f"| {cell('torch', 'graphed')} | {cell('torch', 'graphed_fused_adam')} "
            f"| {num(multi / tg, '.2f')} | {num(multi / tgf, '.2f')} |"
        )
    return "\n".join(out) + "\n"


BURN_LOSS, TORCH_LOSS = "graphed_loss_static_multi_adam", "graphed_loss_fused_adam"


def has_loss(rows):
    return any(r["mode"] in (BURN_LOSS, TORCH_LOSS) for r in rows)


def loss_table(rows):
    # The loss inside the graphed callable on both sides, beside the same configuration with
    # the loss outside.
    by = group(rows)
    out = header(
        "| model | dtype | burn graphed (static, MultiTensorAdam) | burn, loss in graph "
        "| torch graphed (fused Adam) | torch, loss in graph "
        "| burn / torch, loss in graph [per round] | burn speedup | torch speedup "
        "| graphed extra MiB burn / torch, loss in graph |"
    )
    for (model, dtype), r in by.items():
        if ("burn", BURN_LOSS) not in r and ("torch", TORCH_LOSS) not in r:
            continue
        us, cell = medians(r), cells(r)
        bl, tl = us("burn", BURN_LOSS), us("torch", TORCH_LOSS)
        out.append(
            f"| {model} | {dtype} | {cell('burn', 'graphed_static_multi_adam')} "
            f"| {cell('burn', BURN_LOSS)} | {cell('torch', 'graphed_fused_adam')} "
            f"| {cell('torch', TORCH_LOSS)} "
            f"| {num(bl / tl, '.2f')}{round_ratios(r.get(('burn', BURN_LOSS)), r.get(('torch', TORCH_LOSS)))} "
            f"| {num(us('burn', 'eager') / bl, '.1f', 'x')} "
            f"| {num(us('torch', 'eager') / tl, '.1f', 'x')} "
            f"| {extra_mib(r, 'burn', BURN_LOSS)} / {extra_mib(r, 'torch', TORCH_LOSS)} |"
        )
    return "\n".join(out) + "\n"


# Parts of Burn's graphed step measured by leaving them out (FaultInjection), each an A/B of
# the same run with and without it: (title, column of the run with it, column of the run
# without it, the mode with it, the mode without it). `--modes A,B,B,A` runs them
# alternately, so that the rounds pair up.
AB_PARTS = [
    ("The check of written buffers", "burn graphed (MultiTensorAdam)",
     "the same without the check", "graphed_multi_adam", "graphed_multi_adam_no_check"),
    ("The input copy", "burn graphed (MultiTensorAdam)", "the same without the input copy",
     "graphed_multi_adam", "graphed_multi_adam_no_input_copy"),
    ("The parameter copies (burn's Adam returns new parameters)", "burn graphed (Adam)",
     "the same without the parameter copies", "graphed", "graphed_no_param_copy"),
]


def ab_table(rows, with_title, without_title, with_mode, without_mode):
    # What one part of the step costs: the run with it against the run without it, as a
    # difference and a ratio of medians, with the ratio's spread over paired rounds.
    by = group(rows)
    out = header(
        f"| model | dtype | {with_title} | {without_title} "
        "| difference | with / without [per round] |"
    )
    for (model, dtype), r in by.items():
        if ("burn", without_mode) not in r:
            continue
        us, cell = medians(r), cells(r)
        with_us, without_us = us("burn", with_mode), us("burn", without_mode)
        out.append(
            f"| {model} | {dtype} | {cell('burn', with_mode)} | {cell('burn', without_mode)} "
            f"| {num(with_us - without_us, '.0f', ' us')} "
            f"| {num(with_us / without_us, '.3f')}"
            f"{round_ratios(r.get(('burn', with_mode)), r.get(('burn', without_mode)))} |"
        )
    return "\n".join(out) + "\n"


# (batch, eager mode, graphed mode, Burn's floor mode or None).
INFERENCE_BATCHES = (("training", "inference", "inference_graphed", None),
                     ("1", "inference_b1", "inference_graphed_b1", "inference_graphed_b1_floor"))


def is_inference(row):
    return row["mode"].startswith("inference")


def inference_table(rows):
    # Per call of the forward alone, eager and graphed on both sides, at each batch size; the
    # TF32 columns only where a row ran TF32 (`has_tf32`).
    by = group(rows)
    tf32_columns = has_tf32(rows)
    out = header(
        "| model | dtype | batch | burn eager | burn graphed | burn floor | burn graphed checks "
        "| torch eager | torch graphed "
        + ("| torch graphed, TF32 " if tf32_columns else "")
        + "| burn graphed / torch graphed "
        + ("| burn graphed / torch graphed, TF32 " if tf32_columns else "")
        + "| burn speedup | torch speedup |"
    )
    for (model, dtype), r in by.items():
        us, cell = medians(r), cells(r)
        for batch, eager, graphed, floor in INFERENCE_BATCHES:
            if not any((f, m) in r for f in ("burn", "torch") for m in (eager, graphed)):
                continue
            bg, tg = us("burn", graphed), us("torch", graphed)
            tf32 = dtype == "f32"
            tf32_cell_ = (f"| {cell('torch', graphed + '_tf32') if tf32 else '-'} "
                          if tf32_columns else "")
            tf32_ratio = (f"| {num(tf32_us(r, graphed) / us('torch', graphed + '_tf32'), '.2f') if tf32 else '-'} "
                          if tf32_columns else "")
            out.append(
                f"| {model} | {dtype} | {batch} | {cell('burn', eager)} | {cell('burn', graphed)} "
                f"| {cell('burn', floor) if floor else '-'} "
                f"| {'; '.join(check_cell(r.get(('burn', m))) for m in (graphed, floor) if m)} "
                f"| {cell('torch', eager)} | {cell('torch', graphed)} "
                f"{tf32_cell_}| {num(bg / tg, '.2f')} {tf32_ratio}"
                f"| {num(us('burn', eager) / bg, '.1f', 'x')} "
                f"| {num(us('torch', eager) / tg, '.1f', 'x')} |"
            )
    return "\n".join(out) + "\n"


def inference_fused_table(rows):
    # The graphed forward of the models with burn_graphed::nn's fused layers (`--models
    # mlp_fused,...`, modes suffixed `_fused_layers`) beside the same model with burn-nn's layers
    # and PyTorch's captured forward (in f32 also with TF32), at each batch size; where the
    # file has them, PyTorch's rows with the transformer layers' inference fast path off (the
    # exact GELU the model defines, where the fast path computes the tanh approximation).
    by = group(rows)
    out = header(
        "| model | dtype | batch | burn graphed, burn-nn layers | burn graphed, fused layers "
        "| fused floor | fused checks | torch graphed | torch graphed, TF32 "
        "| torch graphed, fast path off "
        "| fused / burn-nn layers | fused / torch graphed | fused / torch graphed, TF32 "
        "| fused / torch graphed, fast path off |"
    )
    for (model, dtype), r in by.items():
        us, cell = medians(r), cells(r)
        for batch, _, graphed, floor in INFERENCE_BATCHES:
            fused, fused_floor = graphed + FUSED, (floor + FUSED) if floor else None
            if ("burn", fused) not in r:
                continue
            bf, tf32 = us("burn", fused), dtype == "f32"
            exact_gelu = ("torch", graphed + "_no_fastpath") in r
            out.append(
                f"| {model} | {dtype} | {batch} | {cell('burn', graphed)} | {cell('burn', fused)} "
                f"| {cell('burn', fused_floor) if fused_floor else '-'} "
                f"| {'; '.join(check_cell(r.get(('burn', m))) for m in (fused, fused_floor) if m)} "
                f"| {cell('torch', graphed)} "
                f"| {cell('torch', graphed + '_tf32') if tf32 else '-'} "
                f"| {cell('torch', graphed + '_no_fastpath') if exact_gelu else '-'} "
                f"| {num(bf / us('burn', graphed), '.2f')} | {num(bf / us('torch', graphed), '.2f')} "
                f"| {num(tf32_us(r, fused) / us('torch', graphed + '_tf32'), '.2f') if tf32 else '-'} "
                f"| {num(bf / us('torch', graphed + '_no_fastpath'), '.2f') if exact_gelu else '-'} |"
            )
    return "\n".join(out) + "\n"


# The suffix of the modes of the bench's fused-layer models (`mlp_fused`, `transformer_fused`,
# `lm_fused`).
FUSED = "_fused_layers"


# The one-GPU mode each data-parallel mode's scaling efficiency compares with, per framework.
DDP_BASELINES = {
    ("burn", "ddp_eager"): "eager_multi_adam",
    ("burn", "ddp_graphed"): "graphed_static_multi_adam",
    ("burn", "ddp_whole_step"): "whole_step",
    ("burn", "ddp_whole_step_in_graph"): "whole_step",
    ("burn", "ddp_whole_step_in_graph_overlap"): "whole_step",
    ("burn", "ddp_whole_step_processes"): "whole_step",
    ("burn", "ddp_whole_step_in_graph_sockets"): "whole_step",
    ("burn", "ddp_whole_step_threads_in_graph"): "whole_step",
    ("burn", "ddp_whole_step_threads_in_graph_after_backward"): "whole_step",
    ("burn", "ddp_whole_step_threads_in_graph_overlap"): "whole_step",
    ("burn", "ddp_whole_step_threads_in_graph_overlap_one_stream"): "whole_step",
    ("torch", "ddp_eager"): "eager_fused_adam",
    ("torch", "ddp_graphed"): "graphed_fused_adam",
    ("torch", "ddp_whole_step"): "whole_step_fused_adam",
}


def is_ddp(row):
    return row["mode"].startswith("ddp_")


def batch_of(model):
    """The batch size in a model's name ("mlp 8x256 b32" -> 32), or None."""
    match = re.search(r"(?:^| )b(\d+)(?: |$)", model)
    return int(match.group(1)) if match else None


def ddp_table(rows):
    # Per model and dtype, each framework's data-parallel rows (one per rank count, so that runs
    # with --ranks 2 and --ranks 4 share a file): the step, the samples per second of all ranks,
    # and the scaling efficiency over the framework's one-GPU baseline.
    by = group([r for r in rows if not is_ddp(r)])
    ddp = OrderedDict()
    for row in rows:
        if is_ddp(row):
            ddp.setdefault(key(row), {})[(row["framework"], row["mode"], row.get("ranks"))] = row
    out = header(
        "| model | dtype | framework | mode | ranks | step | samples/s "
        "| 1-GPU baseline | baseline samples/s | scaling efficiency | value check |"
    )
    for (model, dtype), found in ddp.items():
        base_rows = by.get((model, dtype), {})
        batch = batch_of(model)
        counts = sorted({k[2] for k in found}, key=lambda n: (n is None, n or 0))
        for ranks in counts:
            # Burn's fused-layer variants (`_fused_layers` appended) against the fused 1-GPU
            # baseline, after the stock rows.
            variants = [(k, b) for k, b in DDP_BASELINES.items()]
            variants += [((f, m + FUSED), b + FUSED) for (f, m), b in DDP_BASELINES.items()
                         if f == "burn"]
            for (framework, mode), baseline in variants:
                row = found.get((framework, mode, ranks))
                if row is None:
                    continue
                if batch and ranks:
                    samples = ranks * batch * 1e6 / row["median_us"]
                else:
                    samples = row.get("samples_per_s", float("nan"))
                base = base_rows.get((framework, baseline))
                base_samples = batch * 1e6 / base["median_us"] if base and batch else float("nan")
                efficiency = samples / (ranks * base_samples) if ranks else float("nan")
                step = f"{row['median_us']:.0f} us ({row['p10_us']:.0f}-{row['p90_us']:.0f})"
                out.append(
                    f"| {model} | {dtype} | {framework} | {mode} | {ranks or 'n/a'} "
                    f"| {step} | {num(samples, '.0f')} "
                    f"| {baseline} | {num(base_samples, '.0f') if base else '-'} "
                    f"| {num(efficiency, '.2f') if base else '-'} "
                    f"| {check_cell(row) if framework == 'burn' else '-'} |"
                )
    return "\n".join(out) + "\n"


def failed_table(failed):
    out = header("| framework | model | dtype | mode | error |")
    for row in failed:
        error = str(row.get("error", "no times")).replace("|", "\\|")
        out.append(f"| {row.get('framework')} | {row.get('model')} | {row.get('dtype')} "
                   f"| {row.get('mode')} | {error} |")
    return "\n".join(out) + "\n"


def plot(rows, device, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(OrderedDict((key(r), None) for r in rows))
    series = [("burn", "eager"), ("burn", "graphed"), ("torch", "eager"), ("torch", "graphed")]
    colors = ["#f4a259", "#bc4b51", "#8cb369", "#5b8e7d"]
    # The fused-Adam series only when the results have them.
    present = {(r["framework"], r["mode"]) for r in rows}
    for extra, color in [(("burn", "graphed_fused_adam"), "#6a4c93"),
                         (("burn", "graphed_static_fused_adam"), "#1982c4"),
                         (("burn", "graphed_guarded_fused_adam"), "#ff595e"),
                         (("burn", "graphed_static_multi_adam"), "#ffca3a"),
                         (("torch", "graphed_fused_adam"), "#2b2d42"),
                         (("burn", BURN_LOSS), "#c1121f"),
                         (("torch", TORCH_LOSS), "#52a675"),
                         (("burn", "whole_step"), "#7b2cbf"),
                         (("torch", "whole_step"), "#90be6d"),
                         (("torch", "whole_step_fused_adam"), "#277da1")]:
        if extra in present:
            series.append(extra)
            colors.append(color)
    # Series without a single row (e.g. a run without eager modes) get no bars nor legend entry.
    kept = [(s, c) for s, c in zip(series, colors) if s in present]
    series, colors = [s for s, _ in kept], [c for _, c in kept]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    # The bars of one (model, dtype) share 0.8 of the x unit, centred on the tick
    # (4 series: width 0.2, offsets -1.5..1.5 widths, as before).
    width = 0.8 / len(series)
    for i, ((framework, mode), color) in enumerate(zip(series, colors)):
        values, lows, highs = [], [], []
        for k in keys:
            row = next((r for r in rows if key(r) == k and r["framework"] == framework
                        and r["mode"] == mode), None)
            values.append(row["median_us"] if row else 0)
            lows.append(row["median_us"] - row["p10_us"] if row else 0)
            highs.append(row["p90_us"] - row["median_us"] if row else 0)
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, values, width, yerr=[lows, highs], label=f"{framework} {mode}", color=color)
    ax.set_xticks(range(len(keys)))
    # "transformer 2x256 s128 b8" -> "transformer 2x256 s128" / "b8" / dtype: labels that fit.
    labels = [f"{m.rsplit(' b', 1)[0]}\nb{m.rsplit(' b', 1)[1]} {d}" if " b" in m else f"{m}\n{d}"
              for m, d in keys]
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("train step, us (median; bars: p10-p90,\nor lowest-highest round median)", fontsize=8)
    ax.set_yscale("log")
    ax.set_title(f"Train step (fwd+loss+bwd+Adam), lower is better — {device or 'GPU'}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sections(paths):
    """Every table the rows of the results files `paths` hold, in order: an OrderedDict of
    name -> (title, markdown table), plus the rows and the device for the plot."""
    rows, device, failed, families = load(paths)
    # One-off measurements (first steps, `"single"`; a first-step mode counts as one even
    # without the flag): their own table only, not the per-step tables nor the plot.
    is_single = lambda r: r.get("single") or r["mode"] in FIRST_STEP_MODES
    singles = [r for r in rows if is_single(r)]
    inference = [r for r in rows if is_inference(r) and not is_single(r)]
    # Data-parallel rows: their own table, which also reads the one-GPU rows (its baselines).
    data_parallel = [r for r in rows if not is_single(r) and not is_inference(r)]
    has_ddp = any(is_ddp(r) for r in data_parallel)
    rows = [r for r in rows if not is_single(r) and not is_inference(r) and not is_ddp(r)]
    out = OrderedDict()
    if has_whole_step(rows):
        out["whole_step"] = ("Whole step", whole_step_table(rows))
    if has_modes(rows, ("whole_step" + FUSED,)):
        out["fused_layers"] = ("Whole step with fused layers", fused_layers_table(rows))
    # Any first-step mode, whatever it is suffixed with (fused layers, TF32, autotune effort).
    if any(r["mode"].startswith(FIRST_STEP_MODES) for r in singles):
        out["first_step"] = ("Time to the first trained step", first_step_table(singles))
    if has_modes(rows, GOAL_MODES):
        out["goal"] = ("Goal", goal_table(rows))
    if has_modes(rows, ADAM_MODES):
        out["adam"] = ("Adam, with the copy costs", table(rows))
    if has_fused(rows):
        out["fused"] = ("Fused Adam", fused_table(rows))
    if has_multi(rows):
        out["multi"] = ("Multi-tensor Adam", multi_table(rows))
    if has_loss(rows):
        out["loss"] = ("Loss inside the graphs", loss_table(rows))
    for index, (title, *columns_and_modes) in enumerate(AB_PARTS):
        if any(r["mode"] == columns_and_modes[-1] for r in rows):
            out[f"ab{index}"] = (title, ab_table(rows, *columns_and_modes))
    if inference:
        out["inference"] = ("Inference (the forward alone, per call)", inference_table(inference))
    if any(r["mode"].endswith(FUSED) for r in inference):
        out["inference_fused"] = ("Inference with fused layers (per call)",
                                  inference_fused_table(inference))
    if has_ddp:
        out["ddp"] = ("Data parallel (each rank a batch of the model's size; efficiency: "
                      "samples/s over ranks x the 1-GPU baseline's)", ddp_table(data_parallel))
    if has_tf32_fused(rows + inference):
        out["tf32"] = ("Fused layers and PyTorch, both with TF32 products",
                       tf32_table(rows + inference))
    if any("graph_kernel_nodes" in r for r in rows + inference):
        out["launches"] = ("Kernel nodes per graph (launches per replay)",
                           launches_table(rows + inference))
    if families:
        out["families"] = ("Device time by kernel family (Nsight Compute, base clocks, per step)",
                           families_table(families))
        steps = [r for r in families if r["mode"].startswith("whole_step")]
        if steps:
            out["families_steps"] = ("Device time by kernel family, whole steps only",
                                     families_table(steps))
    if failed:
        out["failed"] = ("Failed runs", failed_table(failed))
    return out, rows, device


# A generated table in a markdown file: the opening comment names the table and its results
# files (paths from the repository root), the closing one ends what `--docs` rewrites.
DOC_BLOCK = re.compile(r"(<!-- report\.py (\w+) ([^>]+?) -->\n)(.*?)(<!-- end report\.py -->)",
                       re.S)


def docs(paths, root, write):
    """Regenerates every generated table of the markdown files `paths` from the results files
    its block names (relative to `root`); rewrites the files with `write`, else prints each
    block that differs. Returns the number of blocks that differ (or cannot be generated)."""
    import os
    differ = 0
    for path in paths:
        text = open(path).read()

        def regenerate(match):
            nonlocal differ
            name, files = match.group(2), match.group(3).split()
            try:
                tables, _, _ = sections([os.path.join(root, f) for f in files])
                fresh = tables[name][1]
            except (OSError, KeyError) as missing:
                differ += 1
                print(f"{path}: table {name} of {' '.join(files)}: cannot generate ({missing})")
                return match.group(0)
            if fresh != match.group(4):
                differ += 1
                print(f"{path}: table {name} of {' '.join(files)} differs from report.py's:\n"
                      f"--- in the file\n{match.group(4)}--- report.py\n{fresh}")
            return match.group(1) + fresh + match.group(5)

        fresh_text = DOC_BLOCK.sub(regenerate, text)
        if write and fresh_text != text:
            open(path, "w").write(fresh_text)
    return differ


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="*", help="JSON-lines files of run.sh bench")
    parser.add_argument("--table", help="write every table into this file too")
    parser.add_argument("--only", help="print only this table (e.g. whole_step, inference)")
    parser.add_argument("--plot")
    parser.add_argument("--docs", nargs="+", metavar="MD",
                        help="check the generated tables of these markdown files (blocks "
                             "'<!-- report.py NAME FILES -->' ... '<!-- end report.py -->'); "
                             "exit 1 where one differs")
    parser.add_argument("--write", action="store_true", help="with --docs: rewrite the tables")
    args = parser.parse_args()
    if args.docs:
        import os
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        differ = docs(args.docs, root, args.write)
        if differ and not args.write:
            raise SystemExit(f"{differ} generated table(s) differ: run "
                             "python3 benches/report.py --docs " + " ".join(args.docs) + " --write")
        return
    if not args.results:
        parser.error("give results files, or --docs")
    tables, rows, device = sections(args.results)
    if args.only:
        if args.only not in tables:
            raise SystemExit(f"no table {args.only} in these results (have: {', '.join(tables)})")
        print(tables[args.only][1], end="")
        return
    text = f"Device: {device}\n"
    for title, table_text in tables.values():
        text += f"\n{title}:\n\n" + table_text
    if args.table:
        open(args.table, "w").write(text)
    print(text)
    if args.plot:
        plot(rows, device, args.plot)


if __name__ == "__main__":
    main()
