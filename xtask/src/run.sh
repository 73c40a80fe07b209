#!/usr/bin/env bash
# Runner of the burn-graphed GPU bundle, made by `cargo xtask gpu-test`.
# Needs bash and xz (or python3) and an NVIDIA driver with CUDA 12.x/13.x libraries; no Rust.
#
#   bash run.sh [tests [ARGS]]  run the GPU test suite, print "N passed, N failed, N skipped"
#                          and the skipped tests with their reasons, exit 1 on failure; ARGS
#                          go to the test binary (e.g. --ignored NAME). Skipped: ignored
#                          tests, and tests that print `skipped: NAME: REASON` (they cannot
#                          run their checks on this machine, e.g. too few GPUs; libtest
#                          counts them as passed, this count does not).
#                          Writes the GPU ledger (every test, its last result, the bundle's
#                          commit, device, date) to $OUT/gpu-ledger.md, or with OUT unset
#                          over BURN_GRAPHED_LEDGER: the rows of the tests this run ran
#                          replace those of BURN_GRAPHED_LEDGER (default: the checkout's
#                          tests/gpu-ledger.md), the others stay, so runs in several calls
#                          add up.
#                          `tests --from NAME [ARGS]` runs NAME and the tests after it in the
#                          order the suite runs them (by name): the rest of a run that a
#                          time limit cut off at NAME. `tests --rest LOG... [ARGS]` runs the
#                          tests that the logs of earlier runs show no result for; `tests --ledger
#                          LOG...` runs nothing and writes the counts and the GPU ledger from the
#                          logs (tests they show no result for: "no result" or "not run").
#                          With --jobs (or --rest, --from), names after the options are
#                          substrings that choose the tests, shared among the processes.
#                          `tests --jobs N` (or BURN_GRAPHED_JOBS=N) runs N test processes
#                          at once, logs gpu-tests-1.log .. gpu-tests-N.log (one process:
#                          gpu-tests.log), in $OUT when set; on several GPUs the
#                          processes' first devices take the GPUs in turn
#   bash run.sh demo       run the training demo (eager vs graphed)
#   bash run.sh bench      run the train-step benchmark, Burn and PyTorch side by side (f32 and
#                          bf16, or BURN_GRAPHED_DTYPES="f32"), printing JSON lines; extra
#                          arguments go to both sides (e.g. --models mlp,cnn --reps 15). Burn
#                          runs in BURN_GRAPHED_CUBECL_ENV (default target/cubecl-env), where
#                          cubecl keeps compiled kernels between runs; bf16 with
#                          CUBECL_AUTOTUNE_LEVEL=minimal unless the caller sets it.
#                          BURN_GRAPHED_SIDES="torch burn" runs PyTorch first (default
#                          "burn torch"; one side alone: "torch" or "burn");
#                          BURN_GRAPHED_ROUNDS=N repeats both sides N times, alternating
#                          (report.py takes the median over rounds; every round's Burn runs
#                          are value-checked); f32 runs without TF32 on both sides
#                          (BURN_GRAPHED_TF32="on" with it, "off on" both; rows record "tf32")
#   bash run.sh warm       compile, untimed and in parallel, the kernels `bench` with the same
#                          --models and --modes will load (groups of modes joined by "+")
#   bash run.sh busy       run `bench` (same arguments, f32 unless BURN_GRAPHED_DTYPES) once per
#                          side and mode of --modes while nvidia-smi samples the GPU's
#                          utilization and SM clock: a median near 100% means that side's step
#                          is bound by the device (one model per call; rows and busy lines also
#                          in $OUT/busy.jsonl)
#   bash run.sh nccl       say which NCCL library runs on several GPUs use (exit 1 when none)
#   bash run.sh profile    trace the timed steps (both sides open the CUDA profiler's range
#                          around them) of the PROFILE_MODES (default "eager graphed"; each side
#                          runs the ones it knows) on the PROFILE_SIDES (default "burn torch":
#                          PyTorch names modes and models its own way) in PROFILE_DTYPE (f32) with
#                          Nsight Systems (kernel and API summaries as CSV into $OUT; other
#                          `nsys stats` reports with PROFILE_REPORTS, e.g. cuda_gpu_trace), or with
#                          Nsight Compute where nsys is missing (the range's first
#                          PROFILE_COUNT=300 launches, each graph one launch unless
#                          PROFILE_GRAPHS=node; GPU clocks locked at base, as unlocked ones
#                          fall to idle between ncu's serialized launches (a 1-element kernel
#                          read 160-250 us; PROFILE_CLOCKS=none unlocks); summarize with
#                          benches/ncu_summary.py); extra arguments go to both sides (default:
#                          --models mlp --steps 50 --reps 4); Burn runs in the cubecl
#                          environment of `bench`, reusing the kernels compiled there
#
# Environment: BURN_GRAPHED_AUTOTUNE_LOG and BURN_GRAPHED_COMPILE_LOG (bench, profile: files for
# cubecl's autotune and compilation logs),
# BURN_GRAPHED_TUNE=fresh (bench, profile: every Burn process tunes its kernels anew),
# BURN_GRAPHED_FILTER (test name substring), BURN_GRAPHED_LEDGER (tests: the ledger to
# update, default $BURN_GRAPHED_REPO/tests/gpu-ledger.md), BURN_GRAPHED_HEARTBEAT (seconds
# between the tests' "[run.sh: Ns]" progress lines, default 60), BURN_GRAPHED_LONG=1 (more
# property-test cases), OUT (a folder to copy logs and results into), BURN_GRAPHED_REPO (the
# repository checkout the tests read their snapshots and proptest regressions from; default:
# two folders up from this script, i.e. the checkout that holds target/gpu-bundle).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mode="${1:-tests}"

