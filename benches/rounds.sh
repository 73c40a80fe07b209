#!/usr/bin/env bash
# The whole-step and inference tables of BENCHMARKS.md on one machine of several GPUs: groups
# of `run.sh bench` runs at once, one group per GPU, each in a cubecl environment of its own
# with fresh tunings (BURN_GRAPHED_TUNE=fresh), in alternating rounds of both sides, every
# Burn run value-checked. Every group stops at LIMIT_S, keeping the rows it finished; then the
# rows of all groups go to $OUT/<table>.jsonl and their logs to $OUT/<table>_logs.tar.xz. Run
# it from the checkout that holds the bundle (`cargo xtask gpu-test`).
#
#   bash benches/rounds.sh whole_step   # GPUs 0-3: the whole-step table, f32 and bf16
#   bash benches/rounds.sh inference    # GPUs 0-3: the inference table, f32 and bf16
#   bash benches/rounds.sh all          # both, each group's models in both tables' modes
#   ROUND_GROUPS="bf16 mlp|f32 cnn" bash benches/rounds.sh groups  # chosen groups, both tables
#   bash benches/rounds.sh fused        # mlp, transformer, lm: burn-nn layers, fused layers, PyTorch
#   ROUND_GROUPS="f32 lm,lm_fused" bash benches/rounds.sh fused  # chosen fused groups
#
# cubecl's autotune log of each group goes into the logs too: which candidate won each matmul
# key (a tensor-core candidate, `*mma*`, runs f32 as TF32).
#
# Environment: ROUNDS (default 2), LIMIT_S (seconds each group may take, default 560), OUT.
set -uo pipefail
what="${1:?usage: rounds.sh whole_step|inference|all|fused|groups}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
rounds="${ROUNDS:-2}" limit="${LIMIT_S:-560}"
bundle="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/gpu-bundle/run.sh"
whole_step=whole_step,whole_step_floor,graphed_loss_fused_adam,whole_step_fused_adam,whole_step_floor_fused_adam
inference=inference,inference_graphed,inference_b1,inference_graphed_b1,inference_graphed_b1_floor
case "$what" in
  whole_step)
    modes=$whole_step
    groups=("f32 mlp,mlp256" "f32 cnn,transformer" "f32 lm;bf16 mlp,mlp256" "bf16 transformer,lm") ;;
  inference)
    modes=$inference
    groups=("f32 mlp,mlp256;bf16 mlp,mlp256" "f32 cnn;bf16 lm" "f32 transformer" "f32 lm;bf16 transformer") ;;
  all)
    modes=$whole_step,$inference
    groups=("f32 mlp,mlp256;bf16 mlp,mlp256" "f32 cnn,transformer" "f32 lm;bf16 lm" "bf16 transformer") ;;
  fused)
    # burn_graphed::nn's fused layers against the same models with burn-nn's layers and
    # PyTorch (report.py's fused_layers and inference_fused tables).
    modes=whole_step,whole_step_floor,whole_step_fused_adam,inference_graphed,inference_graphed_b1,inference_graphed_b1_floor
    groups=("f32 transformer,transformer_fused" "f32 lm,lm_fused" "bf16 transformer,transformer_fused;bf16 lm,lm_fused" "f32 mlp,mlp_fused;bf16 mlp,mlp_fused")
    # On fewer GPUs: ROUND_GROUPS chooses the groups ("DTYPE MODELS[;...]|..."), one per GPU.
    [ -n "${ROUND_GROUPS:-}" ] && IFS='|' read -ra groups <<<"$ROUND_GROUPS" ;;
  groups)
    # The gaps of an earlier run: ROUND_GROUPS="DTYPE MODELS[;...]|DTYPE MODELS|...", one
    # group per GPU, in both tables' modes.
    modes=$whole_step,$inference
    IFS='|' read -ra groups <<<"${ROUND_GROUPS:?rounds.sh groups needs ROUND_GROUPS}" ;;
  *) echo "rounds.sh: whole_step, inference, all, fused or groups, not $what"; exit 2 ;;
esac
# A group: "DTYPE MODELS[;DTYPE MODELS...]", run in turn on one GPU, in one cubecl environment.
run_group() {
  local gpu="$1" group="$2" env part dtype models
  env="$(mktemp -d)"
  IFS=';' read -ra parts <<<"$group"
  for part in "${parts[@]}"; do
    read -r dtype models <<<"$part"
    # Every kernel compiled first, untimed and in parallel (`run.sh warm`); the rounds load them.
    CUDA_VISIBLE_DEVICES="$gpu" BURN_GRAPHED_CUBECL_ENV="$env" BURN_GRAPHED_TUNE=fresh \
      BURN_GRAPHED_DTYPES="$dtype" OUT="$work/gpu$gpu-$dtype-warm" \
      bash "$bundle" warm --models "$models" --modes "$modes" >"$work/gpu$gpu-$dtype-warm.log" 2>&1
    CUDA_VISIBLE_DEVICES="$gpu" BURN_GRAPHED_CUBECL_ENV="$env" BURN_GRAPHED_TUNE=fresh \
      BURN_GRAPHED_ROUNDS="$rounds" BURN_GRAPHED_DTYPES="$dtype" OUT="$work/gpu$gpu-$dtype" \
      BURN_GRAPHED_AUTOTUNE_LOG="$work/gpu$gpu-$dtype-autotune.txt" \
      bash "$bundle" bench --models "$models" --reps 10 --steps 30 --modes "$modes" \
      >"$work/gpu$gpu-$dtype.log" 2>&1
  done
}
work="$(mktemp -d)"
export -f run_group
export rounds modes work bundle
for ((gpu = 0; gpu < ${#groups[@]}; gpu++)); do
  timeout "$limit" bash -c 'run_group "$0" "$1"' "$gpu" "${groups[gpu]}" &
done
wait
# Into $OUT: one results file (every group's rows, the device line once) and the logs.
cat "$work"/gpu*/bench.jsonl | awk '!(/^# device/ && seen++)' >"$out/$what.jsonl"
tar -C "$work" -cJf "$out/${what}_logs.tar.xz" $(cd "$work" && ls)
echo "rows with times: $(grep -c '"median_us"' "$out/$what.jsonl")"
echo "failure rows: $(grep -c '"error"' "$out/$what.jsonl")"
grep '"error"' "$out/$what.jsonl"
