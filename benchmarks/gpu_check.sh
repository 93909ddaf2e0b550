#!/usr/bin/env bash
# One GPU check, at most 8 minutes on one CUDA GPU (every step has a time cap and the whole script a
# deadline; a step that does not fit is reported as skipped, never silently dropped). It stops in its
# first seconds, with torch's reason and the fix, when there is no usable GPU (a CPU wheel, no driver,
# a driver too old for the wheel's CUDA). Most important first, so that a short visit measures it:
#   1. benchmarks/train_speed.py for dmc_proprio recipe2024 size1m, eager, float32 and bf16: seconds per
#      update, kernel launches per update and peak memory (no compilation: the first minute);
#   2. the suite's CUDA-relevant tests on cuda (DREAMER_TEST_DEVICE=cuda): tests/test_compile.py,
#      tests/test_replay_device.py, and tests/test_whole_update.py with Inductor and CUDA graphs
#      (DREAMER_TEST_BACKEND=inductor), with torch's CUDA-graph logging (TORCH_LOGS=cudagraphs,perf_hints:
#      what was captured, and why a graph was not) and the `cudagraph_skips` counter printed at the end
#      (benchmarks/cudagraph_report.py);
#   3. size1m with the whole update compiled (--compile update), bf16 and float32, at a short unroll
#      (SHORT_UNROLL: batch_length 16, imag_horizon 8), so that the compilation fits its cap;
#   4. the same update in the official code (benchmarks/official_speed.py, jit, bf16) on the same GPU, when
#      OFFICIAL_DIR names a checkout of danijar/dreamerv3 and OFFICIAL_PYTHON its interpreter (default python3);
#      without OFFICIAL_DIR the row says skipped;
#   5. 8 seeds in one batched update (--seeds 8, eager, bf16) against one seed alone at size1m:
#      train_speed.py --seeds 8 prints `ratio: X` (the goal: 8 seeds in less than 2x one seed's time);
#   6. a short dmc_vision training run with --compile update --precision bf16 --replay_device True on cuda;
#   7. the rest of the speed matrix: size1m whole update at 16 (short unroll), dmc_vision at the default size
#      (whole update and off, bf16), size1m step by step x bf16 / 32 / 16 and eager at 16;
# then one table, whose status column says which rows ran, failed, timed out or were skipped (the deadline,
# GPU_CHECK_SECONDS, reports the rest as skipped). Every file goes to $GPU_CHECK_OUT (default: $OUT when
# set, which a remote run brings back; else /tmp/gpu_check), the table too (summary.md). The learning
# check (recipe2024 size1m on dmc_cartpole_balance against the official curve) is the second script,
# benchmarks/gpu_learning_check.sh. If a compiled row fails, --compile False is the fallback for training.
#
#   bash benchmarks/gpu_check.sh
#
# GPU_CHECK_PRINT_ONLY=1 prints the commands instead of running them, in the order they run
# (tests/test_benchmarks.py checks that every flag they use exists, on machines without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-${OUT:-/tmp/gpu_check}}"
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-470}))
declare -A status

run() {  # run NAME CAP COMMAND...: at most CAP seconds, never past the deadline; output shown and kept
  local name=$1 cap=$2 left rc
  shift 2
  if [ -n "${GPU_CHECK_PRINT_ONLY:-}" ]; then
    echo "$*"
    return 0
  fi
  left=$((deadline - SECONDS))
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  if [ "$cap" -lt 15 ]; then
    status[$name]="skipped (out of time)"
    echo "== $name: skipped (out of time)"
    return 0
  fi
  echo "== $name (at most ${cap} s): $*"
  rc=0
  timeout "$cap" "$@" 2>&1 | tee "$out/$name.txt" || rc=$?
  case $rc in
    0) status[$name]="ok" ;;
    124) status[$name]="timed out after ${cap} s" ;;
    *) status[$name]="failed (exit $rc)" ;;
  esac
}

if [ -z "${GPU_CHECK_PRINT_ONLY:-}" ]; then
  rm -rf "$out"
  mkdir -p "$out"
  # launch.cuda_problem: torch's own reason and the fix (the check dreamer.py --device cuda makes)
  python3 -c "import sys, launch; p = launch.cuda_problem(launch.torch.device('cuda', 0)); \
sys.exit(f'gpu_check.sh: no usable GPU: {p}' if p else 0)"
  python3 -c "import torch; p = torch.cuda.get_device_properties(0); print(f'GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
  date -u +"date: %Y-%m-%d %H:%M UTC"
fi