unpack() { # unpack FILE.xz -> $work/NAME
  local src="$here/$1" dst="$work/${1%.xz}"
  if command -v xz >/dev/null 2>&1; then
    xz -dc "$src" >"$dst" || return 1
  else
    python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],"wb"))' "$src" "$dst" || return 1
  fi
  chmod +x "$dst"
  echo "$dst"
}

# The Burn side of `bench` and `profile` runs in a cubecl environment with cubecl's persistent
# compilation cache: kernels compiled by one command are loaded, not compiled, by the next on
# the same machine (bf16 kernels take minutes to compile; a warm run of the same models and
# modes takes seconds). Autotune results persist there too. The driver's PTX cache goes beside
# them. Sets env_dir.
cubecl_env() {
  env_dir="${BURN_GRAPHED_CUBECL_ENV:-$repo/target/cubecl-env}"
  mkdir -p "$env_dir/nv"
  printf '[compilation]\ncache = true\n[environment]\npath = "local"\n' > "$env_dir/cubecl.toml"
  # BURN_GRAPHED_TUNE=fresh: every Burn process tunes its kernels anew (autotune results kept in
  # memory only), so that rounds sample the spread of cubecl's picks; "kept" (default): a pick
  # measured once stays in the environment for every later command.
  case "${BURN_GRAPHED_TUNE:-kept}" in
    kept) ;;
    fresh) printf '[autotune]\ndisable_cache = true\n' >> "$env_dir/cubecl.toml"
           export CUBECL_AUTOTUNE_CACHE=0 ;; # the variable would override the file
    *) echo "run.sh: BURN_GRAPHED_TUNE takes fresh or kept, not '$BURN_GRAPHED_TUNE'"; exit 2 ;;
  esac
  # BURN_GRAPHED_AUTOTUNE_LOG=FILE: cubecl's autotune log at level full (every key tuned, each
  # candidate's time or error) appended to FILE (an absolute path).
  if [ -n "${BURN_GRAPHED_AUTOTUNE_LOG:-}" ]; then
    printf '[autotune.logger]\nlevel = "full"\nappend = true\nfile = "%s"\n' "$BURN_GRAPHED_AUTOTUNE_LOG" >> "$env_dir/cubecl.toml"
  fi
  # BURN_GRAPHED_COMPILE_LOG=FILE: cubecl's compilation log at level basic (a line per kernel
  # it compiles, none for one it loads from the cache) appended to FILE (an absolute path).
  if [ -n "${BURN_GRAPHED_COMPILE_LOG:-}" ]; then
    printf '[compilation.logger]\nlevel = "basic"\nappend = true\nfile = "%s"\n' "$BURN_GRAPHED_COMPILE_LOG" >> "$env_dir/cubecl.toml"
  fi
  export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$env_dir/nv}" CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-4294967296}"
}

# The settings of `bench` and `warm` for a dtype ($1): cubecl's autotune `level` (bf16 with
# cubecl's default autotune compiles too many candidates to finish in a 10-minute command,
# BENCHMARKS.md; CUBECL_AUTOTUNE_LEVEL set by the caller wins) and `maths`, the f32 arithmetic
# of matrix products, the same on both sides: plain f32 ("off", the default) or TF32 ("on":
# Burn's `allow_tf32(true)`, PyTorch's `--tf32`); BURN_GRAPHED_TF32="off on" runs both, bf16
# runs "off" (nothing of it is TF32).
dtype_settings() {
  level="${CUBECL_AUTOTUNE_LEVEL:-}"
  [ "$1" = bf16 ] && [ -z "$level" ] && level=minimal
  maths=off
  [ "$1" = f32 ] && maths="${BURN_GRAPHED_TF32:-off}"
  local math
  for math in $maths; do
    case "$math" in
      off | on) ;;
      *) echo "run.sh: BURN_GRAPHED_TF32 takes off and on, not $math"; exit 2 ;;
    esac
  done
}

# NVRTC and the driver are loaded at run time; make the usual CUDA locations visible.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

