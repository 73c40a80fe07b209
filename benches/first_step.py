#!/usr/bin/env python3
"""The time to the first trained step, cold and warm, and where the cold time goes.

Runs on the GPU machine, from the repository's root, over a bundle made by `cargo xtask
gpu-test`:

    python3 benches/first_step.py --models mlp_fused,transformer_fused --dtypes f32,bf16 \\
        --out OUT [--modes first_step,first_step_eager,first_step_graphed] [--sides burn,torch]
        [--deadline 540] [--autotune-level balanced] [--process-timeout SECONDS] [--tf32 off]

Each Burn row is three processes of `run.sh bench` (one model, one mode), every one with
cubecl's compilation and autotune logs on, and each value-checks its graphed step after the
measurement (the eager step is the reference):

1. cold: a fresh cubecl environment (kernel cache, autotune picks and the driver's PTX cache
   empty): every kernel compiled, every autotuned operation tuned. It exports its autotune
   picks (only those) after its check.
2. picks: another fresh environment with those picks imported before the clock starts: every
   kernel compiled, nothing tuned (a machine that imported a cluster's picks).
3. warm: the first environment again: nothing compiled, nothing tuned.

So tuning took about cold - picks (the candidates compiled and timed, the losers included),
compiling the kept kernels about picks - warm, and warm is the rest (model, capture warm-ups,
recording, validation, the step), split by the process itself into make, setup and step.
PyTorch's rows (`first_step_eager`, `first_step`, `first_step_graphed`: one process each,
compiles nothing) come from the same models. Every process's wall time is recorded too
(`process_s`: its start, CUDA's and the framework's initialization included).

Writes OUT/first_step.jsonl (a row per model, dtype, framework and mode) and each process's
log, with its cubecl compilation and autotune logs, under OUT/first_step_logs/;
`benches/report.py` makes BENCHMARKS.md's table from it. A process that fails leaves a row with
its error. `--deadline` stops starting Burn rows after that many seconds (a device command has
ten minutes), saying which were not run.
`--autotune-level` is cubecl's autotune effort for the Burn processes (default `balanced`,
cubecl's own default: what a user's first run gets); a row at another level says so
(`autotune_level`). `--process-timeout` stops a Burn process that runs longer (its process
group killed) and leaves a row that says so (`stopped_after_s`): a lower bound, not a time,
with what cubecl's logs say the process had done by then (`kernels_compiled_so_far`,
`keys_tuned_so_far`; and `first_step_s_before_stop` where its first step had ended and the stop
came in its value check). `--tf32 on` lets both sides' `f32` products run on TF32 tensor cores
(Burn's `--tf32 on`, the default of burn and of burn-graphed; PyTorch's `--tf32`); the rows say
so (`tf32`). The default, `off`, is `f32` on both sides. With `CUBECL_CUDA_DUMP_PTX` set in its
environment the carried cubecl-cuda compiles to PTX (for the dump) instead of cubins, as
cubecl-cuda 0.11.3 does: the Burn rows say so (`nvrtc_output`), an A/B of the two.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BURN_MODES = ("first_step", "first_step_eager", "first_step_graphed")

# The `# device:` lines the processes printed, written once into the results.
DEVICES = set()


# The bench's names of its models (`train_step --models`), for a row of a process stopped
# before it printed its own (`--process-timeout`).
MODEL_NAMES = {"mlp": "mlp 8x256 b32", "mlp256": "mlp 8x256 b256",
               "transformer": "transformer 2x256 s128 b8", "cnn": "cnn 2conv b32 32x32",
               "lm": "lm 2x256 s128 b8 v512"}


def log_count(path, matches):
    """How many lines of the log at `path` `matches` accepts (0 where there is none): the
    bench's own counts (`benches/train_step/first_step.rs`, `LogCount`), read from outside for
    a process stopped before it printed its row."""
    try:
        with open(path, errors="replace") as log:
            return sum(1 for line in log if matches(line.rstrip("\n")))
    except OSError:
        return 0


def first_step_before_stop(path):
    """The seconds of the first step a process printed before it was stopped (its `# ...:
    first step N s (...)` line, written before its value check), or None."""
    try:
        with open(path, errors="replace") as log:
            for line in log:
                match = re.search(r": first step ([0-9.]+) s \(", line)
                if line.startswith("# ") and match:
                    return float(match.group(1))
    except OSError:
        pass
    return None


def keep_cubecl_logs(extra, logs, tag, name):
    """Copies the process's cubecl compilation and autotune logs next to its own log, so that
    a stopped or slow process can be read afterwards (which candidates took the time)."""
    for var, kind in (("BURN_GRAPHED_COMPILE_LOG", "compile"),
                      ("BURN_GRAPHED_AUTOTUNE_LOG", "autotune")):
        if os.path.exists(extra[var]):
            shutil.copyfile(extra[var], os.path.join(logs, f"{tag}-{name}.{kind}.log"))


def compiled_line(line):
    return line.startswith("[Compiling kernel]") or line == "[START_KERNEL_COMPILATION]"


def tuned_line(line):
    return line.startswith("Fastest result")


def tf32_of(dtype, tf32):
    """The TF32 setting a row of `dtype` runs with: `--tf32` for `f32`, "off" otherwise (no
    `bf16` product is TF32)."""
    return tf32 if dtype == "f32" else "off"


def tf32_tag(tf32):
    """What a TF32 row adds to its scratch and log names."""
    return "-tf32" if tf32 == "on" else ""


def base_name(model):
    """The bench model a fused variant is built from (`transformer_fused` -> `transformer`):
    PyTorch's model of the same name."""
    return model.removesuffix("_fused")


