#!/usr/bin/env bash
#SBATCH --job-name=webvoyager-grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
##SBATCH --partition=<PARTITION>
##SBATCH --account=<ACCOUNT>
#
# GRPO on NeMo Gym's interactive_browser with verl 0.9.1 (the recipe in this folder).
#
#   cp config.env.example config.env && $EDITOR config.env
#   sbatch --gpus-per-node=0 --oversubscribe submit_webvoyager.sh --dry-run
#                                                  # every check that needs no GPU, on the real nodes; the two options
#                                                  # override the GPU and --exclusive lines below for this job only
#   sbatch submit_webvoyager.sh                    # train
#   sbatch submit_webvoyager.sh trainer.total_epochs=1 actor_rollout_ref.actor.optim.lr=5e-7   # extra overrides
#   bash submit_webvoyager.sh --dry-run            # the same checks on this machine, without Slurm (one node)
#   bash submit_webvoyager.sh --print-overrides    # the hydra overrides it would pass, one per line
#
# The #SBATCH lines are an example shape (2 nodes x 8 GPUs); sbatch options on the command line win over them.
# Uncomment (remove one '#') and fill in the partition and account lines for your site.
#
# What one job does, in order (every step is bounded in time and logged under LOG_DIR/RUN_ID):
#   1. reads config.env (CONFIG_ENV=path or --config path) and checks it, the data files and the model folder; then
#      checks what training will run on EVERY node at once (node_check.py: verl, CUDA torch seeing the GPUs Slurm
#      gave, vLLM, flash-attn, Chromium, the gym venv), naming a failing node and the fix
#   2. composes the full verl config with every override (`main_ppo ... --cfg job`) and checks it (preflight.py):
#      every row readable, taught the tools TOOL_INTERFACE gives the model, and scorable (verifier_metadata, or a
#      judge configured); a loopback judge URL on several nodes only with JUDGE_ON_EVERY_NODE=1; and what verl will
#      resume from (RESUME; refused when made from another model or other data) and the disk the kept checkpoints
#      need (checkpointing.py, which also writes the run's fingerprint beside its checkpoints when training starts)
#   3. starts ENV_SERVERS_PER_NODE NeMo Gym interactive_browser servers on EVERY node, on 127.0.0.1 ports
#      ENV_BASE_PORT, ENV_BASE_PORT+1, ...: each node's rollout workers use the servers of their own node, so one
#      list of loopback URLs is right everywhere and no browser server is ever exposed on the cluster network
#   4. walks one smoke episode against every server, from its own node (smoke_environment.py), then opens a sample
#      of the data's own start pages through each node's first server (start_pages.py): when fewer than
#      START_PAGE_MIN_SHARE of them load on a node (no route to the sites, a proxy not set), the job stops there
#   5. starts a Ray head on this node and one Ray worker per other node, waits until all have joined, and checks
#      that a Ray worker on every node sees the drop switch, the recipe and its estimator, and reaches the judge
#   6. --dry-run stops here (exit 0); otherwise `python -m verl.trainer.main_ppo` with the recipe's config
#   and on exit, failure or cancellation stops every process it started, by PID.
set -euo pipefail

usage() { sed -n '/^# GRPO on NeMo Gym/,/^# Uncomment/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

# ----------------------------------------------------------------------------------------------------------------
# Command line: our flags first; everything after them is passed to verl as hydra overrides, last (so it wins).
# ----------------------------------------------------------------------------------------------------------------
MODE=train
while (($#)); do
    case "$1" in
        --dry-run) MODE=dry-run ;;
        --print-overrides) MODE=print-overrides ;;
        --config) CONFIG_ENV="${2:?--config needs a path}"; shift ;;
        --config=*) CONFIG_ENV="${1#--config=}" ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) echo "submit_webvoyager.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
    shift
done

log() { printf '[submit %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() {
    printf '[submit %(%H:%M:%S)T] ERROR: %s\n' -1 "$*" >&2
    exit 1
}

# sbatch runs a copy of this script from its spool folder: find the recipe folder the job was submitted from.
find_recipe_dir() {
    local here candidate
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    if [[ -f "${here}/configs/webvoyager_grpo.yaml" ]]; then
        echo "${here}"
        return
    fi
    if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v scontrol >/dev/null; then
        candidate="$(scontrol show job -o "${SLURM_JOB_ID}" 2>/dev/null | sed -n 's/.* Command=\([^ ]*\).*/\1/p')"
        candidate="$(dirname "${candidate:-/nonexistent/x}")"
        if [[ -f "${candidate}/configs/webvoyager_grpo.yaml" ]]; then
            echo "${candidate}"
            return
        fi
    fi
    if [[ -f "${SLURM_SUBMIT_DIR:-/nonexistent}/configs/webvoyager_grpo.yaml" ]]; then
        echo "${SLURM_SUBMIT_DIR}"
        return
    fi
    echo ""
}
RECIPE_DIR="${RECIPE_DIR:-$(find_recipe_dir)}"
[[ -n "${RECIPE_DIR}" && -f "${RECIPE_DIR}/configs/webvoyager_grpo.yaml" ]] ||
    die "cannot find the recipe folder (configs/webvoyager_grpo.yaml); set RECIPE_DIR=/path/to/recipe"

if [[ -z "${CONFIG_ENV:-}" && ! -f "${RECIPE_DIR}/config.env" && "${MODE}" != train ]]; then
    # A first look on a fresh clone: the shipped defaults. Training always needs a config.env of one's own.
    CONFIG_ENV="${RECIPE_DIR}/config.env.example"
    log "no config.env yet: using the defaults in config.env.example" >&2
fi
CONFIG_ENV="${CONFIG_ENV:-${RECIPE_DIR}/config.env}"
[[ -f "${CONFIG_ENV}" ]] || die "no ${CONFIG_ENV}: cp ${RECIPE_DIR}/config.env.example ${RECIPE_DIR}/config.env and edit it"
# shellcheck source=/dev/null  # the site's own file (config.env.example documents it)
source "${CONFIG_ENV}"

# ================================================================================================================
# Variables (config.env sets them; the values after := are the defaults). config.env.example explains each one.
# ================================================================================================================

# ------------------------------------------------ Paths ---------------------------------------------------------
# Empty: python3 on PATH, never a venv found in the recipe folder; the node check (step 1) refuses one without CUDA torch.
: "${PYTHON:=python3}"
: "${GYM_VENV:=${RECIPE_DIR}/.venv-gym}"
: "${CHROMIUM_PATH:=/usr/bin/chromium}"
: "${LOG_DIR:=${RECIPE_DIR}/logs}"
: "${DATA_DIR:=${RECIPE_DIR}/data}"
: "${TRAIN_FILES:=${DATA_DIR}/train.jsonl}"
: "${VAL_FILES:=${DATA_DIR}/val.jsonl}"
: "${MODEL_PATH:=}"
: "${CHECKPOINT_DIR:=${RECIPE_DIR}/checkpoints}"

# ------------------------------------------------ Cluster shape -------------------------------------------------
NNODES="${SLURM_JOB_NUM_NODES:-1}"
: "${GPUS_PER_NODE:=8}"
: "${AGENT_WORKERS_PER_NODE:=8}"

# ------------------------------------------------ GRPO ----------------------------------------------------------
: "${ROLLOUT_N:=8}"
: "${TRAIN_BATCH_SIZE:=32}"
: "${PPO_MINI_BATCH_SIZE:=8}"
: "${LR:=1e-6}"
: "${MAX_PROMPT_LENGTH:=4096}"
: "${MAX_RESPONSE_LENGTH:=28672}"
: "${MAX_TOKEN_LEN_PER_GPU:=32768}"
: "${MAX_ASSISTANT_TURNS:=10}"
: "${ROLLOUT_TP:=2}"
: "${ROLLOUT_GPU_MEMORY_UTILIZATION:=0.6}"
: "${TOTAL_EPOCHS:=5}"

