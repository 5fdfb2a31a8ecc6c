#!/usr/bin/env bash
# The recipe's short real training on one NVIDIA GPU with vLLM as the rollout engine (the CPU runs use the hfcpu
# backend instead). Checks the machine first, then runs `python -m nemo_gym_browser.local.training_run --rollout
# vllm` with the vLLM settings below and prints step times and env/* metrics. `--help` explains everything.
# Not yet run on a GPU: written from verl's vLLM path; tests/test_gpu_check.py covers what a machine without a GPU
# can check (the refusals, the composed config, the summary).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${GPU_PYTHON:-$ROOT/.venv-gpu/bin/python}"
GYM_VENV="${GYM_VENV:-$ROOT/.venv-gym}"
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
VLLM_TESTED="0.24.0" # what verl 0.9.1's `vllm` extra pins (with torch 2.11.0 and transformers 5.9.0)
# One head of 64 instead of the CPU runs' four of 16: every vLLM attention backend takes head_dim 64, while 16 is
# taken by FlashAttention only (FlashInfer: 64/128/256; Triton: >= 32). Same width: the warm start costs the same.
POLICY_SHAPE=(--hidden-size 64 --heads 1 --kv-heads 1)

workdir="${TMPDIR:-/tmp}/nemo-gym-browser-gpu-check"
model=""
steps=2
fault_rate=0.25
gpu_memory=0.4
mode=run
extra=()