class Stopped(Exception):
    """A process ran past `--process-timeout` and was stopped."""


def bench(run_sh, model, mode, dtype, side, env, log, timeout=None):
    """One `run.sh bench` process of one model and mode: its rows (JSON lines), its wall time
    in seconds and its exit status. Its output goes to `log`. Past `timeout` seconds its whole
    process group (run.sh and the bench it started) is killed and `Stopped` raised."""
    started = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(["bash", run_sh, "bench", "--models", model, "--modes", mode],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)
        stopped = False
        try:
            stdout, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, _ = child.communicate()
            stopped = True
        out.write(stdout)
    if stopped:
        raise Stopped()
    wall = time.perf_counter() - started
    rows = []
    for line in stdout.splitlines():
        if line.startswith("# device:"):
            DEVICES.add(line.strip())
        elif line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows, wall, child.returncode


# What the caller's environment must not bring into a measured process: run.sh's per-call
# output file, rounds, both TF32 regimes, tuning kept from nowhere, removed fusions, or another
# row's picks and logs.
NOT_INHERITED = ("OUT", "BURN_GRAPHED_ROUNDS", "BURN_GRAPHED_TF32", "BURN_GRAPHED_TUNE",
                 "CUBECL_AUTOTUNE_CACHE", "BURN_GRAPHED_FUSION_REMOVE",
                 "BURN_GRAPHED_IMPORT_PICKS", "BURN_GRAPHED_EXPORT_PICKS",
                 "BURN_GRAPHED_COMPILE_LOG", "BURN_GRAPHED_AUTOTUNE_LOG", "BURN_GRAPHED_SIDES",
                 "BURN_GRAPHED_DTYPES", "CUDA_CACHE_PATH")


def side_env(side, dtype, extra, level="balanced", tf32="off"):
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env.update({"BURN_GRAPHED_SIDES": side, "BURN_GRAPHED_DTYPES": dtype,
                # By default cubecl's default effort, what a user's first run gets (the bench's
                # bf16 rows otherwise tune at `minimal`).
                "CUBECL_AUTOTUNE_LEVEL": level,
                # run.sh's one TF32 setting for both sides (bf16 rows ignore it).
                "BURN_GRAPHED_TF32": tf32})
    env.update(extra)
    return env