# NCCL, for runs on several GPUs: cudarc loads `libnccl.so` at run time, while pip's
# nvidia-nccl wheel (PyTorch's) and Debian's libnccl2 ship `libnccl.so.2` only. The first NCCL
# found (BURN_GRAPHED_NCCL=PATH when set; else ldconfig's, the nvidia-nccl wheel's of python3,
# the usual folders) is linked as `libnccl.so` in a folder of this run on LD_LIBRARY_PATH.
# Sets nccl_status, and returns 1 when there is none. NVLink multicast stays off unless the
# caller sets NCCL_NVLS_ENABLE.
nccl_setup() {
  local found="" candidate
  if [ -n "${BURN_GRAPHED_NCCL:-}" ]; then
    [ -f "$BURN_GRAPHED_NCCL" ] || { nccl_status="BURN_GRAPHED_NCCL=$BURN_GRAPHED_NCCL is not a file"; return 1; }
    found="$BURN_GRAPHED_NCCL"
  else
    for candidate in \
      $(ldconfig -p 2>/dev/null | awk '/libnccl\.so/ {print $NF}') \
      $(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null) \
      /usr/lib/x86_64-linux-gnu/libnccl.so.2 /usr/local/cuda/lib64/libnccl.so.2; do
      [ -f "$candidate" ] && { found="$candidate"; break; }
    done
  fi
  if [ -z "$found" ]; then
    nccl_status="no NCCL library (libnccl.so or libnccl.so.2) found: pip install nvidia-nccl-cu12, apt install libnccl2, or set BURN_GRAPHED_NCCL=PATH; runs on several GPUs cannot load it"
    return 1
  fi
  mkdir -p "$work/nccl" && ln -sf "$found" "$work/nccl/libnccl.so"
  export LD_LIBRARY_PATH="$work/nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
  nccl_status="NCCL: $found (as $work/nccl/libnccl.so)"
}
nccl_setup

repo="${BURN_GRAPHED_REPO:-$(cd "$here/../.." && pwd)}"
# Snapshot tests (insta) compare, never write, and find their files in the checkout.
export INSTA_WORKSPACE_ROOT="$repo" INSTA_UPDATE=no
[ -d "$repo/tests/scenarios/snapshots" ] || echo "run.sh: no snapshots under $repo (set BURN_GRAPHED_REPO)"

