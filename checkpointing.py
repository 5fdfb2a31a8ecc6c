"""A run's checkpoints, checked before it starts: what verl will resume from, whether that checkpoint was made from
this run's model and data, and whether the disk holds the checkpoints the run keeps.

Resume: :func:`resume_plan` finds the ``global_step_N`` folder verl 0.9.1's V1 trainer will load (``resume_mode``
``disable``, ``auto``: the one ``latest_checkpointed_iteration.txt`` names, ``resume_path``). A run never starts in a
folder holding checkpoints past its first step (verl would overwrite them one by one).

Fingerprints: ``--record`` (right before training) writes :data:`FINGERPRINT_FILE` into the checkpoint folder (model,
content hash of every data file, :data:`DATA_SETTINGS`), after giving every ``global_step_N`` without one the folder's
previous fingerprint, so each checkpoint keeps the one of the run that saved it. Resuming a checkpoint whose
fingerprint differs or is missing is refused, naming what differs, unless ``--across-changes``.

Disk: parameters x :func:`bytes_per_parameter` x :func:`checkpoints_held`, against the free space.

Exit codes: 0 every check passed, 1 a check failed (each says what to change), 2 unreadable input. Imports no verl.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FINGERPRINT_FILE = "nemo_gym_browser_fingerprint.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's get_checkpoint_tracker_filename
# What a checkpoint saved before any fingerprint was written in its folder keeps: it matches no run.
UNKNOWN_ORIGIN = b'{"origin": "saved before a fingerprint was written in this folder"}\n'
STEP_FOLDER = re.compile(r"global_step_(\d+)")
# Settings that decide what a saved data loader position means: the sampler's order and its unit (a batch of rows),
# and the tools the rows' prompts teach.
DATA_SETTINGS = ("data.train_batch_size", "data.shuffle", "data.seed", "tool_config")
# Bytes per parameter of what verl's FSDP checkpoint manager saves, by ``actor.checkpoint.save_contents`` entry:
# the sharded parameters in ``actor.fsdp_config.model_dtype``, AdamW's two moments in fp32, and a bf16 copy in
# Hugging Face format. "extra" (scheduler and RNG states) is a few kilobytes.
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}
OPTIMIZER_BYTES = 8
HF_MODEL_BYTES = 2
GB = 1e9

EXAMPLES = """\
examples:
  python checkpointing.py --config composed.yaml                    # the dry run's check
  python checkpointing.py --config composed.yaml --across-changes   # resume a checkpoint of other data anyway
  python checkpointing.py --config composed.yaml --record --run-id RUN   # training starts: write the fingerprint

exit codes: 0 all checks passed, 1 a check failed, 2 usage or unreadable input
"""


class CheckFailed(Exception):
    """A check found something to change before the run."""


@dataclass(frozen=True)
class Finding:
    name: str
    status: str  # "ok", "warn" or "FAIL"
    detail: str


@dataclass(frozen=True)
class ResumePlan:
    """Where the run's checkpoints go and which one verl loads at start (None: it starts at step 0)."""

    mode: str
    folder: Path
    checkpoint: Path | None

    @property
    def start_step(self) -> int:
        return 0 if self.checkpoint is None else step_of(self.checkpoint)


def _absolute(path: object) -> Path:
    """A path as verl resolves it: relative to the working directory (the script's, where main_ppo starts)."""
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def step_of(step_folder: Path | str) -> int:
    """The step verl reads from a checkpoint folder's path (what follows its last ``global_step_``, a number)."""
    digits = str(step_folder).split("global_step_")[-1]
    if not digits.isdigit():
        raise CheckFailed(f"{step_folder}: a checkpoint folder is named global_step_<N> (verl reads the step from it)")
    return int(digits)