def one_row(rows, mode):
    """The row of `mode` among `rows` (the fused variants append `_fused_layers`)."""
    for row in rows:
        if row.get("mode", "").startswith(mode) and (
                row.get("mode") == mode or row["mode"][len(mode):].startswith("_fused")):
            return row
    return None


def burn_row(run_sh, model, dtype, mode, scratch, logs, level="balanced", timeout=None,
             tf32="off"):
    """The three processes of one Burn row, combined."""
    tf32 = tf32_of(dtype, tf32)
    tag = (f"{model}-{dtype}-{mode}" + ("" if level == "balanced" else f"-{level}")
           + tf32_tag(tf32))

    def failed(model, mode, error):
        return {"framework": "burn", "model": model, "dtype": dtype, "tf32": tf32 == "on",
                "mode": mode, "error": error}

    cold_env = os.path.join(scratch, tag + "-cold")
    picks_env = os.path.join(scratch, tag + "-picks")
    picks = os.path.join(scratch, tag + ".picks")
    for path in (cold_env, picks_env):
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    runs = {}
    plan = [
        ("cold", cold_env, {"BURN_GRAPHED_EXPORT_PICKS": picks}),
        ("picks", picks_env, {"BURN_GRAPHED_IMPORT_PICKS": picks}),
        ("warm", cold_env, {}),
    ]
    for name, env_dir, extra in plan:
        extra = dict(extra)
        extra.update({
            "BURN_GRAPHED_CUBECL_ENV": env_dir,
            "CUDA_CACHE_PATH": os.path.join(env_dir, "nv"),
            "BURN_GRAPHED_COMPILE_LOG": os.path.join(env_dir, f"compile-{name}.log"),
            "BURN_GRAPHED_AUTOTUNE_LOG": os.path.join(env_dir, f"autotune-{name}.log"),
        })
        log = os.path.join(logs, f"{tag}-{name}.log")
        try:
            rows, wall, status = bench(run_sh, model, mode, dtype, "burn",
                                       side_env("burn", dtype, extra, level, tf32), log, timeout)
        except Stopped:
            # What cubecl's logs say it had done by then: kernels compiled (tuning's
            # candidates among them) and keys tuned.
            compiled = log_count(extra["BURN_GRAPHED_COMPILE_LOG"], compiled_line)
            tuned = log_count(extra["BURN_GRAPHED_AUTOTUNE_LOG"], tuned_line)
            first = first_step_before_stop(log)
            print(f"# {tag} {name}: stopped after {timeout} s ({compiled} kernels compiled, "
                  f"{tuned} keys tuned)", file=sys.stderr, flush=True)
            suffix = "_fused_layers" if model.endswith("_fused") else ""
            return {"framework": "burn", "model": MODEL_NAMES.get(base_name(model), model),
                    "dtype": dtype, "tf32": tf32 == "on",
                    "mode": mode + suffix, "single": True, "autotune_level": level,
                    "stopped_after_s": timeout, "stopped_process": name,
                    "kernels_compiled_so_far": compiled, "keys_tuned_so_far": tuned,
                    # Its first step ended, unchecked: the stop came in the value check.
                    **({"first_step_s_before_stop": first} if first is not None else {}),
                    "error": f"{name} process stopped after {timeout} s: see {log}"}
        finally:
            keep_cubecl_logs(extra, logs, tag, name)
        row = one_row(rows, mode)
        print(f"# {tag} {name}: {wall:.1f} s process, exit {status}, "
              f"row {json.dumps(row) if row else None}", file=sys.stderr, flush=True)
        if row is None or status != 0 or "median_us" not in row:
            error = (row or {}).get("error") or f"exit {status}, no row: see {log}"
            # The row's own names where it printed one, so that the table's cell shows it.
            return failed((row or {}).get("model", model), (row or {}).get("mode", mode),
                          f"{name} process: {error}")
        row["process_s"] = round(wall, 2)
        runs[name] = row
        if name == "cold" and not os.path.exists(picks):
            return failed(model, runs["cold"]["mode"], f"cold process exported no picks: see {log}")
    # `median_us` is the cold time: the row's figure where a table reads one number.
    out = {"framework": "burn", "model": runs["cold"]["model"], "dtype": dtype,
           "mode": runs["cold"]["mode"], "tf32": runs["cold"].get("tf32"),
           "median_us": runs["cold"]["median_us"], "single": True, "autotune_level": level}
    if os.environ.get("CUBECL_CUDA_DUMP_PTX"):
        # The carried cubecl-cuda compiled to PTX for its dump, and the driver JIT-compiled it
        # at load (cubecl-cuda 0.11.3's way): report.py gives such a row a mode of its own.
        out["nvrtc_output"] = "ptx"
    # The split holds only where the picks process tuned nothing and the warm one compiled and
    # tuned nothing: otherwise the row says so and the table shows no split.
    out["split_valid"] = (runs["picks"].get("keys_tuned") == 0
                          and runs["warm"].get("keys_tuned") == 0
                          and runs["warm"].get("kernels_compiled") == 0)
    for name, row in runs.items():
        for key in ("median_us", "make_us", "setup_us", "step_us", "kernels_compiled",
                    "keys_tuned", "process_s", "check_passed", "check_param_off",
                    "check_loss_off"):
            if key in row:
                out[f"{name}_{key}"] = row[key]
    return out