# ------------------------------------------------ Environment servers -------------------------------------------
: "${ENV_SERVERS_PER_NODE:=4}"
: "${ENV_BASE_PORT:=8100}"
: "${ENV_BACKEND:=remote_cdp}"
: "${ENV_CPUS:=}"
: "${ENV_MAX_SESSIONS_PER_SERVER:=64}"
: "${ENV_STARTUP_TIMEOUT_S:=180}"
: "${ENV_SERVER_URLS:=}"
: "${SMOKE_TIMEOUT_S:=120}"
: "${START_PAGE_SAMPLE:=8}"
: "${START_PAGE_MIN_SHARE:=0.5}"

# ------------------------------------------------ Browser episodes ----------------------------------------------
: "${TOOL_INTERFACE:=browser}"
: "${EPISODE_DEADLINE_S:=1800}"
: "${SESSION_HOLD_LIMIT_S:=3600}"
: "${MAX_ATTEMPTS:=3}"
: "${SAMPLE_MODE:=trajectory}"
: "${NEMO_GYM_BROWSER_DROP_INVALID:=0}"

# ------------------------------------------------ Judge ---------------------------------------------------------
: "${JUDGE_ENABLE:=1}"
: "${JUDGE_PROBE:=1}"
: "${JUDGE_ON_EVERY_NODE:=0}"
# One JUDGE_<KEY> per key of nemo_gym_browser.judge (settings.py's JudgeConfig; a test keeps these lists equal to its
# fields). Empty: not passed, so the key keeps its default (docs/configuration.md); base_url and model have none.
JUDGE_TEXT_KEYS=(base_url model api_key_env)
JUDGE_NUMBER_KEYS=(temperature max_tokens timeout_s connect_timeout_s max_attempts backoff_s backoff_max_s
    max_concurrency evidence_budget_chars max_trajectory_steps)
: "${JUDGE_BASE_URL:=}"
: "${JUDGE_MODEL:=}"
: "${JUDGE_API_KEY_ENV:=}"
: "${JUDGE_TEMPERATURE:=}"
: "${JUDGE_MAX_TOKENS:=}"
: "${JUDGE_TIMEOUT_S:=}"
: "${JUDGE_CONNECT_TIMEOUT_S:=}"
: "${JUDGE_MAX_ATTEMPTS:=}"
: "${JUDGE_BACKOFF_S:=}"
: "${JUDGE_BACKOFF_MAX_S:=}"
: "${JUDGE_MAX_CONCURRENCY:=}"
: "${JUDGE_EVIDENCE_BUDGET_CHARS:=}"
: "${JUDGE_MAX_TRAJECTORY_STEPS:=}"

# ------------------------------------------------ Ray -----------------------------------------------------------
: "${RAY_PORT:=6379}"
: "${RAY_HEAD_IP:=}"
: "${RAY_HEAD_TIMEOUT_S:=120}"
: "${RAY_WORKERS_TIMEOUT_S:=300}"
: "${RAY_TMPDIR:=/tmp/ray-ngb-${SLURM_JOB_ID:-$$}}"
: "${RAY_NUM_CPUS:=}"
: "${RAY_NUM_GPUS:=}"
: "${STOP_GRACE_S:=25}"

# ------------------------------------------------ Logging -------------------------------------------------------
: "${PROJECT_NAME:=nemo_gym_browser}"
: "${EXPERIMENT_NAME:=webvoyager_grpo}"
: "${LOGGER:=console,file}"
: "${SAVE_FREQ:=20}"
: "${TEST_FREQ:=10}"

# ------------------------------------------------ Checkpoints ---------------------------------------------------
: "${RESUME:=auto}"
: "${RESUME_ACROSS_CHANGES:=0}"
: "${CHECKPOINTS_TO_KEEP:=2}"

# ================================================================================================================
# The hydra overrides (the recipe's own settings live in configs/webvoyager_grpo.yaml)
# ================================================================================================================
case "${TOOL_INTERFACE}" in
    browser) TOOL_CONFIG="${RECIPE_DIR}/configs/browser_tool.yaml" ;;
    native) TOOL_CONFIG="${RECIPE_DIR}/configs/browser_native_tools.yaml" ;;
    *) die "TOOL_INTERFACE must be browser or native, not '${TOOL_INTERFACE}'" ;;
esac
case "${SAMPLE_MODE}" in
    trajectory) STEPWISE=false ;;
    stepwise) STEPWISE=true ;;
    *) die "SAMPLE_MODE must be trajectory or stepwise, not '${SAMPLE_MODE}'" ;;
esac
AGENT_LOOP_CONFIG="${RECIPE_DIR}/configs/agent_loop.yaml"

# A hydra quoted string: backslashes and single quotes escaped.
hq() {
    local value="${1//\\/\\\\}"
    printf "'%s'" "${value//\'/\\\'}"
}