usage() {
    cat <<EOF
Usage: bash scripts/gpu_check.sh [options] [-- HYDRA_OVERRIDE ...]

Trains the recipe for a few steps on one NVIDIA GPU with vLLM: verl 0.9.1's real main_ppo (V1 trainer; actor,
reference and a vLLM replica colocated on the GPU, vLLM asleep while the actor trains), BrowserToolAgentLoop
against a real nemo-gym 0.7.0 interactive_browser with headless Chromium on 127.0.0.1 serving the local Corner
Shop tasks, a fault proxy that makes verify answer 503 for a share of the episodes, and grpo_env_aware. It is
the run \`python -m nemo_gym_browser.local.training_run\` makes on CPU, with rollout.name=vllm. At the end it
prints each step's times, reward and env/* metrics.

Not yet run on a GPU: this script is written from verl's vLLM path and tested only for what a machine without a
GPU can check (its refusals, that its overrides compose with verl's config into a one-GPU vLLM rollout, its
summary). verl's vLLM rollout itself has trained the recipe on vLLM's CPU build (docs/vllm-on-cpu.md).

Checked first (each refusal names its fix):
  nvidia-smi and a GPU with compute capability 8.0 or newer (bf16), with enough free memory; in --python's
  environment a CUDA torch, vLLM, verl 0.9.1 and this package; a model whose head size vLLM takes; .venv-gym
  and Chromium for the environment server; PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True (vLLM's
  sleep mode refuses it).

Prerequisites, once (a virtual environment of its own: .venv holds the CPU torch):
  python3.12 -m venv .venv-gpu                           # a Python 3.11 or 3.12: verl 0.9.1 requires < 3.13
  .venv-gpu/bin/pip install "verl[vllm]==0.9.1" -e .   # vllm ${VLLM_TESTED}, torch 2.11.0 (CUDA), transformers 5.9.0
  bash scripts/setup_environment.sh                      # .venv-gym (nemo-gym 0.7.0) and Debian's Chromium
  Leave constraints.txt out of that install: it pins the CPU set, e.g. fastapi 0.165, and vllm ${VLLM_TESTED}
  requires fastapi < 0.137. flash-attn is optional: without it the actor uses sdpa without remove-padding.

The model: by default a tiny Qwen2 policy (one head of 64) is built and warm-started on the CPU, once per
workdir (about 200 s of CPU time). Or --model DIR: a local Hugging Face folder whose chat template speaks
hermes tool calls, such as Qwen2.5-0.5B-Instruct (head_dim 64). Nothing is downloaded (HF_HUB_OFFLINE=1).

Time: not measured (no GPU run yet). The work: the policy's warm start on the CPU, vLLM's start-up (eager mode:
no compilation) and two steps of 4 tasks x 4 episodes in a real browser; the CPU backend takes several minutes
for the same run.

Options:
  --workdir DIR              task rows, policy, run/ (main_ppo.log, metrics.jsonl); default ${workdir}
  --model DIR                a local model folder instead of the tiny policy
  --steps N                  training steps (default ${steps})
  --fault-rate R             share of episodes whose verify answers 503 (default ${fault_rate})
  --gpu-memory-utilization F vLLM's share of the whole GPU, claimed at start-up beside the actor and the
                             reference (default ${gpu_memory}; verl's 0.5 and the recipe's 0.6 are for large GPUs)
  --python PATH              the GPU environment's python (default \$GPU_PYTHON or ${PYTHON})
  --print-command            print the commands it would run (no checks, nothing started) and exit
  --summary                  print the summary of the run already in --workdir and exit
  -h, --help                 this text
  -- KEY=VALUE ...           extra hydra overrides for main_ppo; they come last and win

Examples:
  bash scripts/gpu_check.sh
  bash scripts/gpu_check.sh --model /models/Qwen2.5-0.5B-Instruct --steps 3
  srun --gpus=1 --time=30 bash scripts/gpu_check.sh --workdir "\$SCRATCH/gpu-check"   # one Slurm GPU node
  bash scripts/gpu_check.sh -- actor_rollout_ref.rollout.enforce_eager=False          # with CUDA graphs

Exit status: 0 trained and every step logged, 1 a check or the training failed, 2 usage error.
EOF
}

die() {
    printf 'gpu_check: %s\n' "$*" >&2
    exit 1
}
usage_error() {
    printf 'gpu_check: %s (see --help)\n' "$*" >&2
    exit 2
}

# Per-step times, reward and env/* metrics from verl's own file logger; exit 1 when steps are missing.
summarize() {
    "$PYTHON" - "$workdir/run/metrics.jsonl" "$steps" <<'PY'
import math
import sys
from pathlib import Path

from nemo_gym_browser.local.main_ppo_process import read_step_metrics

path, wanted = Path(sys.argv[1]), int(sys.argv[2])
steps = read_step_metrics(path)
columns = {"timing_s/step": "step s", "timing_s/gen": "gen s", "timing_s/update_actor": "update s",
           "timing_s/update_weights": "sync s", "critic/score/mean": "reward"}
print(f"gpu_check: {len(steps)} step(s) in {path}")
print(f"{'step':34s} " + " ".join(f"{step:>8d}" for step in sorted(steps)))
keys = [*columns, *sorted({key for metrics in steps.values() for key in metrics if key.startswith("env/")})]
for key in keys:
    values = (float(steps[step].get(key, math.nan)) for step in sorted(steps))
    print(f"{columns.get(key, key):34s} " + " ".join(f"{value:8.3f}" for value in values))
if len(steps) < wanted:
    sys.exit(f"gpu_check: main_ppo logged {len(steps)} of {wanted} steps")
PY
}

while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --print-command) mode=print; shift ;;
        --summary) mode=summary; shift ;;
        --) shift; extra+=("$@"); break ;;
        --workdir | --model | --steps | --fault-rate | --gpu-memory-utilization | --python)
            (($# >= 2)) || usage_error "$1 needs a value"
            case "$1" in
                --workdir) workdir="$2" ;;
                --model) model="$2" ;;
                --steps) steps="$2" ;;
                --fault-rate) fault_rate="$2" ;;
                --gpu-memory-utilization) gpu_memory="$2" ;;
                --python) PYTHON="$2" ;;
            esac
            shift 2
            ;;
        *) usage_error "unknown argument: $1" ;;
    esac
done
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || usage_error "--steps must be a positive integer"
awk -v f="$gpu_memory" 'BEGIN { exit !(f > 0.05 && f < 0.95) }' ||
    usage_error "--gpu-memory-utilization must be in (0.05, 0.95)"
awk -v f="$fault_rate" 'BEGIN { exit !(f >= 0 && f <= 1) }' || usage_error "--fault-rate must be in [0, 1]"
[[ -x "$PYTHON" ]] || die "no python at $PYTHON: create the GPU environment (see --help) or pass --python"
workdir="$(realpath -m "$workdir")"
policy="${model:-$workdir/vllm-tiny-policy}"
if [[ "$mode" == summary ]]; then summarize; exit 0; fi

# ---------------------------------------------------------------------------------------------------- the command
# training_run's GPU path already keeps Ray private and on loopback and sizes vLLM's context to the run.
overrides=(
    "actor_rollout_ref.rollout.gpu_memory_utilization=$gpu_memory"
    actor_rollout_ref.rollout.enforce_eager=True     # no torch.compile or CUDA graphs: start-up in seconds
    actor_rollout_ref.rollout.free_cache_engine=True # vLLM sleeps (weights, KV cache freed) while the actor trains
    actor_rollout_ref.rollout.load_format=dummy      # random weights at start-up; the actor's arrive before step 1
    ray_kwargs.ray_init.num_cpus=16                  # logical: verl's one-CPU actors fit a small Slurm allocation too
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1 # a few dozen samples per step
)
if ! "$PYTHON" -c 'import flash_attn' 2>/dev/null; then
    # verl's actor defaults to flash_attention_2, and remove-padding needs flash-attn's kernels.
    overrides+=(+actor_rollout_ref.model.override_config.attn_implementation=sdpa)
    overrides+=(actor_rollout_ref.model.use_remove_padding=False)
fi
overrides+=("${extra[@]}")
build=("$PYTHON" -m nemo_gym_browser.local.tiny_policy build --output "$policy" "${POLICY_SHAPE[@]}")
train=("$PYTHON" -m nemo_gym_browser.local.training_run --workdir "$workdir" --rollout vllm --model "$policy"
    --steps "$steps" --fault-rate "$fault_rate")
for override in "${overrides[@]}"; do train+=(--override "$override"); done

if [[ "$mode" == print ]]; then
    if [[ -z "$model" ]]; then printf '%q ' "${build[@]}" && printf '\n'; fi
    printf '%q ' "${train[@]}" && printf '\n'
    exit 0
fi

# ------------------------------------------------------------------------------------------------------ the checks
command -v nvidia-smi >/dev/null || die "no NVIDIA driver here (nvidia-smi not found): this check needs one" \
    "NVIDIA GPU. Without one, the same run uses the CPU backend: $PYTHON -m nemo_gym_browser.local.training_run" \
    "--workdir DIR"
gpu_id="${CUDA_VISIBLE_DEVICES:-}"
gpu_id="${gpu_id%%,*}"
query=("--query-gpu=name,memory.free,memory.total" "--format=csv,noheader,nounits")
gpu="$(nvidia-smi ${gpu_id:+-i "$gpu_id"} "${query[@]}" 2>&1 | head -n 1)" || die "nvidia-smi sees no GPU: $gpu"
IFS=',' read -r gpu_name free_mib total_mib <<<"$gpu"
gpu_name="${gpu_name# }" free_mib="${free_mib// /}" total_mib="${total_mib// /}"
[[ "$free_mib" =~ ^[0-9]+$ && "$total_mib" =~ ^[0-9]+$ ]] || die "nvidia-smi sees no GPU: $gpu"
awk -v f="$free_mib" -v t="$total_mib" -v u="$gpu_memory" 'BEGIN { exit !(f >= (u + 0.1) * t) }' ||
    die "$gpu_name has $free_mib of $total_mib MiB free; vLLM claims $gpu_memory of the whole GPU at start-up and" \
        "the actor and reference need room besides: stop other GPU processes or lower --gpu-memory-utilization"
if [[ "${PYTORCH_CUDA_ALLOC_CONF:-}" == *expandable_segments:True* ]]; then
    die "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF: vLLM's sleep mode refuses expandable segments; unset it"
fi
"$PYTHON" - "$VLLM_TESTED" "$(<"$ROOT/REQUIRED_VERL.txt")" "$model" <<'PY' || exit 1
import importlib.metadata as md
import json
import sys
from pathlib import Path

import torch

tested, model = sys.argv[1], sys.argv[3]
required = dict(line.split("=", 1) for line in sys.argv[2].split() if "=" in line)["VERL_VERSION"]
problems = []
if not torch.cuda.is_available():
    problems.append(f"torch {torch.__version__} cannot use the GPU: install the CUDA build vLLM needs (see --help)")
elif torch.cuda.get_device_capability(0) < (8, 0):
    problems.append(f"{torch.cuda.get_device_name(0)} has compute capability below 8.0: no bf16 for vLLM and FSDP")
try:
    if md.version("vllm") != tested:
        print(f"gpu_check: warning: vllm {md.version('vllm')}; verl {required} pins {tested}", file=sys.stderr)
except md.PackageNotFoundError:
    problems.append(f'vLLM is not installed: pip install "verl[vllm]=={required}" (vllm {tested})')
try:
    if md.version("verl") != required:
        problems.append(f"verl {md.version('verl')} is installed; the recipe needs {required}")
except md.PackageNotFoundError:
    problems.append("verl is not installed")
if model:
    config_file = Path(model) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config = config.get("text_config", config)
    if "num_attention_heads" not in config:
        problems.append(f"--model {model}: not a Hugging Face model folder (no config.json with attention heads)")
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        if head_dim % 8 or head_dim > 256:
            problems.append(f"--model has head_dim {head_dim}: vLLM's attention backends need a multiple of 8 <= 256")
        elif head_dim not in (64, 128, 256):
            print(f"gpu_check: warning: head_dim {head_dim}: only vLLM's FlashAttention takes it", file=sys.stderr)
for problem in problems:
    print(f"gpu_check: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
PY
[[ -f "$GYM_VENV/.setup-complete" ]] || die "no environment server venv at $GYM_VENV: bash scripts/setup_environment.sh"
[[ -x "$CHROMIUM" ]] || die "no Chromium at $CHROMIUM: bash scripts/setup_environment.sh"
versions="$("$PYTHON" -c 'import torch, vllm; print(f"torch {torch.__version__}, vllm {vllm.__version__}")')"
echo "gpu_check: $gpu_name ($free_mib of $total_mib MiB free), $versions"

# ------------------------------------------------------------------------------------------------------- the run
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | head -n 1)}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 # vLLM would otherwise report usage to an outside server
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # Ray keeps the loopback node address it is given
unset VERL_PLATFORM VERL_ENGINE_DEVICE      # the CPU backend's switches, should this shell have them
mkdir -p "$workdir"
rm -f "$workdir/run/metrics.jsonl" # a failed start must not summarise an earlier run
started=$SECONDS
if [[ -z "$model" && ! -f "$policy/warm_start.json" ]]; then
    echo "gpu_check: building the tiny policy (one head of 64) on the CPU ..."
    "${build[@]}" || die "building the tiny policy failed"
fi
status=0
"${train[@]}" 2>&1 | tee "$workdir/gpu_check.log" || status=$?
echo
summarize || status=1
result=$( ((status == 0)) && echo passed || echo FAILED)
echo "gpu_check: $result in $((SECONDS - started)) s; log $workdir/gpu_check.log, trainer log $workdir/run/main_ppo.log"
exit "$status"
