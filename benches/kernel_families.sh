#!/bin/bash
# Device time by kernel family, both sides: BENCHMARKS.md's "Device time by kernel family".
# Runs from the repository root of a checkout on a GPU machine with the bundle built
# (`cargo xtask gpu-test`) and Nsight Compute installed:
#
#   DTYPES="f32 bf16" OUT=$PWD/out bash benches/kernel_families.sh
#
# For each dtype and model of MODELS: Burn's whole step with burn-nn's layers and with
# burn_graphed::nn's (`MODEL_fused`), and PyTorch's whole-network capture with fused
# capturable Adam; then the inference calls of INFER (dtype/model), both sides. Each Burn model
# first runs a plain bench (its tuning, outside the profiler; picks kept in the cubecl
# environment, and value-checked), then `run.sh profile` with each graph's kernels profiled one
# by one; `benches/ncu_summary.py --rows` turns each profile into a row of $OUT/families.jsonl
# (labelled with the profiled process's bench row and its value check). SKIP_NN="dtype/model
# ..." leaves burn-nn's layers out (bf16/cnn always: it does not train correctly on CUDA,
# UPSTREAM.md 1); SIDES ("burn torch" by default) the sides profiled, e.g. SIDES=burn to
# profile Burn's new kernels against PyTorch rows of an earlier file; DEADLINE (seconds) skips
# what would start after it. Profiles and logs stay under $OUT/prof.
set -u
B=target/gpu-bundle/run.sh
OUT=${OUT:?set OUT to a folder for the results}
export BURN_GRAPHED_CUBECL_ENV=${BURN_GRAPHED_CUBECL_ENV:-$PWD/target/bench-env}
mkdir -p "$BURN_GRAPHED_CUBECL_ENV" "$OUT"
DEADLINE=${DEADLINE:-100000}
start=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }
STEPS=2
rows=$OUT/families.jsonl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/# device: /' > "$rows"

# prof SIDE DTYPE MODEL "MODES": one model's modes on one side, each a row of $rows.
prof() {
  local side=$1 dt=$2 model=$3 modes=$4 dir=$OUT/prof/$2_$1_$3 mode
  case " ${SIDES:-burn torch} " in *" $side "*) ;; *) return ;; esac
  [ "$(left)" -lt 40 ] && { echo "== skipped $side $dt $model ($modes): past DEADLINE"; return; }
  mkdir -p "$dir"
  if [ "$side" = burn ]; then
    BURN_GRAPHED_SIDES=burn BURN_GRAPHED_DTYPES=$dt OUT="$dir/bench" timeout "$(left)" bash $B bench \
      --models "$model" --modes "${modes// /,}" --steps 2 --reps 1 > "$dir/bench.txt" 2>&1
  fi
  PROFILE_SIDES=$side PROFILE_DTYPE=$dt PROFILE_GRAPHS=node PROFILE_COUNT=100000 PROFILE_MODES="$modes" \
    OUT="$dir" timeout "$(left)" bash $B profile --models "$model" --steps $STEPS --reps 1 > "$dir/prof.txt" 2>&1
  for mode in $modes; do
    python3 benches/ncu_summary.py --steps $STEPS --rows "$dir/${side}_$mode.ncu.csv" >> "$rows" \
      2>> "$OUT/summary_errors.txt"
  done
  # A process that outlived its timeout would share the GPU with the next profile.
  pkill -f bench-train_step; pkill -f torch_reference.py; pkill -x ncu
  echo "== $side $dt $model ($modes) done at $(( $(date +%s) - start )) s" | tee -a "$OUT/timeline.txt"
}

for dt in ${DTYPES:-f32 bf16}; do
  for m in ${MODELS:-mlp cnn transformer lm}; do
    case " ${SKIP_NN:-} bf16/cnn " in *" $dt/$m "*) ;; *) prof burn "$dt" "$m" "whole_step" ;; esac
    prof burn "$dt" "${m}_fused" "whole_step"
    prof torch "$dt" "$m" "whole_step_fused_adam"
  done
done
for spec in ${INFER:-f32/cnn f32/mlp bf16/cnn bf16/transformer}; do
  dt=${spec%/*} m=${spec#*/}
  prof burn "$dt" "${m}_fused" "inference_graphed inference_graphed_b1"
  prof torch "$dt" "$m" "inference_graphed inference_graphed_b1"
done
[ -s "$OUT/summary_errors.txt" ] && { echo "== profiles without a row:"; cat "$OUT/summary_errors.txt"; }
python3 benches/report.py "$rows" --only families