# Every node runs the same servers on the same loopback ports, so this one list is right on every node.
server_urls() {
    if [[ -n "${ENV_SERVER_URLS}" ]]; then
        local url
        for url in ${ENV_SERVER_URLS//,/ }; do echo "${url}"; done
        return
    fi
    local k
    for ((k = 0; k < ENV_SERVERS_PER_NODE; k++)); do
        echo "http://127.0.0.1:$((ENV_BASE_PORT + k))"
    done
}

hydra_list() {
    local item out=""
    while IFS= read -r item; do out+="${out:+,}$(hq "${item}")"; done
    printf '[%s]' "${out}"
}

# The judge's section from its JUDGE_* variables: every one that is set, checked first.
judge_override() {
    local key name missing="" why="" items=()
    if [[ -z "${JUDGE_BASE_URL}" ]]; then missing="JUDGE_BASE_URL" why="where your judge serves"; fi
    if [[ -z "${JUDGE_MODEL}" ]]; then missing+="${missing:+ and }JUDGE_MODEL" why+="${why:+, and }the model name it serves"; fi
    if [[ -n "${missing}" ]]; then
        die "the judge is on (JUDGE_ENABLE=1): set ${missing} (${why}; see docs/cluster-guide.md#the-judge) or JUDGE_ENABLE=0 (${CONFIG_ENV})"
    fi
    for key in "${JUDGE_TEXT_KEYS[@]}" "${JUDGE_NUMBER_KEYS[@]}"; do
        name="JUDGE_${key^^}"
        [[ -n "${!name}" ]] || continue
        if [[ " ${JUDGE_TEXT_KEYS[*]} " == *" ${key} "* ]]; then
            items+=("${key}:$(hq "${!name}")")
        elif [[ "${!name}" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
            items+=("${key}:${!name}")
        else
            die "${name} must be a number, not '${!name}' (${CONFIG_ENV})"
        fi
    done
    local IFS=,
    printf '+nemo_gym_browser.judge={%s}' "${items[*]}"
}

# RESUME -> verl's resume_mode (and the checkpoint it names); CHECKPOINTS_TO_KEEP=0 -> verl's null, keep every one.
case "${RESUME}" in
    off) RESUME_OVERRIDES=("trainer.resume_mode=disable") ;;
    auto) RESUME_OVERRIDES=("trainer.resume_mode=auto") ;;
    *global_step_[0-9]*)
        [[ "${RESUME}" == /* ]] || RESUME="${PWD}/${RESUME}"
        RESUME_OVERRIDES=("trainer.resume_mode=resume_path" "trainer.resume_from_path=$(hq "${RESUME%/}")")
        ;;
    *) die "RESUME must be off, auto or the path of a global_step_<N> checkpoint folder, not '${RESUME}'" ;;
esac
[[ "${CHECKPOINTS_TO_KEEP}" =~ ^[0-9]+$ ]] || die "CHECKPOINTS_TO_KEEP must be a whole number, not '${CHECKPOINTS_TO_KEEP}'"
KEEP="${CHECKPOINTS_TO_KEEP}"
if ((KEEP == 0)); then KEEP=null; fi

OVERRIDES=(
    "actor_rollout_ref.model.path=$(hq "${MODEL_PATH}")"
    "data.train_files=$(hq "${TRAIN_FILES}")"
    "data.val_files=$(hq "${VAL_FILES}")"
    "data.train_batch_size=${TRAIN_BATCH_SIZE}"
    "data.max_prompt_length=${MAX_PROMPT_LENGTH}"
    "data.max_response_length=${MAX_RESPONSE_LENGTH}"
    "actor_rollout_ref.actor.optim.lr=${LR}"
    "actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE}"
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${MAX_TOKEN_LEN_PER_GPU}"
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=${MAX_TOKEN_LEN_PER_GPU}"
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=${MAX_TOKEN_LEN_PER_GPU}"
    "actor_rollout_ref.rollout.n=${ROLLOUT_N}"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=${ROLLOUT_TP}"
    "actor_rollout_ref.rollout.gpu_memory_utilization=${ROLLOUT_GPU_MEMORY_UTILIZATION}"
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=${MAX_ASSISTANT_TURNS}"
    "actor_rollout_ref.rollout.multi_turn.tool_config_path=$(hq "${TOOL_CONFIG}")"
    "actor_rollout_ref.rollout.agent.agent_loop_config_path=$(hq "${AGENT_LOOP_CONFIG}")"
    "actor_rollout_ref.rollout.agent.num_workers=$((AGENT_WORKERS_PER_NODE * NNODES))"
    "nemo_gym_browser.environment.server_urls=$(server_urls | hydra_list)"
    "nemo_gym_browser.environment.max_sessions_per_server=${ENV_MAX_SESSIONS_PER_SERVER}"
    "nemo_gym_browser.episode_deadline_s=${EPISODE_DEADLINE_S}"
    "nemo_gym_browser.session_hold_limit_s=${SESSION_HOLD_LIMIT_S}"
    "nemo_gym_browser.max_attempts=${MAX_ATTEMPTS}"
    "nemo_gym_browser.stepwise.enabled=${STEPWISE}"
    "trainer.nnodes=${NNODES}"
    "trainer.n_gpus_per_node=${GPUS_PER_NODE}"
    "trainer.project_name=$(hq "${PROJECT_NAME}")"
    "trainer.experiment_name=$(hq "${EXPERIMENT_NAME}")"
    "trainer.logger=[${LOGGER}]"
    "trainer.default_local_dir=$(hq "${CHECKPOINT_DIR}/${PROJECT_NAME}/${EXPERIMENT_NAME}")"
    "${RESUME_OVERRIDES[@]}"
    "trainer.max_actor_ckpt_to_keep=${KEEP}"
    "trainer.max_critic_ckpt_to_keep=${KEEP}"
    "trainer.total_epochs=${TOTAL_EPOCHS}"
    "trainer.save_freq=${SAVE_FREQ}"
    "trainer.test_freq=${TEST_FREQ}"
)
if [[ "${JUDGE_ENABLE}" == 1 ]]; then
    JUDGE_OVERRIDE="$(judge_override)" || exit 1 # its die ran in a subshell
    OVERRIDES+=("${JUDGE_OVERRIDE}")
fi
OVERRIDES+=("$@")

MAIN_PPO=("${PYTHON}" -m verl.trainer.main_ppo --config-path="${RECIPE_DIR}/configs" --config-name=webvoyager_grpo)

if [[ "${MODE}" == print-overrides ]]; then
    printf '%s\n' "${OVERRIDES[@]}"
    exit 0
fi

# ================================================================================================================
# Environment of every process this job starts. Exported BEFORE `ray start`: Ray workers inherit the environment
# of the raylet that forks them, and verl forwards only a fixed list of variables itself.
# ================================================================================================================
RUN_ID="${NEMO_GYM_BROWSER_RUN_ID:-${SLURM_JOB_ID:+slurm${SLURM_JOB_ID}-}$(date +%Y%m%d-%H%M%S)-$$}"
export NEMO_GYM_BROWSER_RUN_ID="${RUN_ID}"
# Made here, so only this shell's descendants carry it: the leak check at exit looks for it.
NEMO_GYM_BROWSER_PROCESS_MARK="${RUN_ID}/$$/$(date +%s%N)"
export NEMO_GYM_BROWSER_PROCESS_MARK
export NEMO_GYM_BROWSER_DROP_INVALID        # 1: a rollout still invalid after MAX_ATTEMPTS is dropped (V1 trainer)
# sitecustomize.py in the recipe folder installs the trainer wiring in every Python process, with or without a pip
# install (the verl.plugins entry point does the same when the package is installed).
export PYTHONPATH="${RECIPE_DIR}${PYTHONPATH:+:${PYTHONPATH}}"
export HYDRA_FULL_ERROR=1
export RAY_USAGE_STATS_ENABLED=0  # Ray would otherwise report usage to an outside server
# A fresh token per job: Ray 2.60 turns token authentication on by default, and a token file in a home folder that
# the nodes do not share would keep the workers out. Never printed.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
export RAY_AUTH_TOKEN
if [[ -n "${JUDGE_API_KEY_ENV}" ]]; then export "${JUDGE_API_KEY_ENV?}"; fi
# The environment servers and smoke episodes run without the job's credentials: a server renders untrusted pages and
# needs none (launch_environment.py also gives its server and Chromium an allow-listed environment, gym_contract/credentials.py).
NO_CREDENTIALS=(env -u RAY_AUTH_TOKEN -u HF_TOKEN -u HUGGING_FACE_HUB_TOKEN -u WANDB_API_KEY -u OPENAI_API_KEY)
if [[ -n "${JUDGE_API_KEY_ENV}" ]]; then NO_CREDENTIALS+=(-u "${JUDGE_API_KEY_ENV}"); fi

RUN_DIR="${LOG_DIR}/${RUN_ID}"
mkdir -p "${RUN_DIR}"
STARTED=$SECONDS
# Metrics land in the run folder: verl's file logger (LOGGER has file) and TensorBoard (LOGGER has tensorboard) write
# from verl's trainer process, a Ray actor on any node (hence a LOG_DIR every node can write to). A path exported by
# config.env wins.
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-${RUN_DIR}/metrics.jsonl}"
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-${RUN_DIR}/tensorboard}"

# ================================================================================================================
# Processes this job starts, and stopping them
# ================================================================================================================
USE_SRUN=0
if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v srun >/dev/null; then USE_SRUN=1; fi
if ((USE_SRUN)); then
    mapfile -t NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST}")
else
    NODES=("$(hostname -s)")
fi
HEAD_NODE="${NODES[0]}"

STARTED_PIDS=()
STARTED_NAMES=()
# The task of every srun step: bash -c "${SRUN_WRAPPER}" NAME GRACE_S COMMAND... It gets SIGUSR1 when we stop it
# (srun forwards it; SIGTERM to srun would SIGKILL the step at once) or SIGTERM when the job is cancelled (Slurm
# signals each step's processes on each node) and turns it into SIGTERM for the command, so servers and Ray shut down
# their own children in order. Then, on its own node, it stops whatever of its step still runs: every process there
# carrying the step's mark, SIGTERM then SIGKILL, within GRACE_S. Slurm's process tracking may miss those (Ray's
# workers run in process groups of their own and outlive a raylet that was killed), and after a cancellation no
# other step can reach that node. A stop we asked for ends the step with status 0; a command that dies by itself
# ends it with its own status. Builtins only for the scan (a helper process would carry the mark too). GRACE_S is
# 4/5 of STOP_GRACE_S: each step's stop fits in the script's, and servers get most of it to close their browsers.
# shellcheck disable=SC2016  # expanded by the remote bash
SRUN_WRAPPER='
export NEMO_GYM_BROWSER_STEP_MARK="${SLURM_JOB_ID:-0}.${SLURM_STEP_ID:-0}.$$"
grace="$1"
shift
step_pids() {
    local dir pid entry
    local -a environ
    STEP_PIDS=()
    for dir in /proc/[0-9]*; do
        pid="${dir#/proc/}"
        [[ "${pid}" == "$$" ]] && continue
        [[ "${dir}/ns/net" -ef "/proc/$$/ns/net" ]] || continue
        mapfile -d "" -t environ 2>/dev/null <"${dir}/environ" || continue
        for entry in "${environ[@]}"; do
            if [[ "${entry}" == "NEMO_GYM_BROWSER_STEP_MARK=${NEMO_GYM_BROWSER_STEP_MARK}" ]]; then
                STEP_PIDS+=("${pid}")
                break
            fi
        done
    done
}
nap() { env -u NEMO_GYM_BROWSER_STEP_MARK sleep 0.5; }
sweep() {
    local deadline=$((SECONDS + grace))
    while kill -0 "${child}" 2>/dev/null && ((SECONDS < deadline)); do nap; done
    step_pids
    if ((${#STEP_PIDS[@]})); then kill -TERM "${STEP_PIDS[@]}" 2>/dev/null; fi
    while ((${#STEP_PIDS[@]})) && ((SECONDS < deadline)); do nap; step_pids; done
    if ((${#STEP_PIDS[@]})); then kill -KILL "${STEP_PIDS[@]}" 2>/dev/null; fi
    wait "${child}" 2>/dev/null
}
stop() {
    trap "" USR1 TERM
    kill -TERM "${child}" 2>/dev/null
    sweep
    exit 0
}
trap stop USR1 TERM
"$@" &
child=$!
wait "${child}"
rc=$?
sweep
exit "${rc}"'

# One task on one node. Without --exact a step gets all of the job's CPUs and GPUs on its node (Ray's raylet and
# every worker it forks live in the step that started it); --overlap lets the steps share them; --mem=0 gives each
# step the job's memory on the node without taking it from the others.
SRUN_STEP=(--overlap --nodes=1 --ntasks=1 --mem=0)

# launch NAME NODE LOGFILE COMMAND...: start a long-lived process on NODE in the background and remember its PID.
launch() {
    local name="$1" node="$2" logfile="$3"
    shift 3
    if ((USE_SRUN)); then
        srun "${SRUN_STEP[@]}" --nodelist="${node}" --job-name="${name}" \
            bash -c "${SRUN_WRAPPER}" "${name}" "$((STOP_GRACE_S * 4 / 5))" "$@" </dev/null >"${logfile}" 2>&1 &
    else
        setsid "$@" </dev/null >"${logfile}" 2>&1 &
    fi
    LAST_PID=$!
    STARTED_PIDS+=("${LAST_PID}")
    STARTED_NAMES+=("${name}")
}

# run_on NODE COMMAND...: run a short command on NODE in the foreground.
run_on() {
    local node="$1"
    shift
    if ((USE_SRUN)); then
        srun "${SRUN_STEP[@]}" --nodelist="${node}" "$@" </dev/null
    else
        "$@" </dev/null
    fi
}

alive() { kill -0 "$1" 2>/dev/null; }

# bash -c "${PORTS_FREE}" name PORT...: fails (naming the port) if anything accepts connections on 127.0.0.1:PORT.
# shellcheck disable=SC2016  # expanded by the inner bash
PORTS_FREE='for port; do if (exec 3<>"/dev/tcp/127.0.0.1/${port}") 2>/dev/null; then echo "port ${port} in use" >&2; exit 1; fi; done'


# MARKED <- PIDs on this node that carry this run's process mark: every descendant of this job, daemonized ones included.
# Runs in this shell, with no helper process (a helper would carry the marker too). "This node" is this shell's
# network namespace: where several nodes share one kernel (containers), the others' processes are theirs to stop.
marked_pids() {
    local dir pid entry
    local -a environ
    MARKED=()
    for dir in /proc/[0-9]*; do
        pid="${dir#/proc/}"
        [[ "${pid}" == "$$" ]] && continue
        [[ "${dir}/ns/net" -ef "/proc/$$/ns/net" ]] || continue
        mapfile -d '' -t environ 2>/dev/null <"${dir}/environ" || continue
        for entry in "${environ[@]}"; do
            if [[ "${entry}" == "NEMO_GYM_BROWSER_PROCESS_MARK=${NEMO_GYM_BROWSER_PROCESS_MARK}" ]]; then
                MARKED+=("${pid}")
                break
            fi
        done
    done
}

# bash -c "${LEFT_ON_NODE}" left MARK: on the node it runs on (its network namespace), prints "PID(name)" for every
# process carrying the process mark MARK and kills it; prints nothing when none is left. Builtins only, like
# marked_pids.
# shellcheck disable=SC2016  # expanded by the inner bash
LEFT_ON_NODE='for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"; [[ "${pid}" == "$$" ]] && continue; [[ "${dir}/ns/net" -ef "/proc/$$/ns/net" ]] || continue
    mapfile -d "" -t environ 2>/dev/null <"${dir}/environ" || continue
    for entry in "${environ[@]}"; do
        if [[ "${entry}" == "NEMO_GYM_BROWSER_PROCESS_MARK=$1" ]]; then
            read -r name <"${dir}/comm" 2>/dev/null; printf "%s(%s) " "${pid}" "${name:-gone}"; kill -KILL "${pid}" 2>/dev/null; break
        fi
    done
done'

describe_pids() {
    local pid name out=()
    for pid in "$@"; do
        name="$(cat "/proc/${pid}/comm" 2>/dev/null || echo gone)"
        out+=("${pid}(${name})")
    done
    echo "${out[*]}"
}

TRAINER_PID=""
cleanup() {
    local rc=$? i pid deadline others
    trap - EXIT INT TERM USR1
    set +e
    log "cleanup: stopping ${#STARTED_PIDS[@]} process(es) started by this job (exit status ${rc})"
    # 1. Ask each process we started to stop, newest first. Ray stops in a few seconds and the environment servers
    #    close their browsers within 10 s; after a scancel, Slurm's KillWait (30 s by default) bounds all of this.
    if [[ -n "${TRAINER_PID}" ]] && alive "${TRAINER_PID}"; then kill -TERM "${TRAINER_PID}"; fi
    for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
        pid="${STARTED_PIDS[i]}"
        alive "${pid}" || continue
        if ((USE_SRUN)); then kill -USR1 "${pid}"; else kill -TERM "${pid}"; fi
    done
    deadline=$((SECONDS + STOP_GRACE_S))
    for pid in "${STARTED_PIDS[@]}" ${TRAINER_PID}; do
        while alive "${pid}" && ((SECONDS < deadline)); do sleep 0.5; done
    done
    # 2. Whatever else of this run still runs here (a helper the signal interrupted, a child whose parent is gone)
    #    is asked too, for the rest of the grace period. srun clients are left alone: SIGTERM would kill their step.
    marked_pids
    others=()
    for pid in "${MARKED[@]}"; do
        [[ " ${STARTED_PIDS[*]} " == *" ${pid} "* ]] || others+=("${pid}")
    done
    if ((${#others[@]})); then
        log "cleanup: also stopping $(describe_pids "${others[@]}")"
        kill -TERM "${others[@]}" 2>/dev/null
    fi
    marked_pids
    while ((${#MARKED[@]})) && ((SECONDS < deadline)); do
        sleep 0.5
        marked_pids
    done
    # 3. Past the grace period: force.
    for ((i = 0; i < ${#STARTED_PIDS[@]}; i++)); do
        pid="${STARTED_PIDS[i]}"
        if alive "${pid}"; then
            log "cleanup: killing ${STARTED_NAMES[i]} (pid ${pid}), still running after ${STOP_GRACE_S} s"
            if ((USE_SRUN)); then kill -TERM "${pid}"; else kill -KILL -- "-${pid}"; fi
        fi
    done
    marked_pids
    if ((${#MARKED[@]})); then
        log "cleanup: killing $(describe_pids "${MARKED[@]}"), still running after ${STOP_GRACE_S} s"
        kill -KILL "${MARKED[@]}" 2>/dev/null
    fi
    # A killed srun returns once Slurm has ended its step (KillWait): bounded, then reaped.
    deadline=$((SECONDS + 40))
    for pid in "${STARTED_PIDS[@]}"; do
        while alive "${pid}" && ((SECONDS < deadline)); do sleep 0.5; done
    done
    wait 2>/dev/null
    # 4. The other nodes: their processes stopped with their srun steps; a short step on each makes sure (and kills
    #    what escaped). Not after a cancellation: Slurm refuses new steps then, and ends the job on every node itself.
    local node left checked=("${HEAD_NODE}") unchecked=()
    if ((USE_SRUN && rc != 143 && rc != 130)); then
        for node in "${NODES[@]:1}"; do
            if left="$(timeout -k 5 30 srun "${SRUN_STEP[@]}" --nodelist="${node}" --job-name=cleanup-check \
                bash -c "${LEFT_ON_NODE}" left "${NEMO_GYM_BROWSER_PROCESS_MARK}" </dev/null 2>/dev/null)"; then
                checked+=("${node}")
                if [[ -n "${left}" ]]; then log "cleanup: WARNING: killed processes left on ${node}: ${left}"; fi
            else
                unchecked+=("${node}")
            fi
        done
    elif ((USE_SRUN)); then
        unchecked=("${NODES[@]:1}")
    fi
    marked_pids
    if ((${#MARKED[@]} == 0)); then
        log "cleanup: done; no process of run ${RUN_ID} is left on ${checked[*]}${unchecked[*]:+ (not checked after a cancellation: ${unchecked[*]}, where each step stops its own)}"
    else
        log "cleanup: WARNING: processes still running: $(describe_pids "${MARKED[@]}")"
    fi
    log "total time $((SECONDS - STARTED)) s; logs in ${RUN_DIR}"
    exit "${rc}"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated (job cancelled or out of time)"; exit 143' TERM USR1

# ================================================================================================================
# 1. Checks that need nothing running
# ================================================================================================================
log "run ${RUN_ID}: mode ${MODE}, ${NNODES} node(s) (${NODES[*]}), recipe ${RECIPE_DIR}, config ${CONFIG_ENV}"
log "every process of this run carries NEMO_GYM_BROWSER_PROCESS_MARK=${NEMO_GYM_BROWSER_PROCESS_MARK}"
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }
for name in GPUS_PER_NODE AGENT_WORKERS_PER_NODE ROLLOUT_N TRAIN_BATCH_SIZE PPO_MINI_BATCH_SIZE MAX_PROMPT_LENGTH \
    MAX_RESPONSE_LENGTH MAX_TOKEN_LEN_PER_GPU MAX_ASSISTANT_TURNS ROLLOUT_TP TOTAL_EPOCHS ENV_SERVERS_PER_NODE \
    ENV_BASE_PORT ENV_MAX_SESSIONS_PER_SERVER ENV_STARTUP_TIMEOUT_S SMOKE_TIMEOUT_S EPISODE_DEADLINE_S MAX_ATTEMPTS \
    RAY_PORT RAY_HEAD_TIMEOUT_S RAY_WORKERS_TIMEOUT_S STOP_GRACE_S SAVE_FREQ TEST_FREQ; do
    is_int "${!name}" || die "${name} must be a whole number, not '${!name}' (${CONFIG_ENV})"
done
[[ "${NEMO_GYM_BROWSER_DROP_INVALID}" =~ ^[01]$ ]] || die "NEMO_GYM_BROWSER_DROP_INVALID must be 0 or 1"
[[ "${JUDGE_ENABLE}" =~ ^[01]$ ]] || die "JUDGE_ENABLE must be 0 or 1"
[[ "${JUDGE_ON_EVERY_NODE}" =~ ^[01]$ ]] || die "JUDGE_ON_EVERY_NODE must be 0 or 1"
[[ "${RESUME_ACROSS_CHANGES}" =~ ^[01]$ ]] || die "RESUME_ACROSS_CHANGES must be 0 or 1"
[[ "${ENV_BACKEND}" =~ ^(remote_cdp|local_playwright)$ ]] || die "ENV_BACKEND must be remote_cdp or local_playwright"
is_int "${START_PAGE_SAMPLE}" || die "START_PAGE_SAMPLE must be a whole number, not '${START_PAGE_SAMPLE}' (${CONFIG_ENV})"
[[ "${START_PAGE_MIN_SHARE}" =~ ^(0(\.[0-9]+)?|1(\.0*)?|\.[0-9]+)$ ]] ||
    die "START_PAGE_MIN_SHARE must be a share between 0 and 1, not '${START_PAGE_MIN_SHARE}' (${CONFIG_ENV})"
((ENV_SERVERS_PER_NODE >= 1 || ${#ENV_SERVER_URLS} > 0)) || die "ENV_SERVERS_PER_NODE must be at least 1"
((MAX_TOKEN_LEN_PER_GPU >= MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH)) ||
    die "MAX_TOKEN_LEN_PER_GPU (${MAX_TOKEN_LEN_PER_GPU}) must hold one whole episode: >= MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH"
[[ -n "${MODEL_PATH}" ]] || die "MODEL_PATH is not set (${CONFIG_ENV}): a local model folder every node reads"
if [[ "${MODEL_PATH}" == /* || "${MODEL_PATH}" == .* ]]; then
    [[ -f "${MODEL_PATH}/config.json" ]] || die "MODEL_PATH ${MODEL_PATH} has no config.json"
else
    log "WARNING: MODEL_PATH ${MODEL_PATH} is not a local folder: every node will fetch it from the Hugging Face Hub, and the prompt checks (chat template, prompt lengths) are skipped; a local folder gets them"
fi
for file in "${TRAIN_FILES}" "${VAL_FILES}"; do
    [[ -s "${file}" ]] || die "data file ${file} is missing or empty: python prepare_webvoyager_data.py --output-dir ${DATA_DIR} ..."
done
if [[ "${JUDGE_ENABLE}" == 1 && -n "${JUDGE_API_KEY_ENV}" && -z "${!JUDGE_API_KEY_ENV:-}" ]]; then
    die "JUDGE_API_KEY_ENV names ${JUDGE_API_KEY_ENV}, which is not set in this environment; export it before sbatch"
fi
if [[ ",${LOGGER}," == *",wandb,"* && -z "${WANDB_API_KEY:-}" && "${WANDB_MODE:-}" != offline ]]; then
    die "LOGGER has wandb but neither WANDB_API_KEY nor WANDB_MODE=offline is set"
fi
metrics_to=""
if [[ ",${LOGGER}," == *,file,* ]]; then metrics_to+="; verl's file logger writes ${VERL_FILE_LOGGER_PATH}"; fi
if [[ ",${LOGGER}," == *,tensorboard,* ]]; then metrics_to+="; TensorBoard writes ${TENSORBOARD_DIR}"; fi
if [[ -n "${metrics_to}" ]]; then
    log "metrics: LOGGER=${LOGGER}${metrics_to}"
else
    log "note: LOGGER=${LOGGER} keeps no metrics file: add file (or tensorboard) to read them after the job"
fi
if [[ "${VERL_USE_EXTERNAL_PLUGINS:-auto}" == none ]]; then
    log "note: VERL_USE_EXTERNAL_PLUGINS=none; the trainer wiring comes from sitecustomize.py on PYTHONPATH"
fi
command -v "${PYTHON}" >/dev/null || die "PYTHON ${PYTHON} not found"
PYTHON="$(command -v "${PYTHON}")"
# A port something else already listens on would answer our readiness and smoke checks in place of our server.
bash -c "${PORTS_FREE}" ports-free "${RAY_PORT}" || die "RAY_PORT ${RAY_PORT} is already in use on ${HEAD_NODE}"
if [[ -z "${ENV_SERVER_URLS}" ]]; then
    ports=()
    for ((k = 0; k < ENV_SERVERS_PER_NODE; k++)); do ports+=("$((ENV_BASE_PORT + k))"); done
    for node in "${NODES[@]}"; do
        run_on "${node}" bash -c "${PORTS_FREE}" ports-free "${ports[@]}" ||
            die "a port in ${ports[*]} is already in use on ${node}: choose another ENV_BASE_PORT"
    done
fi
log "check: config.env, model, data files ($(wc -l <"${TRAIN_FILES}") train / $(wc -l <"${VAL_FILES}") val rows), free ports: ok"

# What training will run, on every node at once (node_check.py, seconds each): verl, CUDA torch and the GPUs Slurm
# gave, vLLM and flash-attn when the settings need them, Chromium and the gym venv. A node that fails is named with
# the fix. The head node's report is shown whole, another node's only when it fails; each is in RUN_DIR.
node_check_args=(--chromium "${CHROMIUM_PATH}" --gym-venv "${GYM_VENV}")
if [[ -n "${ENV_SERVER_URLS}" ]]; then node_check_args+=(--no-environment-server); fi
node_check_timeout_s=300  # torch imported cold from a shared file system, then the gym venv's imports (120 s at most)
t0=$SECONDS
node_checks=()
for node in "${NODES[@]}"; do
    run_on "${node}" "${NO_CREDENTIALS[@]}" timeout -k 5 "${node_check_timeout_s}" "${PYTHON}" \
        "${RECIPE_DIR}/node_check.py" "${node_check_args[@]}" -- "${OVERRIDES[@]}" >"${RUN_DIR}/node-check-${node}.log" 2>&1 &
    node_checks+=("$!:${node}")
done
failed_nodes=()
for entry in "${node_checks[@]}"; do
    node="${entry#*:}"
    if wait "${entry%%:*}"; then
        if [[ "${node}" == "${HEAD_NODE}" ]]; then cat "${RUN_DIR}/node-check-${node}.log"; fi
    else
        check_rc=$?
        failed_nodes+=("${node}")
        cat "${RUN_DIR}/node-check-${node}.log" >&2
        if ((check_rc == 124)); then echo "node-check ${node}: did not finish within ${node_check_timeout_s} s" >&2; fi
    fi
done
((${#failed_nodes[@]} == 0)) ||
    die "the node check failed on ${failed_nodes[*]}: each FAIL line above names the fix (${RUN_DIR}/node-check-<node>.log)"
log "node check passed on ${#NODES[@]} node(s) in $((SECONDS - t0)) s"
RAY_BIN="$(dirname "${PYTHON}")/ray"
[[ -x "${RAY_BIN}" ]] || RAY_BIN="$(command -v ray || true)"
[[ -n "${RAY_BIN}" ]] || die "no ray command next to ${PYTHON} or on PATH"

# ================================================================================================================
# 2. The full verl config, composed with every override, then checked (no GPU, nothing started)
# ================================================================================================================
printf '%s\n' "${OVERRIDES[@]}" >"${RUN_DIR}/overrides.txt"
t0=$SECONDS
"${MAIN_PPO[@]}" "${OVERRIDES[@]}" --cfg job >"${RUN_DIR}/composed_config.yaml" 2>"${RUN_DIR}/compose.log" || {
    tail -n 30 "${RUN_DIR}/compose.log" >&2
    die "verl could not compose the config with these overrides (${RUN_DIR}/overrides.txt)"
}
log "config composed by verl.trainer.main_ppo --cfg job in $((SECONDS - t0)) s: ${RUN_DIR}/composed_config.yaml"
# What verl will resume from (refused when made from another model or other data), and disk for the kept checkpoints.
checkpoint_args=(--config "${RUN_DIR}/composed_config.yaml")
if [[ "${RESUME_ACROSS_CHANGES}" == 1 ]]; then checkpoint_args+=(--across-changes); fi
"${PYTHON}" "${RECIPE_DIR}/checkpointing.py" "${checkpoint_args[@]}" || die "the checkpoint checks failed (above)"
preflight_args=(--config "${RUN_DIR}/composed_config.yaml")
judge_probe=()
if [[ "${JUDGE_ENABLE}" == 1 && "${JUDGE_PROBE}" == 1 ]]; then judge_probe=(--probe-judge); fi
preflight_args+=("${judge_probe[@]}")
if [[ "${JUDGE_ON_EVERY_NODE}" == 1 ]]; then preflight_args+=(--judge-on-every-node); fi
t0=$SECONDS
"${PYTHON}" "${RECIPE_DIR}/preflight.py" "${preflight_args[@]}" || die "the composed config failed its checks (above)"
log "config checked by preflight.py in $((SECONDS - t0)) s"

# ================================================================================================================
# 3. Environment servers on every node, then 4. a smoke episode against each, from its own node
# ================================================================================================================
# Browsers are CPU and memory heavy (a Chromium process tree per session) and one server keeps all its browsers in
# one Python process, so each node runs several servers, pinned to ENV_CPUS (cores the trainer does not use).
mapfile -t URLS < <(server_urls)
if [[ -z "${ENV_SERVER_URLS}" ]]; then
    env_prefix=()
    if [[ -n "${ENV_CPUS}" ]]; then env_prefix=(taskset -c "${ENV_CPUS}"); fi
    t0=$SECONDS
    declare -A ENV_LOGS=()
    for node in "${NODES[@]}"; do
        for ((k = 0; k < ENV_SERVERS_PER_NODE; k++)); do
            port=$((ENV_BASE_PORT + k))
            logfile="${RUN_DIR}/env-${node}-${port}.log"
            launch "env-${node}-${port}" "${node}" "${logfile}" "${env_prefix[@]}" "${NO_CREDENTIALS[@]}" "${PYTHON}" \
                "${RECIPE_DIR}/launch_environment.py" --port "${port}" --backend "${ENV_BACKEND}" \
                --gym-venv "${GYM_VENV}" --chromium "${CHROMIUM_PATH}" --startup-timeout "${ENV_STARTUP_TIMEOUT_S}" \
                --no-probe
            ENV_LOGS["${LAST_PID}"]="${logfile}"
        done
    done
    # Bounded by ENV_STARTUP_TIMEOUT_S (the launcher gives up by itself at that point, with a diagnosis) + 30 s.
    deadline=$((SECONDS + ENV_STARTUP_TIMEOUT_S + 30))
    for pid in "${!ENV_LOGS[@]}"; do
        logfile="${ENV_LOGS[${pid}]}"
        until grep -q "ready in" "${logfile}" 2>/dev/null; do
            alive "${pid}" || { tail -n 30 "${logfile}" >&2; die "environment server exited during start-up: ${logfile}"; }
            ((SECONDS < deadline)) || { tail -n 30 "${logfile}" >&2; die "environment server not up after ${ENV_STARTUP_TIMEOUT_S} s: ${logfile}"; }
            sleep 1
        done
    done
    log "environment servers up: ${ENV_SERVERS_PER_NODE} per node on ${#NODES[@]} node(s), 127.0.0.1 ports ${ENV_BASE_PORT}-$((ENV_BASE_PORT + ENV_SERVERS_PER_NODE - 1)), backend ${ENV_BACKEND}, in $((SECONDS - t0)) s"
else
    log "environment servers: using ENV_SERVER_URLS (${URLS[*]}); this job starts none"
fi

t0=$SECONDS
smoke_pids=()
for node in "${NODES[@]}"; do
    logfile="${RUN_DIR}/smoke-${node}.log"
    # One smoke per server, in turn, from the node itself: exactly the address its rollout workers will use.
    # shellcheck disable=SC2016  # expanded by the inner bash
    run_on "${node}" "${NO_CREDENTIALS[@]}" timeout "$((SMOKE_TIMEOUT_S * ${#URLS[@]} + 30))" bash -c '
        py="$1"; script="$2"; timeout_s="$3"; shift 3
        for url in "$@"; do
            echo "== smoke ${url}"
            "${py}" "${script}" --url "${url}" --timeout "${timeout_s}" || exit 1
        done' smoke "${PYTHON}" "${RECIPE_DIR}/smoke_environment.py" "${SMOKE_TIMEOUT_S}" "${URLS[@]}" \
        >"${logfile}" 2>&1 &
    smoke_pids+=("$!:${node}")
done
for entry in "${smoke_pids[@]}"; do
    node="${entry#*:}"
    wait "${entry%%:*}" || { tail -n 30 "${RUN_DIR}/smoke-${node}.log" >&2; die "smoke episode failed on ${node}: ${RUN_DIR}/smoke-${node}.log"; }
done
log "smoke episodes walked and verified on ${#URLS[@]} server(s) x ${#NODES[@]} node(s) in $((SECONDS - t0)) s"

# The task sites from every node: a sample of the data's start pages, opened through the node's first server as an
# episode opens them. A node that cannot reach them would fail every seed, and the run would train on nothing.
if ((START_PAGE_SAMPLE == 0)); then
    log "start pages: not checked (START_PAGE_SAMPLE=0): nothing shows whether the nodes reach the task sites"
else
    t0=$SECONDS
    page_pids=()
    for node in "${NODES[@]}"; do
        # 8 pages at a time (start_pages.py's default), each bounded by SMOKE_TIMEOUT_S to load and to be observed
        # and its close by 45 s; 45 s more for the rest.
        waves=$(((START_PAGE_SAMPLE + 7) / 8))
        run_on "${node}" "${NO_CREDENTIALS[@]}" timeout "$((waves * (2 * SMOKE_TIMEOUT_S + 45) + 45))" "${PYTHON}" \
            "${RECIPE_DIR}/start_pages.py" --url "${URLS[0]}" --data "${TRAIN_FILES}" "${VAL_FILES}" \
            --sample "${START_PAGE_SAMPLE}" --min-share "${START_PAGE_MIN_SHARE}" --timeout "${SMOKE_TIMEOUT_S}" \
            --node "${node}" >"${RUN_DIR}/start-pages-${node}.log" 2>&1 &
        page_pids+=("$!:${node}")
    done
    short_nodes=()
    for entry in "${page_pids[@]}"; do
        node="${entry#*:}"
        logfile="${RUN_DIR}/start-pages-${node}.log"
        page_rc=0
        wait "${entry%%:*}" || page_rc=$?
        while IFS= read -r line; do log "${line}"; done < <(grep -E \
            '^(start pages: none|proxy for the environment server|[0-9]+ of [0-9]+ start pages loaded on )' "${logfile}")
        if ((page_rc == 1)) && grep -q ' start pages loaded on ' "${logfile}"; then
            grep -E '^  FAIL |^likely cause: ' "${logfile}" >&2 || true
            short_nodes+=("${node}")
        elif ((page_rc != 0)); then
            tail -n 20 "${logfile}" >&2
            die "the start-page check could not run on ${node} (exit status ${page_rc}): ${logfile}"
        fi
    done
    ((${#short_nodes[@]} == 0)) || die "too few of the data's start pages loaded on ${short_nodes[*]} (START_PAGE_MIN_SHARE=${START_PAGE_MIN_SHARE}): the node(s) may have no route to the task sites, or need a proxy that is not set (HTTPS_PROXY/HTTP_PROXY/NO_PROXY in the job's environment reach Chromium); ${RUN_DIR}/start-pages-<node>.log lists each page and what the server said"
    log "start pages checked on ${#NODES[@]} node(s) in $((SECONDS - t0)) s"
fi

# ================================================================================================================
# 5. Ray: a head on this node, one worker per other node
# ================================================================================================================
# node_address NODE: the address the other nodes reach NODE at. Slurm's NodeAddr for it (what slurmctld itself uses)
# when that is an IPv4 address or a name resolving to a non-loopback one; else the node's first `hostname -I`
# address, which on a node with a Docker bridge or several networks may be the wrong one (set NodeAddr or
# RAY_HEAD_IP). Never the node name's own resolution: Debian maps a host's own name to 127.0.1.1.
node_address() {
    local node="$1" addr=""
    addr="$(scontrol show node -o "${node}" 2>/dev/null | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')"
    if [[ -n "${addr}" && ! "${addr}" =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then
        addr="$(getent ahostsv4 "${addr}" 2>/dev/null | awk '$1 !~ /^127\./ {print $1; exit}')"
    fi
    if [[ -z "${addr}" ]]; then addr="$(run_on "${node}" hostname -I 2>/dev/null | awk '{print $1}')"; fi
    echo "${addr}"
}

declare -A NODE_IPS=()
if ((NNODES == 1)); then
    # One node: everything on loopback. Ray replaces a loopback node address by the machine's first interface
    # address unless it believes it runs a local-only cluster; this switch (honoured on Linux too) says so.
    RAY_HEAD_IP=127.0.0.1
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
else
    # The one-node switch above, exported by a config.env (the CPU test backend's environment does), makes every
    # Ray worker node refuse to start ("Multi-node Ray clusters are not supported on Windows and OSX").
    if [[ "${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-}" == 0 ]]; then
        log "note: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is a one-node setting; unset for this ${NNODES}-node run"
        unset RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    fi
    # Every Ray node registers at the address the others reach it at: the head's is where the workers connect.
    for node in "${NODES[@]}"; do
        NODE_IPS["${node}"]="$(node_address "${node}")"
        [[ -n "${NODE_IPS[${node}]}" ]] || die "no address for node ${node}: Slurm gives no usable NodeAddr and the node lists none"
    done
    if [[ -n "${RAY_HEAD_IP}" ]]; then NODE_IPS["${HEAD_NODE}"]="${RAY_HEAD_IP}"; else RAY_HEAD_IP="${NODE_IPS[${HEAD_NODE}]}"; fi
    addresses=()
    for node in "${NODES[@]}"; do addresses+=("${node}=${NODE_IPS[${node}]}"); done
    log "node addresses: ${addresses[*]}"
fi
export RAY_ADDRESS="${RAY_HEAD_IP}:${RAY_PORT}"
ray_resources=()
if [[ -n "${RAY_NUM_CPUS}" ]]; then ray_resources+=(--num-cpus="${RAY_NUM_CPUS}"); fi
if [[ -n "${RAY_NUM_GPUS}" ]]; then ray_resources+=(--num-gpus="${RAY_NUM_GPUS}"); fi
# Its own temp dir: `ray start` records the cluster address there, and a default /tmp/ray would make every other
# `ray.init()` on the node join this cluster. One per node (RAY_TMPDIR/<node>): on a shared /tmp the nodes' sessions
# would otherwise share one folder, their logs and node files. Kept short: Ray's socket paths live under it.
ray_common=(--block --disable-usage-stats "${ray_resources[@]}")

ray_alive_nodes() {
    timeout -k 5 30 "${RAY_BIN}" status --address="${RAY_ADDRESS}" 2>/dev/null |
        awk '/^Active:/{a=1; next} /^(Pending|Recent failures):/{a=0} a && /node_/{n++} END{print n+0}'
}

t0=$SECONDS
launch "ray-head" "${HEAD_NODE}" "${RUN_DIR}/ray-head.log" "${RAY_BIN}" start --head \
    --node-ip-address="${RAY_HEAD_IP}" --port="${RAY_PORT}" --include-dashboard=false \
    --temp-dir="${RAY_TMPDIR}/${HEAD_NODE}" "${ray_common[@]}"
RAY_HEAD_PID=$LAST_PID
# A head takes 5-15 s; RAY_HEAD_TIMEOUT_S leaves room for a slow shared file system and a loaded node.
deadline=$((SECONDS + RAY_HEAD_TIMEOUT_S))
until (($(ray_alive_nodes) >= 1)); do
    alive "${RAY_HEAD_PID}" || { tail -n 30 "${RUN_DIR}/ray-head.log" >&2; die "the Ray head exited: ${RUN_DIR}/ray-head.log"; }
    ((SECONDS < deadline)) || die "the Ray head did not answer within ${RAY_HEAD_TIMEOUT_S} s: ${RUN_DIR}/ray-head.log"
    sleep 2
done
log "Ray head up at ${RAY_ADDRESS}$([[ ${RAY_HEAD_IP} == 127.* ]] && echo ' (loopback)') in $((SECONDS - t0)) s"

# What this run listens on (this node): with one node, all of it must be loopback.
report_listening_sockets() {
    command -v ss >/dev/null || return 0
    local line pid address loopback=() other=()
    marked_pids
    while read -r line; do
        address="$(awk '{print $4}' <<<"${line}")"
        for pid in "${MARKED[@]}"; do
            if [[ "${line}" == *"pid=${pid},"* ]]; then
                if [[ "${address}" =~ ^(127\.|\[::ffff:127\.|\[::1\]) ]]; then loopback+=("${address}"); else other+=("${address}"); fi
                break
            fi
        done
    done < <(ss -ltnpH 2>/dev/null)
    log "listening sockets of this run on ${HEAD_NODE}: ${#loopback[@]} on loopback, ${#other[@]} elsewhere${other[*]:+: ${other[*]}}"
    if ((NNODES == 1 && ${#other[@]} > 0)); then log "WARNING: a single-node run listens beyond loopback"; fi
}
report_listening_sockets

declare -A RAY_WORKERS=()
for node in "${NODES[@]:1}"; do
    launch "ray-worker-${node}" "${node}" "${RUN_DIR}/ray-worker-${node}.log" "${RAY_BIN}" start \
        --address="${RAY_ADDRESS}" --node-ip-address="${NODE_IPS[${node}]}" --temp-dir="${RAY_TMPDIR}/${node}" \
        "${ray_common[@]}"
    RAY_WORKERS["${LAST_PID}"]="${node}"
done
# Workers are started in parallel; a node that has not joined after RAY_WORKERS_TIMEOUT_S is a broken node, and a
# worker that exits has failed to join.
deadline=$((SECONDS + RAY_WORKERS_TIMEOUT_S))
until (($(ray_alive_nodes) >= NNODES)); do
    for pid in "${!RAY_WORKERS[@]}"; do
        node="${RAY_WORKERS[${pid}]}"
        alive "${pid}" || {
            tail -n 20 "${RUN_DIR}/ray-worker-${node}.log" >&2
            die "the Ray worker on ${node} (${NODE_IPS[${node}]}) exited without joining the head at ${RAY_ADDRESS}: ${RUN_DIR}/ray-worker-${node}.log"
        }
    done
    if ((SECONDS >= deadline)); then
        for pid in "${!RAY_WORKERS[@]}"; do tail -n 5 "${RUN_DIR}/ray-worker-${RAY_WORKERS[${pid}]}.log" >&2; done
        die "only $(ray_alive_nodes) of ${NNODES} Ray nodes joined the head at ${RAY_ADDRESS} within ${RAY_WORKERS_TIMEOUT_S} s; workers started on ${NODES[*]:1} (${RUN_DIR}/ray-worker-*.log): can they reach ${RAY_ADDRESS}?"
    fi
    sleep 3
done
log "Ray cluster: ${NNODES} of ${NNODES} node(s) joined in $((SECONDS - t0)) s"
# Shell variables reach Ray workers only through the raylet's environment, and rollouts call the judge from every
# node: ask a worker on every node what it sees and whether the judge answers there.
t0=$SECONDS
"${PYTHON}" "${RECIPE_DIR}/preflight.py" --config "${RUN_DIR}/composed_config.yaml" --ray-workers "${judge_probe[@]}" ||
    die "the Ray workers do not see the recipe's settings or do not reach the judge (above)"
log "settings checked inside Ray workers on every node in $((SECONDS - t0)) s"

if [[ "${MODE}" == dry-run ]]; then
    log "dry run passed: config composed and checked, environment servers up and smoked, Ray cluster formed and checked (no GPU used)"
    exit 0
fi

# ================================================================================================================
# 6. Training
# ================================================================================================================
if [[ "${VERL_PLATFORM:-}" == cpu ]]; then
    # local/cpu_backend (config.env exports VERL_PLATFORM=cpu): the CPU stand-in for tests and rehearsals only.
    log "WARNING: VERL_PLATFORM=cpu: training on the CPU test backend (hfcpu rollout), not on GPUs"
elif command -v nvidia-smi >/dev/null; then
    gpus_here="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    ((gpus_here >= GPUS_PER_NODE)) || die "GPUS_PER_NODE=${GPUS_PER_NODE} but nvidia-smi lists ${gpus_here} GPU(s) on ${HEAD_NODE}"
else
    die "no nvidia-smi on ${HEAD_NODE}: training needs GPU nodes (use --dry-run for the checks alone)"
fi
# The checks again (the folder may have changed since step 2), then this run's fingerprint beside its checkpoints.
"${PYTHON}" "${RECIPE_DIR}/checkpointing.py" "${checkpoint_args[@]}" --record --run-id "${RUN_ID}" ||
    die "the checkpoint checks failed (above)"
log "training: ${MAIN_PPO[*]} (overrides: ${RUN_DIR}/overrides.txt)"
"${MAIN_PPO[@]}" "${OVERRIDES[@]}" &
TRAINER_PID=$!
wait "${TRAINER_PID}"