def step_folders(folder: Path) -> dict[int, Path]:
    """The ``global_step_N`` folders in ``folder`` by step."""
    if not folder.is_dir():
        return {}
    found = {}
    for entry in folder.iterdir():
        match = STEP_FOLDER.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def resume_plan(config: Any) -> ResumePlan:
    """The checkpoint verl 0.9.1's V1 trainer will load (``_load_checkpoint``), or why it would fail to."""
    trainer = config.trainer
    mode = str(trainer.resume_mode)
    folder = _absolute(trainer.default_local_dir)
    if mode == "disable":
        return ResumePlan(mode, folder, None)
    if mode == "auto":
        tracker = folder / TRACKER_FILE
        if not tracker.is_file():
            return ResumePlan(mode, folder, None)
        text = tracker.read_text(errors="replace").strip()
        if not text.isdigit():
            raise CheckFailed(f"{tracker} holds {text[:40]!r}, not a step number: verl could not resume from it")
        checkpoint = folder / f"global_step_{int(text)}"
        return ResumePlan(mode, folder, checkpoint if checkpoint.exists() else None)
    if mode == "resume_path":
        path = trainer.resume_from_path
        if not isinstance(path, str) or "global_step_" not in path:
            raise CheckFailed(f"trainer.resume_from_path={path!r} must name a global_step_<N> folder (RESUME)")
        step_of(path)  # as verl reads it: "global_step_40/" would fail there
        checkpoint = _absolute(path)
        if not checkpoint.is_dir():
            raise CheckFailed(f"RESUME names {checkpoint}, which does not exist")
        if not (checkpoint / "actor").is_dir():
            raise CheckFailed(f"RESUME names {checkpoint}, which has no actor/ (verl's rotation removed it)")
        return ResumePlan(mode, folder, checkpoint)
    raise CheckFailed(f"trainer.resume_mode={mode!r}: verl knows disable, auto and resume_path (RESUME=off|auto|PATH)")


# --- fingerprints ---------------------------------------------------------------------------------------------------


def _file_list(files: Any) -> list[str]:
    if isinstance(files, str):
        return [files]
    return [str(item) for item in files]


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(config: Any) -> dict[str, Any]:
    """What a checkpoint of this run depends on, beyond the weights: the model it started from, the data (by
    content, so a moved file is the same data) and :data:`DATA_SETTINGS`."""
    model = str(config.actor_rollout_ref.model.path)
    if _absolute(model).is_dir():
        model = str(_absolute(model).resolve())
    data = config.data

    def files(value: Any) -> list[dict[str, str]]:
        return [{"path": str(_absolute(f)), "sha256": file_digest(_absolute(f))} for f in _file_list(value)]

    settings = {
        "data.train_batch_size": data.train_batch_size,
        "data.shuffle": data.get("shuffle"),
        "data.seed": data.get("seed"),
        "tool_config": Path(str(config.actor_rollout_ref.rollout.multi_turn.tool_config_path)).name,
    }
    return {"model": model, "train_files": files(data.train_files), "val_files": files(data.val_files), **settings}


def differences(made_with: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the fingerprint a checkpoint was made with and this run's, in words."""
    found = []
    if made_with.get("model") != now["model"]:
        found.append(f"model: the checkpoint was made from {made_with.get('model')}, this run names {now['model']}")
    for key, label in (("train_files", "train data"), ("val_files", "val data")):
        before, after = made_with.get(key) or [], now[key]
        if [item.get("sha256") for item in before] != [item["sha256"] for item in after]:
            old = ", ".join(f"{item.get('path')} (sha256 {str(item.get('sha256'))[:12]})" for item in before)
            new = ", ".join(f"{item['path']} (sha256 {item['sha256'][:12]})" for item in after)
            found.append(f"{label}: the checkpoint was made from {old or 'none'}, this run reads {new}")
    for key in DATA_SETTINGS:
        if made_with.get(key) != now[key]:
            found.append(f"{key}: {made_with.get(key)!r} then, {now[key]!r} now")
    return found


def recorded_fingerprint(checkpoint: Path) -> tuple[dict[str, Any] | None, Path]:
    """The fingerprint ``checkpoint`` was made with: its own, else its folder's (the run that last started there
    wrote it and saved every checkpoint without one since). ``None`` when neither exists."""
    for candidate in (checkpoint / FINGERPRINT_FILE, checkpoint.parent / FINGERPRINT_FILE):
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text()), candidate
            except (OSError, ValueError):
                return None, candidate
    return None, checkpoint.parent / FINGERPRINT_FILE