def torch_row(run_sh, model, dtype, mode, logs, tf32="off"):
    base = base_name(model)
    tf32 = tf32_of(dtype, tf32)
    log = os.path.join(logs, f"torch-{base}-{dtype}-{mode}{tf32_tag(tf32)}.log")
    rows, wall, status = bench(run_sh, base, mode, dtype, "torch",
                               side_env("torch", dtype, {}, tf32=tf32), log)
    row = one_row(rows, mode)
    if row is None or status != 0:
        return {"framework": "torch", "model": base, "dtype": dtype, "tf32": tf32 == "on",
                "mode": mode,
                "error": f"exit {status}, no row: see {log}"}
    row["process_s"] = round(wall, 2)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True)
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--modes", default=",".join(BURN_MODES))
    parser.add_argument("--sides", default="burn,torch")
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-sh", default="target/gpu-bundle/run.sh")
    parser.add_argument("--deadline", type=float, default=540)
    parser.add_argument("--autotune-level", default="balanced",
                        choices=("minimal", "balanced", "extensive", "full"))
    parser.add_argument("--process-timeout", type=float, default=None)
    parser.add_argument("--tf32", default="off", choices=("off", "on"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in BURN_MODES:
            parser.error(f"--modes takes {', '.join(BURN_MODES)}, not {mode}")
    logs = os.path.join(args.out, "first_step_logs")
    os.makedirs(logs, exist_ok=True)
    started = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="first-step-")
    sides = args.sides.split(",")
    written_devices = set()
    with open(os.path.join(args.out, "first_step.jsonl"), "a") as results:
        def emit(row):
            for device in sorted(DEVICES - written_devices):
                results.write(device + "\n")
                written_devices.add(device)
            results.write(json.dumps(row) + "\n")
            results.flush()
            print(json.dumps(row), flush=True)

        # Mode by mode over the models, so that a deadline cuts the last mode's rows, not the
        # last model's; PyTorch's rows after Burn's.
        for dtype in args.dtypes.split(","):
            for mode in modes if "burn" in sides else []:
                for model in args.models.split(","):
                    if time.perf_counter() - started > args.deadline:
                        print(f"# not run (deadline): burn {model} {dtype} {mode}", flush=True)
                        continue
                    emit(burn_row(args.run_sh, model, dtype, mode, scratch, logs,
                                  args.autotune_level, args.process_timeout, args.tf32))
            bases = []
            for model in args.models.split(","):
                base = base_name(model)
                if base not in bases:
                    bases.append(base)
            for mode in modes if "torch" in sides else []:
                for base in bases:
                    if time.perf_counter() - started > args.deadline:
                        print(f"# not run (deadline): torch {base} {dtype} {mode}", flush=True)
                        continue
                    emit(torch_row(args.run_sh, base, dtype, mode, logs, args.tf32))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
