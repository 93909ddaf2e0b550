#!/usr/bin/env bash
# The GPU learning check, at most GPU_CHECK_SECONDS (default 480) on one CUDA GPU: recipe2024 size1m on
# dmc_cartpole_balance towards 40K frames at the setting behind the official curve (train ratio 512, action
# repeat 2: about 10K updates), the whole update compiled (--compile update), bfloat16, without evaluation
# episodes (the train return is the metric: --metric train/return); the training gets the time left after
# a minute kept for the table, and is stopped at its cap (it saves and says so: SIGTERM); then its train
# return per 10K frames beside the official curve (benchmarks/reference_curves.json: 316 at 10K frames, 227
# at 20K, 486 at 40K; one seed is noisy), over the frames it reached. No GPU run has timed it yet: whether
# 8 minutes reach 40K frames is not known. Files go to $GPU_CHECK_OUT (default: $OUT when set, else
# /tmp/gpu_learning_check).
#
#   bash benchmarks/gpu_learning_check.sh
#
# GPU_CHECK_PRINT_ONLY=1 prints the commands instead of running them (tests/test_benchmarks.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-${OUT:-/tmp/gpu_learning_check}}"
train=(python3 dreamer.py --configs dmc_proprio recipe2024 size1m --task dmc_cartpole_balance --device cuda
       --compile update --precision bf16 --train_ratio 512 --action_repeat 2 --envs 1 --steps 4e4
       --eval_episode_num 0 --log_every 2000 --logdir "$out/logdir")
plot=(python3 benchmarks/plot.py "$out/logdir" --metric train/return --table --bin 10000 --output "$out/curve.png")
if [ -n "${GPU_CHECK_PRINT_ONLY:-}" ]; then
  echo "${train[*]}"
  echo "${plot[*]}"
  exit 0
fi
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_learning_check.sh: CUDA is not available')"
rm -rf "$out"
mkdir -p "$out"
export MUJOCO_GL="${MUJOCO_GL:-egl}"
start=$SECONDS
rc=0
cap=$((${GPU_CHECK_SECONDS:-480} - 60))
timeout "$cap" "${train[@]}" 2>&1 | tee "$out/train.txt" | grep -v "^  envs" || rc=$?
echo "== training: exit $rc after $((SECONDS - start)) s (124 or 143: the time cap; the curve shows what it reached)"
"${plot[@]}" 2>&1 | tee "$out/table.txt"