def check_resume(config: Any, across_changes: bool = False) -> Finding:
    """Refuses a resume from a checkpoint made from another model or other data, and a start that would overwrite
    later checkpoints; states what the run will do."""
    plan = resume_plan(config)
    later = [path.name for step, path in step_folders(plan.folder).items() if step > plan.start_step]
    if later:
        shown = ", ".join(later[:4]) + (f" and {len(later) - 4} more" if len(later) > 4 else "")
        raise CheckFailed(
            f"{plan.folder} holds checkpoints past step {plan.start_step}, where this run starts "
            f"(RESUME={'off' if plan.mode == 'disable' else plan.mode}): {shown}; verl would overwrite them as it "
            "reaches those steps, mixing two runs in one folder. Choose a new EXPERIMENT_NAME (RESUME can still name "
            "a checkpoint of the old one), or move those checkpoints away"
        )
    if plan.checkpoint is None:
        why = {"disable": "RESUME=off", "auto": f"RESUME=auto and no checkpoint in {plan.folder}"}[plan.mode]
        return Finding("resume", "ok", f"{why}: training starts at step 0, checkpoints go to {plan.folder}")
    made_with, source = recorded_fingerprint(plan.checkpoint)
    now = fingerprint(config)
    if made_with is None or "model" not in made_with:
        found = [f"it has no fingerprint ({source}: none, or unreadable), so nothing shows what it was made from"]
    else:
        found = differences(made_with, now)
    resumes = f"resumes from {plan.checkpoint} (step {plan.start_step}, RESUME={plan.mode})"
    if not found:
        return Finding("resume", "ok", f"{resumes}; made from the same model, data and data settings")
    if across_changes:
        return Finding("resume", "warn", f"{resumes} although RESUME_ACROSS_CHANGES=1 and " + "; ".join(found))
    raise CheckFailed(
        f"RESUME={plan.mode} would resume from {plan.checkpoint}, which was not made from this run's model and data: "
        + "; ".join(found)
        + ". Choose a new EXPERIMENT_NAME to start a new run (or RESUME=off in a new folder), or set "
        "RESUME_ACROSS_CHANGES=1 to continue that checkpoint with this model and data"
    )


def record(config: Any, run_id: str) -> Path:
    """Training starts: each checkpoint of the folder keeps the fingerprint it was saved under, then the folder gets
    this run's."""
    plan = resume_plan(config)
    plan.folder.mkdir(parents=True, exist_ok=True)
    target = plan.folder / FINGERPRINT_FILE
    previous = target.read_bytes() if target.is_file() else UNKNOWN_ORIGIN
    for step_folder in step_folders(plan.folder).values():
        if not (step_folder / FINGERPRINT_FILE).exists():
            (step_folder / FINGERPRINT_FILE).write_bytes(previous)
    written = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    content = {**fingerprint(config), "run_id": run_id, "written": written}
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(content, indent=2) + "\n")
    partial.replace(target)
    return target


# --- disk -----------------------------------------------------------------------------------------------------------


def _safetensors_parameters(files: Iterable[Path]) -> int:
    """Elements of every tensor in ``files``, from each file's header (8-byte length, then JSON)."""
    total = 0
    for path in files:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        total += sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")
    return total