export MUJOCO_GL="${MUJOCO_GL:-egl}"
configs_of() {  # the presets behind a speed row's name
  case $1 in proprio_size1m) echo "dmc_proprio recipe2024 size1m" ;; *) echo "dmc_vision" ;; esac
}
SHORT_UNROLL=(--batch_length 16 --imag_horizon 8)  # the compiled graphs grow with the unrolled steps
rows() {  # the speed matrix in the order it runs: preset compile precision
  echo "proprio_size1m False 32"
  echo "proprio_size1m False bf16"
  echo "proprio_size1m update bf16"
  echo "proprio_size1m update 32"
  echo "proprio_size1m update 16"
  echo "vision update bf16"
  echo "vision False bf16"
  for precision in bf16 32 16; do echo "proprio_size1m True $precision"; done
  echo "proprio_size1m False 16"
}
speed() {  # speed PRESET COMPILE PRECISION: one row of the matrix
  local cap unroll=()
  # The first GPU visit (2026-12-04, H200, torch 2.11) saw the whole update's compilation pass 60 s at
  # size1m and dmc_vision's first compiled update pass 110 s: the caps leave room for that.
  cap=$(case $2 in update) echo 240 ;; True) echo 120 ;; *) echo 30 ;; esac)
  if [ "$1-$2" = "proprio_size1m-update" ]; then unroll=("${SHORT_UNROLL[@]}"); fi
  # shellcheck disable=SC2046 - the presets are separate words
  run "speed_$1_compile$2_fp$3" "$cap" python3 benchmarks/train_speed.py \
    --configs $(configs_of "$1") --task dmc_walker_walk --device cuda --compile "$2" \
    --precision "$3" --updates 10 --warmup 2 "${unroll[@]}"
}
speeds() {  # speeds FIRST LAST: rows FIRST..LAST of the matrix
  while read -r preset compile precision; do
    speed "$preset" "$compile" "$precision"
  done < <(rows | sed -n "$1,$2p")
}
speeds 1 2  # eager float32 and bf16: no compilation, so they measure in seconds
run tests 240 env DREAMER_TEST_DEVICE=cuda DREAMER_TEST_BACKEND=inductor TORCH_LOGS=cudagraphs,perf_hints \
  python3 -m pytest -q -p benchmarks.cudagraph_report tests/test_compile.py tests/test_replay_device.py \
  tests/test_whole_update.py
speeds 3 4  # the whole update compiled, bf16 and float32, at the short unroll
if [ -n "${OFFICIAL_DIR:-}${GPU_CHECK_PRINT_ONLY:-}" ]; then
  run official_size1m 150 python3 benchmarks/official_speed.py --official "${OFFICIAL_DIR:-OFFICIAL_DIR}" \
    --python "${OFFICIAL_PYTHON:-python3}" --updates 20 --warmup 3 \
    --configs $(configs_of proprio_size1m) --task dmc_walker_walk --device cuda --precision bf16
else
  status[official_size1m]="skipped (OFFICIAL_DIR not set)"
fi
run seeds8_size1m 90 python3 benchmarks/train_speed.py --configs dmc_proprio recipe2024 size1m --task dmc_walker_walk \
  --device cuda --compile False --precision bf16 --seeds 8 --updates 5 --warmup 2
run train_vision 300 python3 dreamer.py --configs dmc_vision --task dmc_walker_walk --device cuda \
  --compile update --precision bf16 --replay_device True --envs 1 --steps 3000 --prefill 1000 --pretrain 10 --eval_every 100000 \
  --eval_episode_num 1 --log_every 1000 --logdir "$out/train_vision_logdir"
speeds 5 100
if [ -n "${GPU_CHECK_PRINT_ONLY:-}" ]; then exit 0; fi

exec > >(tee "$out/summary.md")  # the table, also as a file
echo
echo "| step | result |"
echo "|---|---|"
echo "| tests (compile, replay_device, whole update) on cuda | ${status[tests]:-not run}: $(grep -Eo '[0-9]+ (passed|failed)[^=]*' "$out/tests.txt" 2>/dev/null | tail -1) |"
echo "| CUDA graphs skipped in those tests (cudagraph_skips; reasons in tests.txt) | $(grep -Eo 'cudagraph_skips: [0-9]+' "$out/tests.txt" 2>/dev/null | grep -Eo '[0-9]+$' || echo "-") |"
fps=$(python3 -c "import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; print(f\"{[r for r in rows if 'perf/fps' in r][-1]['perf/fps']:.1f}\")" \
  "$out/train_vision_logdir/metrics.jsonl" 2>/dev/null || echo "?")
seeds=$(grep -E '^(one seed|8 seeds batched|ratio):' "$out/seeds8_size1m.txt" 2>/dev/null | tr '\n' ' ' || echo "-")
official=$(grep -Eo 'seconds per update: [0-9.]+' "$out/official_size1m.txt" 2>/dev/null | grep -Eo '[0-9.]+$' || echo "-")
echo "| official code, size1m, bf16, jit (s/update; the project's are the proprio_size1m rows below) | ${status[official_size1m]:-not run}: $official |"
echo "| 8 seeds batched vs one seed, size1m, eager, bf16 | ${status[seeds8_size1m]:-not run}: $seeds |"
echo "| dmc_vision run (compile update, precision bf16, replay on the GPU, train ratio 512) | ${status[train_vision]:-not run}; last logged env frames/s: $fps |"
echo
echo "compile update rows at size1m: the short unroll, ${SHORT_UNROLL[*]}"
echo
echo "| preset | compile | precision | s/update | updates/s | kernel launches/update | peak memory | status |"
echo "|---|---|---|---|---|---|---|---|"
while read -r preset compile precision; do
  name="speed_${preset}_compile${compile}_fp${precision}"
  file="$out/$name.txt"
  seconds=$(grep -Eo 'seconds per update: [0-9.]+' "$file" 2>/dev/null | grep -Eo '[0-9.]+$' || echo "-")
  rate=$(grep -Eo '^updates_per_s=[0-9.]+' "$file" 2>/dev/null | cut -d= -f2 || echo "-")
  launches=$(grep -Eo 'kernel launches per update: [0-9]+' "$file" 2>/dev/null | grep -Eo '[0-9]+$' || echo "-")
  memory=$(grep -Eo 'peak memory: [0-9]+ MB' "$file" 2>/dev/null | grep -Eo '[0-9]+ MB' || echo "-")
  echo "| $preset | $compile | $precision | $seconds | $rate | $launches | $memory | ${status[$name]:-not run} |"
done < <(rows)