case "$mode" in
  tests)
    bin="$(unpack test-gpu.xz)" || { echo "0 passed, 1 failed"; exit 1; }
    shift $(( $# > 0 ? 1 : 0 ))
    jobs="${BURN_GRAPHED_JOBS:-1}" from="" rest_logs=() chosen=0 only_ledger=0 ledger_asked=0
    # Each test's result, from the logs (one test at a time per log), as
    # "NAME<tab>RESULT<tab>COMMIT | DEVICE | DATE" (from the log's first line; "unknown" for a
    # log without it) into the file $1: RESULT is passed, failed, "ignored[: REASON]",
    # "skipped: REASON" (a test that printed `skipped: NAME: REASON`, tests/scenarios/skip.rs:
    # it could not run its checks on this machine, and libtest counted it as passed),
    # "reproduced: WHAT" (a hand-run reproduction of an upstream bug showed the bug; its
    # watchdog ends the process), or "no result" (started, then cut off or crashed). A result is on the test's own line or on a
    # bare ok/FAILED line after its output. Prints the number of skip lines of tests that did
    # not fail, which libtest counted as passed.
    log_results() {
      local into="$1"; shift
      : >"$into"
      [ $# -gt 0 ] || { echo 0; return; }
      awk -v results="$into" '
        function set(name, result) {
          if (!(name in result_of)) order[++n] = name
          result_of[name] = result; run_at[name] = at
        }
        FNR == 1 {
          pending = ""; at = "unknown | unknown device | unknown"
          if ($0 ~ /^\[run\.sh: bundle [^ ]+ on .*, [0-9-]+\]$/) {
            stamp = substr($0, 17, length($0) - 17); on = index(stamp, " on ")
            where = substr(stamp, on + 4); comma = match(where, /, [0-9-]+$/)
            at = substr(stamp, 1, on - 1) " | " substr(where, 1, comma - 1) " | " substr(where, comma + 2)
          }
        }
        {
          line = $0
          if (match(line, /skipped: [A-Za-z0-9_:]+: /)) {
            name = substr(line, RSTART + 9, RLENGTH - 11)
            if (!(name in skip)) skips[++s] = name
            skip[name] = substr(line, RSTART + RLENGTH); skip_at[name] = at
            line = substr(line, 1, RSTART - 1)
          }
          if (line ~ /^test [^ ]+ \.\.\. /) {
            split(line, field, " ")
            name = field[2]; rest = substr(line, length(name) + 11); pending = ""
            if (rest == "ok") set(name, "passed")
            else if (rest == "FAILED") set(name, "failed")
            else if (rest ~ /^ignored/) { sub(/^ignored(, )?/, "", rest); set(name, rest == "" ? "ignored" : "ignored: " rest) }
            else { pending = name; set(name, "no result") }
          } else if (pending != "" && (line == "ok" || line == "FAILED")) {
            set(pending, line == "ok" ? "passed" : "failed"); pending = ""
          } else if (pending != "" && line ~ /^reproduced: /) {
            # A hand-run reproduction of an upstream bug (tests/gpu.rs, UPSTREAM.md): its
            # watchdog printed this and ended the process.
            set(pending, line); pending = ""
          }
        }
        END {
          for (i = 1; i <= s; i++) {
            name = skips[i]
            if (result_of[name] == "failed") continue
            count++
            if (!(name in result_of)) { order[++n] = name; run_at[name] = skip_at[name] }
            result_of[name] = "skipped: " skip[name]
          }
          for (i = 1; i <= n; i++) {
            result = result_of[order[i]]; gsub(/\|/, "\\|", result)
            print order[i] "\t" result "\t" run_at[order[i]] > results
          }
          close(results)
          print count + 0
        }' "$@"
    }
    while [ $# -gt 0 ]; do
      case "$1" in
        --jobs) jobs="${2:?run.sh tests --jobs needs a number}"; shift 2 ;;
        --from) from="${2:?run.sh tests --from needs a test name}"; chosen=1; shift 2 ;;
        --rest|--ledger)
          # --rest LOG...: the tests that these logs (of earlier runs, e.g. cut off by a time
          # limit) show no result for; the logs end at the next option. --ledger LOG...: none
          # of them; the counts and the ledger from the logs alone.
          [ "$1" = --ledger ] && ledger_asked=1
          shift
          while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do rest_logs+=("$1"); shift; done
          [ ${#rest_logs[@]} -eq 0 ] && { echo "run.sh: tests --rest needs log files"; exit 2; }
          chosen=1 ;;
        *) break ;;
      esac
    done
    case "$jobs" in ''|*[!0-9]*|0) echo "run.sh: --jobs takes a positive number, not '$jobs'"; exit 2 ;; esac
    # The --rest logs as they are now, for the ledger: this run's logs may replace them (the
    # same $OUT).
    earlier_logs=()
    for ((k = 0; k < ${#rest_logs[@]}; k++)); do
      cp "${rest_logs[k]}" "$work/earlier-$k.log" 2>/dev/null && earlier_logs+=("$work/earlier-$k.log")
    done
    [ "$jobs" -gt 1 ] && chosen=1
    # Chosen tests: names (substrings, as libtest takes them) given after the options; with
    # several processes they restrict the list that the processes share, rather than going to
    # every process (which would run each chosen test in each). Arguments from the first one
    # starting with `-` on go to the test binary.
    picks=()
    if [ "$chosen" -eq 1 ]; then
      while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do picks+=("$1"); shift; done
    fi
    names=()
    if [ "$chosen" -eq 1 ]; then
      # The names, sorted as libtest runs them; BURN_GRAPHED_FILTER as a substring, as libtest
      # would take it; --from: NAME and every later name; --rest: those without a result.
      mapfile -t names < <("$bin" --list 2>/dev/null | sed -n 's/: test$//p' | LC_ALL=C sort |
        LC_ALL=C awk -v from="$from" -v filter="${BURN_GRAPHED_FILTER:-}" -v picks="${picks[*]}" \
          'BEGIN { n = split(picks, pick, " ") }
           {
             chosen = (n == 0)
             for (i = 1; i <= n; i++) if (index($0, pick[i])) chosen = 1
             if (chosen && index($0, filter) && $0 >= from) print
           }')
      if [ ${#rest_logs[@]} -gt 0 ]; then
        # A test has a result when `log_results` finds one for it (anything but "no result").
        done_file="$work/done"
        log_results "$work/rest-results" "${rest_logs[@]}" >/dev/null ||
          { echo "run.sh: cannot read ${rest_logs[*]}"; exit 2; }
        awk -F'\t' '$2 != "no result" { print $1 }' "$work/rest-results" >"$done_file"
        mapfile -t names < <(printf '%s\n' "${names[@]}" | LC_ALL=C grep -vxF -f "$done_file")
      fi
      if [ "$ledger_asked" -eq 1 ] || [ ${#names[@]} -eq 0 ] || [ -z "${names[0]}" ]; then
        # Every test has a result in the --rest logs: nothing runs, and the ledger and the
        # counts come from those logs (each result at its own log's commit and device).
        [ ${#rest_logs[@]} -gt 0 ] || { echo "run.sh: no test left to run"; exit 2; }
        only_ledger=1
        if [ "$ledger_asked" -eq 1 ]; then
          echo "run.sh: --ledger: nothing runs; the counts and the GPU ledger are the logs' (${#names[@]} tests without a result in them)"
        else
          echo "run.sh: every test has a result in the logs given to --rest: nothing to run; the counts and the GPU ledger are theirs"
        fi
      fi
    fi
    # Logs go straight to $OUT when it is set, so that a run cut off by a time limit leaves
    # them (and `--rest` can take them up).
    logdir="${OUT:-$work}"
    mkdir -p "$logdir"
    logs=()
    if [ "$only_ledger" -eq 1 ]; then
      logs=("${earlier_logs[@]}") rc=0
      stamp="[run.sh: counts of ${#logs[@]} earlier logs, $(date -u +%Y-%m-%d)]"
    else
      start=$(date +%s)
      if [ "$jobs" -eq 1 ]; then logs=("$logdir/gpu-tests.log"); else
        for ((j = 1; j <= jobs; j++)); do logs+=("$logdir/gpu-tests-$j.log"); done
      fi
      # Each log starts with what ran where: the bundle's commit, the device, the date (UTC),
      # which the GPU ledger reads back from logs given to --rest.
      commit="$(sed -n 's/.*"commit": *"\([^"]*\)".*/\1/p' "$here/manifest.json" 2>/dev/null | head -n 1)"
      device="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null |
        awk 'NF { n++; name = $0 } END { if (n > 1) print n " x " name; else if (n) print name }')"
      stamp="[run.sh: bundle ${commit:-unknown} on ${device:-unknown device}, $(date -u +%Y-%m-%d)]"
      echo "$stamp"
      for log in "${logs[@]}"; do printf '%s\n' "$stamp" >"$log"; done
      # A line with the seconds since the start every BURN_GRAPHED_HEARTBEAT seconds (default
      # 60) in every log, so that a log cut off by a time limit tells a slow test from a stuck
      # one.
      # The sleep runs in the background of the loop so that the kill below ends it too, and
      # without the caller's output: a TERM between `sleep &` and `nap=$!` (the trap runs
      # between the two) leaves it behind, and with the output it would hold the caller's
      # pipe open until it ran out (an xtask test waited out a 600 s heartbeat that way).
      # Its own EXIT trap reset: bash may run the script's (which removes $work) in a subshell
      # that a TERM trap ends.
      (trap - EXIT; trap 'kill "$nap" 2>/dev/null; exit 0' TERM
       while :; do
         sleep "${BURN_GRAPHED_HEARTBEAT:-60}" </dev/null >/dev/null 2>&1 & nap=$!
         wait "$nap"
         line="[run.sh: $(( $(date +%s) - start ))s]"
         printf '\n%s\n' "$line"
         for log in "${logs[@]}"; do printf '\n%s\n' "$line" >>"$log"; done
       done) &
      beat=$!
      rc=0
      if [ "$jobs" -eq 1 ]; then
        args=(--test-threads=1)
        if [ "$chosen" -eq 1 ]; then args+=(--exact "${names[@]}")
        elif [ -n "${BURN_GRAPHED_FILTER:-}" ]; then args+=("$BURN_GRAPHED_FILTER"); fi
        (cd "$repo" && "$bin" "${args[@]}" "$@" --nocapture) 2>&1 | tee -a "${logs[0]}"
        rc=${PIPESTATUS[0]}
      else
        # --jobs N: N test processes at once, test i in share i mod N (sorted
        # names, so that the slow tests spread), each one test at a time with a log of its own;
        # the terminal shows each share's lines prefixed with [share]. NVRTC compiles every
        # kernel once per process, on the CPU, so two processes take well under the time of one.
        # On a machine with several GPUs, share j's device 0 is GPU (j - 1) mod G: the shares
        # spread over the GPUs, and each still sees them all (CUDA_VISIBLE_DEVICES rotated), so
        # that the tests of several GPUs run in any share.
        # nvidia-smi numbers the GPUs in PCI order, which CUDA then follows too.
        gpus=()
        if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
        else
          mapfile -t gpus < <(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9]*\):.*/\1/p')
          [ ${#gpus[@]} -gt 1 ] && export CUDA_DEVICE_ORDER=PCI_BUS_ID
        fi
        pids=()
        for ((j = 1; j <= jobs; j++)); do
          share=()
          for ((k = j - 1; k < ${#names[@]}; k += jobs)); do share+=("${names[k]}"); done
          [ ${#share[@]} -eq 0 ] && continue
          if [ ${#gpus[@]} -gt 1 ]; then
            first=$(( (j - 1) % ${#gpus[@]} ))
            rotated=("${gpus[@]:first}" "${gpus[@]:0:first}")
            visible="$(IFS=,; echo "${rotated[*]}")"
          else visible="${CUDA_VISIBLE_DEVICES-}"; fi
          ( [ -n "$visible" ] && export CUDA_VISIBLE_DEVICES="$visible"
            (cd "$repo" && "$bin" --test-threads=1 --exact "${share[@]}" "$@" --nocapture) 2>&1 |
              tee -a "${logs[j - 1]}" | sed -u "s/^/[$j] /"
            exit "${PIPESTATUS[0]}") &
          pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
      fi
      kill "$beat" 2>/dev/null
      wait "$beat" 2>/dev/null
    fi
    # The summaries of every log summed ("test result: ok. 16 passed; 0 failed; 2 ignored; ..."),
    # one read.
    read -r passed failed ignored < <(awk '/^test result:/ {
        for (i = 1; i < NF; i++) {
          if ($(i + 1) ~ /^passed/) p += $i; if ($(i + 1) ~ /^failed/) f += $i
          if ($(i + 1) ~ /^ignored/) g += $i
        }
      } END { print p + 0, f + 0, g + 0 }' "${logs[@]}")
    results="$work/results"
    skipped_passes=$(log_results "$results" "${logs[@]}")
    passed=$(( passed > skipped_passes ? passed - skipped_passes : 0 ))
    skipped=$(( ignored + skipped_passes ))
    if [ "$only_ledger" -eq 1 ]; then
      # Counted test by test: a log cut off by a time limit has no summary line.
      read -r passed failed skipped < <(awk -F'\t' '$2 == "passed" { p++ }
          $2 == "failed" || $2 == "no result" { f++ } $2 ~ /^(skipped|ignored|reproduced)/ { s++ }
          END { print p + 0, f + 0, s + 0 }' "$results")
    fi
    if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
      failed=1 # a test binary died before libtest could report
      echo "gpu suite: a test binary exited with a failure status before reporting"
    fi
    summary="$passed passed, $failed failed, $skipped skipped"
    echo "$summary"
    if [ "$skipped" -gt 0 ]; then
      echo "skipped tests (ignored, or unable to run their checks here):"
      awk -F'\t' '$2 ~ /^(skipped|ignored|reproduced)/ { gsub(/\\\|/, "|", $2); print "  " $1 ": " $2 }' "$results"
    fi
    # The GPU ledger (tests/gpu-ledger.md): every test of the binary with its last result,
    # the bundle's commit, the device and the date. The rows of the tests this run ran are
    # replaced; the others keep what BURN_GRAPHED_LEDGER (default: the checkout's
    # tests/gpu-ledger.md) says, so that runs in several calls (--rest, a filter) add up.
    # Written to $OUT/gpu-ledger.md when OUT is set (copy it over tests/gpu-ledger.md), else
    # over BURN_GRAPHED_LEDGER.
    ledger_in="${BURN_GRAPHED_LEDGER:-$repo/tests/gpu-ledger.md}"
    ledger_out="$ledger_in"
    [ -n "${OUT:-}" ] && ledger_out="$OUT/gpu-ledger.md"
    if [ -d "$(dirname "$ledger_out")" ]; then
      "$bin" --list 2>/dev/null | sed -n 's/: test$//p' | LC_ALL=C sort >"$work/names"
      # The results of the logs given to --rest first (tests of an earlier call that a time
      # limit cut off, which this call does not run again), then this call's.
      log_results "$work/earlier" ${earlier_logs[@]+"${earlier_logs[@]}"} >/dev/null
      awk -F'\t' -v base="$ledger_in" -v summary="$summary" -v stamp="$stamp" '
          FILENAME != ARGV[ARGC - 1] { ran[$1] = $2 " | " $3; next }
          {
            if ($1 in ran) row = ran[$1]
            else if ($1 in kept) row = kept[$1]
            else row = "not run | - | - | -"
            rows[++n] = "| `" $1 "` | " row " |"
            kind = row; sub(/[: |].*/, "", kind); sub(/^no$/, "no result", kind); sub(/^not$/, "not run", kind)
            if (!(kind in count)) kinds[++k] = kind
            count[kind]++
          }
          BEGIN {
            # The base ledger'"'"'s rows: "| `NAME` | RESULT | COMMIT | DEVICE | DATE |".
            while ((getline line < base) > 0) {
              if (line !~ /^\| `/) continue
              sub(/^\| `/, "", line); sub(/ \|$/, "", line)
              split(line, cell, / \| /); name = cell[1]; sub(/`$/, "", name)
              if (cell[2] != "not run") kept[name] = cell[2] " | " cell[3] " | " cell[4] " | " cell[5]
            }
          }
          END {
            print "# GPU ledger"
            print ""
            print "Every test of the GPU suite (`tests/gpu.rs`, the bundle'"'"'s `test-gpu`) with its last"
            print "result on a GPU, the commit of the bundle it ran in, the device and the date (UTC)."
            print "Written by `run.sh tests` (tests/README.md, \"GPU ledger\"): a run replaces the rows of"
            print "the tests it ran and keeps the others. Results: passed; failed; `skipped: REASON` (the"
            print "test could not run its checks on that machine: nothing was checked); `ignored: REASON`"
            print "(`#[ignore]`: run by hand); `reproduced: WHAT` (a hand-run reproduction of an upstream"
            print "bug, UPSTREAM.md, showed it); no result (started, then cut off or crashed); not run (in"
            print "no recorded run)."
            print ""
            totals = ""
            for (i = 1; i <= k; i++) totals = totals (i > 1 ? ", " : "") count[kinds[i]] " " kinds[i]
            print n " tests: " totals ". Last run: " summary " " stamp "."
            print ""
            print "| test | result | commit | device | date |"
            print "| --- | --- | --- | --- | --- |"
            for (i = 1; i <= n; i++) print rows[i]
          }' "$work/earlier" "$results" "$work/names" >"$work/ledger" && cp "$work/ledger" "$ledger_out" &&
        echo "run.sh: GPU ledger: $ledger_out"
    else
      echo "run.sh: no GPU ledger written: no folder $(dirname "$ledger_out") (set OUT or BURN_GRAPHED_LEDGER)"
    fi
    [ "$rc" -eq 0 ] && [ "$failed" -eq 0 ]
    ;;
  nccl)
    echo "run.sh: $nccl_status"
    case "$nccl_status" in
      NCCL:*) echo "run.sh: libnccl.so on LD_LIBRARY_PATH -> $(readlink -f "$work/nccl/libnccl.so")"; exit 0 ;;
      *) exit 1 ;;
    esac
    ;;
  demo)
    bin="$(unpack example-train_mlp.xz)" || exit 1
    shift
    "$bin" "$@"
    ;;
  bench)
    bin="$(unpack bench-train_step.xz)" || { echo "no benchmark in this bundle"; exit 1; }
    shift
    # Straight into $OUT when it is set (emptied first: one file per call), so that a run cut
    # off by a time limit leaves the rows it finished.
    results="${OUT:-$work}/bench.jsonl"
    mkdir -p "$(dirname "$results")" && : >"$results"
    cubecl_env
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# device: /' | tee -a "$results"
    # Rounds alternate the two sides, so that both see the same drift of the machine; the
    # report takes the median over rounds. Every round's Burn processes check their values
    # (with BURN_GRAPHED_TUNE=fresh each round runs other kernels): a failed check leaves a
    # failure row instead of a timing row.
    rounds="${BURN_GRAPHED_ROUNDS:-1}"
    for ((round = 1; round <= rounds; round++)); do
      [ "$rounds" -gt 1 ] && echo "# round: $round" | tee -a "$results"
      for dtype in ${BURN_GRAPHED_DTYPES:-f32 bf16}; do
        dtype_settings "$dtype"
        for math in $maths; do
          tf32=()
          [ "$math" = on ] && tf32=(--tf32)
          for side in ${BURN_GRAPHED_SIDES:-burn torch}; do
            case "$side" in
              burn) (cd "$env_dir" && CUBECL_AUTOTUNE_LEVEL="$level" "$bin" --dtype "$dtype" --tf32 "$math" "$@") 2>&1 | tee -a "$results" ;;
              torch) python3 "$here/torch_reference.py" --dtype "$dtype" "$@" ${tf32[@]+"${tf32[@]}"} 2>&1 | tee -a "$results" ;;
              *) echo "run.sh: BURN_GRAPHED_SIDES takes burn and torch, not $side"; exit 2 ;;
            esac
          done
        done
      done
    done
    ;;
  warm)
    # Untimed, all at once: compiles into the cubecl environment of `bench` (the same
    # BURN_GRAPHED_CUBECL_ENV, dtypes and TF32 setting) the kernels that `bench --models M
    # --modes ...` will load, one Burn process per (dtype, TF32 setting, model, group of modes),
    # so that NVRTC works on every core; `--modes` takes groups joined by "+" (each a list of
    # modes run in turn by one process). Each process runs its modes once, value checks
    # included (they compile eager kernels too), and keeps no autotune results when
    # BURN_GRAPHED_TUNE=fresh: a later `bench` still tunes afresh. Logs to $OUT/warm/.
    bin="$(unpack bench-train_step.xz)" || { echo "no benchmark in this bundle"; exit 1; }
    shift
    models="mlp,mlp256,cnn,transformer,lm" groups="whole_step,whole_step_floor"
    while [ $# -gt 0 ]; do
      case "$1" in
        --models) models="${2:?run.sh warm --models needs a list}"; shift 2 ;;
        --modes) groups="${2:?run.sh warm --modes needs a list}"; shift 2 ;;
        *) echo "run.sh warm takes --models and --modes, not $1"; exit 2 ;;
      esac
    done
    cubecl_env
    logs="${OUT:-$work}/warm"
    mkdir -p "$logs"
    started=$(date +%s)
    for dtype in ${BURN_GRAPHED_DTYPES:-f32 bf16}; do
      dtype_settings "$dtype"
      for math in $maths; do
        for model in ${models//,/ }; do
          for modes in ${groups//+/ }; do
            tag="$dtype-tf32$math-$model-${modes%%,*}"
            ( (cd "$env_dir" && CUBECL_AUTOTUNE_LEVEL="$level" "$bin" --dtype "$dtype" --tf32 "$math" \
                 --models "$model" --modes "$modes" --reps 1 --steps 2) >"$logs/$tag.txt" 2>&1
              echo "$tag: exit $? after $(( $(date +%s) - started )) s, $(grep -c '"median_us"' "$logs/$tag.txt") rows, $(grep -c '"error"' "$logs/$tag.txt") failures" ) &
          done
        done
      done
    done
    wait
    echo "run.sh warm: done after $(( $(date +%s) - started )) s"
    ;;
  busy)
    # How busy the GPU is during each side's bench run of each mode: nvidia-smi samples, every
    # 100 ms, the share of the last sample period in which a kernel ran, and the SM clock. A
    # step near 100% is bound by the device; well under, by the host. Real clocks, unlike
    # ncu's serialized launches. One sampling window per mode and side, so that two modes of
    # one side never share a median (a side skips the modes it does not know); one model per
    # call, --no-check and many reps (e.g. --reps 200), on a machine whose cubecl cache is warm
    # (compilation's idle gaps would dilute the median). The rows and busy lines also go to
    # $OUT/busy.jsonl (or a temporary file), emptied per call.
    shift
    command -v nvidia-smi >/dev/null 2>&1 || { echo "run.sh busy: no nvidia-smi"; exit 1; }
    modes="" args=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --modes) modes="${2:?run.sh busy --modes needs a list}"; shift 2 ;;
        *) args+=("$1"); shift ;;
      esac
    done
    [ -z "$modes" ] && { echo "run.sh busy: give --modes (one sampling window per side and mode)"; exit 2; }
    busy_log="${OUT:-$work}/busy.jsonl"
    mkdir -p "$(dirname "$busy_log")" && : >"$busy_log"
    for mode in ${modes//,/ }; do
      for side in ${BURN_GRAPHED_SIDES:-burn torch}; do
        smi="$work/smi_${side}_$mode.csv" rows="$work/busy_${side}_$mode"
        nvidia-smi --query-gpu=utilization.gpu,clocks.sm --format=csv,noheader,nounits -lms 100 >"$smi" &
        sampler=$!
        # Its own OUT: `bench` empties its bench.jsonl per call.
        mkdir -p "$rows"
        OUT="$rows" BURN_GRAPHED_SIDES="$side" BURN_GRAPHED_DTYPES="${BURN_GRAPHED_DTYPES:-f32}" \
          BURN_GRAPHED_ROUNDS=1 bash "$here/run.sh" bench ${args[@]+"${args[@]}"} --modes "$mode"
        kill "$sampler" 2>/dev/null
        wait "$sampler" 2>/dev/null
        if ! grep -q '"median_us"' "$rows/bench.jsonl"; then
          echo "# busy: $side $mode: no row (not a mode of this side, or the run failed)" | tee -a "$busy_log"
          continue
        fi
        grep -v '^# device' "$rows/bench.jsonl" >>"$busy_log"
        python3 - "$smi" "$side $mode" <<'PY' | tee -a "$busy_log"
import sys
rows = [l.split(",") for l in open(sys.argv[1]) if l.count(",") == 1]
busy = sorted((float(u), float(c)) for u, c in rows if float(u) > 5)
if busy:
    mid = busy[len(busy) // 2]
    clock = sorted(c for _, c in busy)[len(busy) // 2]
    print(f"# busy: {sys.argv[2]}: GPU utilization median {mid[0]:.0f}% over {len(busy)} "
          f"samples with a kernel running (of {len(rows)}), SM clock median {clock:.0f} MHz")
else:
    print(f"# busy: {sys.argv[2]}: no sample with a kernel running (of {len(rows)})")
PY
      done
    done
    ;;
  profile)
    bin="$(unpack bench-train_step.xz)" || { echo "no benchmark in this bundle"; exit 1; }
    shift
    args=("$@")
    [ ${#args[@]} -eq 0 ] && args=(--models mlp --steps 50 --reps 4)
    dest="${OUT:-$work}"
    dest="$(mkdir -p "$dest" && cd "$dest" && pwd)" # absolute: the loop runs in $env_dir
    cubecl_env # the same compiled kernels and autotune results as `bench`
    cd "$env_dir" || exit 1
    dtype="${PROFILE_DTYPE:-f32}"
    # bf16 with the autotune level `bench` uses for it, so that the profile sees its kernels.
    [ "$dtype" = bf16 ] && export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-minimal}"
    for d in /usr/local/cuda/bin /opt/nvidia/nsight-systems/*/bin /opt/nvidia/nsight-compute/* /usr/local/cuda/nsight-systems*/bin; do
      [ -d "$d" ] && PATH="$PATH:$d"
    done
    for mode in ${PROFILE_MODES:-eager graphed}; do
      if command -v nsys >/dev/null 2>&1; then
        for side in ${PROFILE_SIDES:-burn torch}; do
          if [ "$side" = burn ]; then cmd=("$bin" --in-process); else cmd=(python3 "$here/torch_reference.py" --in-process); fi
          nsys profile --trace=cuda --cuda-graph-trace=node --force-overwrite=true \
            --capture-range=cudaProfilerApi --capture-range-end=stop \
            -o "$work/${side}_$mode" "${cmd[@]}" --dtype "$dtype" --modes "$mode" "${args[@]}" \
            > "$dest/${side}_$mode.jsonl" 2>"$dest/${side}_$mode.err"
          nsys stats --report "${PROFILE_REPORTS:-cuda_gpu_kern_sum,cuda_api_sum}" --format csv \
            --output "$dest/${side}_$mode" "$work/${side}_$mode.nsys-rep" >/dev/null 2>&1
        done
      elif command -v ncu >/dev/null 2>&1; then
        for side in ${PROFILE_SIDES:-burn torch}; do
          if [ "$side" = burn ]; then cmd=("$bin" --in-process); else cmd=(python3 "$here/torch_reference.py" --in-process); fi
          ncu --graph-profiling "${PROFILE_GRAPHS:-graph}" --metrics gpu__time_duration.sum --csv \
            --profile-from-start off --clock-control "${PROFILE_CLOCKS:-base}" --cache-control none --launch-count "${PROFILE_COUNT:-300}" \
            "${cmd[@]}" --dtype "$dtype" --modes "$mode" "${args[@]}" \
            > "$dest/${side}_$mode.ncu.csv" 2>"$dest/${side}_$mode.err"
        done
      else
        echo "run.sh profile: neither nsys nor ncu found"; exit 1
      fi
    done
    ls -la "$dest"
    ;;
  *)
    echo "usage: run.sh [tests|demo|bench|busy|nccl|profile]"; exit 2;;
esac