def _config_parameters(config: dict[str, Any]) -> int:
    """A dense decoder's parameters from its ``config.json`` (Llama / Qwen2 / Mistral layout; experts multiply the
    MLP)."""
    config = config.get("text_config") or config
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    intermediate = config.get("intermediate_size") or 4 * hidden
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        attention += heads * head_dim + 2 * kv_heads * head_dim
    experts = config.get("num_local_experts") or config.get("num_experts") or 1
    mlp = experts * 3 * hidden * (config.get("moe_intermediate_size") or intermediate)
    if experts > 1:
        mlp += experts * hidden
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def parameter_count(model_dir: Path) -> tuple[int, str]:
    """The model's parameters and where the number comes from: the safetensors headers (exact) when the folder has
    weights, else its ``config.json``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return _safetensors_parameters(model_dir / shard for shard in shards), f"{len(shards)} safetensors shard(s)"
    if (model_dir / "model.safetensors").is_file():
        return _safetensors_parameters([model_dir / "model.safetensors"]), "model.safetensors"
    return _config_parameters(json.loads((model_dir / "config.json").read_text())), "config.json"


def bytes_per_parameter(config: Any) -> tuple[int, str]:
    """Bytes verl's FSDP checkpoint manager writes per actor parameter, and the parts, from the actor's
    ``checkpoint.save_contents`` and ``fsdp_config.model_dtype``."""
    actor = config.actor_rollout_ref.actor
    contents = [str(item) for item in actor.checkpoint.save_contents]
    dtype = str(actor.fsdp_config.get("model_dtype") or "fp32")
    parts = []
    if "model" in contents:
        parts.append((DTYPE_BYTES.get(dtype, 4), f"{dtype} weights"))
    if "optimizer" in contents:
        parts.append((OPTIMIZER_BYTES, "AdamW's two fp32 moments"))
    if "hf_model" in contents:
        parts.append((HF_MODEL_BYTES, "a bf16 Hugging Face copy"))
    return sum(n for n, _ in parts), " + ".join(f"{what} {n}" for n, what in parts) or "nothing"


def _rows(files: Any) -> int:
    count = 0
    for name in _file_list(files):
        with _absolute(name).open("rb") as handle:
            count += sum(1 for line in handle if line.strip())
    return count


def checkpoints_held(config: Any, start_step: int) -> tuple[int, str]:
    """The most checkpoints this run has on disk at once: it saves every ``save_freq`` steps and at its last step;
    verl's rotation (``max_actor_ckpt_to_keep`` = K) removes the oldest of them before a save when K >= 2 (K at
    once) and after it when K = 1 (2 at once). Checkpoints in the folder from before a resume are not rotated."""
    trainer = config.trainer
    save_freq = int(trainer.save_freq)
    if save_freq <= 0:
        return 0, f"trainer.save_freq={save_freq}: no checkpoint is saved"
    total = trainer.get("total_training_steps")
    if total is None:
        total = _rows(config.data.train_files) // int(config.data.train_batch_size) * int(trainer.total_epochs)
    total = int(total)
    saves = max(
        0, total // save_freq - start_step // save_freq + (1 if total % save_freq and total > start_step else 0)
    )
    keep = trainer.get("max_actor_ckpt_to_keep")
    if keep is None or int(keep) <= 0:
        return saves, f"{saves} save(s) in steps {start_step + 1}-{total}, every one kept (CHECKPOINTS_TO_KEEP=0)"
    held = min(saves, max(int(keep), 2))
    return held, f"{saves} save(s) in steps {start_step + 1}-{total}, at most {held} on disk at once (keep {keep})"


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(size: float) -> str:
    return f"{size / GB:.1f} GB" if size >= GB / 10 else f"{size / 1e6:.1f} MB"


def check_disk(config: Any) -> Finding:
    """Refuses a run whose kept checkpoints would not fit the free space where they go."""
    plan = resume_plan(config)
    held, schedule = checkpoints_held(config, plan.start_step)
    if held == 0:
        return Finding("disk", "ok", schedule)
    model = str(config.actor_rollout_ref.model.path)
    model_dir = _absolute(model)
    if not (model_dir / "config.json").is_file():
        return Finding("disk", "ok", f"{schedule}; size not estimated: {model} is not a local model folder")
    try:
        parameters, source = parameter_count(model_dir)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return Finding(
            "disk", "ok", f"{schedule}; size not estimated: {model_dir} does not give a parameter count ({exc!r})"
        )
    per_parameter, parts = bytes_per_parameter(config)
    one = parameters * per_parameter
    need = held * one
    where = _existing_ancestor(plan.folder)
    free = shutil.disk_usage(where).free
    sizes = (
        f"{held} checkpoint(s) x {_size(one)} ({parameters:,} parameters from {source} x {per_parameter} "
        f"bytes: {parts}) = {_size(need)}; {_size(free)} free at {where}"
    )
    if need > free:
        raise CheckFailed(
            f"the checkpoints do not fit: {sizes}. Free space there, keep fewer (CHECKPOINTS_TO_KEEP), save less "
            "often (SAVE_FREQ), or put CHECKPOINT_DIR on a larger file system"
        )
    return Finding("disk", "ok", f"{schedule}; {sizes}")


def run_checks(config: Any, *, across_changes: bool = False) -> list[Finding]:
    findings = []
    for name, check in (("resume", lambda: check_resume(config, across_changes)), ("disk", lambda: check_disk(config))):
        try:
            findings.append(check())
        except CheckFailed as exc:
            findings.append(Finding(name, "FAIL", str(exc)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            findings.append(Finding(name, "FAIL", f"{type(exc).__name__}: {exc}"))
    return findings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkpointing.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, required=True, help="a config composed by main_ppo --cfg job (YAML)")
    parser.add_argument(
        "--across-changes",
        action="store_true",
        help="resume a checkpoint made from another model or other data (RESUME_ACROSS_CHANGES=1), with a warning",
    )
    parser.add_argument("--record", action="store_true", help="training starts: write the fingerprint after the checks")
    parser.add_argument("--run-id", default="", help="the run's id, kept in the fingerprint")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.load(args.config)
    except (OSError, ValueError) as exc:
        print(f"checkpoints: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    findings = run_checks(config, across_changes=args.across_changes)
    for finding in findings:
        print(f"checkpoints: {finding.status:<4} {finding.name}: {finding.detail}", flush=True)
    if any(finding.status == "FAIL" for finding in findings):
        return 1
    if args.record:
        print(f"checkpoints: fingerprint written to {record(config, args.run_id)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
