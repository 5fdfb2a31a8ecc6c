"""The MiniWoB++ suite as NeMo Gym rows, and the command that writes them or serves the site they name.

A row is one problem: a task of :data:`~.inventory.INCLUDED` and a seed of one split (:func:`~.inventory.seeds`),
started at ``http://127.0.0.1:8766/miniwob/<task>.html?seed=<seed>`` and graded by ``/verify`` on the problem's
completion code (:mod:`.grading`). Rows are built by the recipe's own row builder (``task_rows.build_row``) and
carry ``data_source = "miniwob/<task>"``, so verl's validation metrics come out per task. The prompt names no answer:
the instruction is on the page, drawn from the seed.

The codes come from a key file (``--key-file``, made on first use, readable by its owner only): the rows and the
site serving them must use the same key, and the policy must never read it.

    python -m nemo_gym_browser.local.miniwob.suite rows --key-file ~/.miniwob.key --output-dir data/miniwob
    python -m nemo_gym_browser.local.miniwob.suite serve --key-file ~/.miniwob.key      # until interrupted

Exit status: 0 done, 2 usage or input error (an unknown task, a bad key file, miniwob not installed).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...gym_contract.rows import validate_initial_url, validate_verifier_metadata
from ...task_lists.task_rows import TOOL_INTERFACES, build_row
from ...task_lists.tasks import Task
from .grading import GradeKey, GradeKeyError, verifier_metadata
from .inventory import SPLITS, included_tasks, seeds
from .pages import MiniWobMissing
from .site import MINIWOB_PORT, MiniWobSite, task_url

SITE_NAME = "MiniWoB++"
QUESTION = 'Do what the instruction at the start of the page text asks. When the page says "Episode over.", finish.'
ROW_FILES = {"train": "miniwob_train.jsonl", "heldback": "miniwob_heldback.jsonl"}
DATA_SOURCE_PREFIX = "miniwob/"


def task_id(task: str, seed: int) -> str:
    return f"miniwob--{task}--{seed}"


def task_row(
    key: GradeKey, task: str, seed: int, split: str, *, port: int = MINIWOB_PORT, tool_interface: str = "browser"
) -> dict[str, Any]:
    """The row of one problem."""
    url = validate_initial_url(task_url(task, seed, port=port))
    spec = Task(
        task_id=task_id(task, seed),
        question=QUESTION,
        site=f"{SITE_NAME} {task}",
        initial_url=url,
        verifier_metadata=validate_verifier_metadata(verifier_metadata(key, task, seed)),
        reference_answer=None,
        reference_type=None,
        metadata={"miniwob_task": task, "seed": seed, "split": split},
        location=f"miniwob {task} seed {seed}",
    )
    row = build_row(spec, tool_interface)
    row["data_source"] = DATA_SOURCE_PREFIX + task
    return row


def suite_rows(
    key: GradeKey,
    split: str,
    per_task: int,
    *,
    tasks: Sequence[str] | None = None,
    port: int = MINIWOB_PORT,
    tool_interface: str = "browser",
) -> list[dict[str, Any]]:
    """``per_task`` rows of each task (every included task by default) on the first seeds of ``split``."""
    chosen = list(tasks) if tasks is not None else included_tasks()
    unknown = sorted(set(chosen) - set(included_tasks()))
    if unknown:
        raise ValueError(f"not included MiniWoB tasks: {', '.join(unknown)} (see local/miniwob/inventory.py)")
    return [
        task_row(key, task, seed, split, port=port, tool_interface=tool_interface)
        for task in chosen
        for seed in seeds(split, per_task)
    ]


def write_rows(
    key: GradeKey,
    output_dir: Path,
    *,
    per_task: dict[str, int],
    tasks: Sequence[str] | None = None,
    port: int = MINIWOB_PORT,
    tool_interface: str = "browser",
) -> dict[str, Path]:
    """One JSONL file per split of ``per_task`` (``{"train": 64, "heldback": 16}``); returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, count in per_task.items():
        rows = suite_rows(key, split, count, tasks=tasks, port=port, tool_interface=tool_interface)
        path = output_dir / ROW_FILES[split]
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        written[split] = path
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.miniwob.suite",
        description="Write the MiniWoB++ suite's rows, or serve its pages on 127.0.0.1.",
        epilog="example: ... rows --key-file ~/.miniwob.key --output-dir data/miniwob --train-per-task 64",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    rows = commands.add_parser("rows", help="write miniwob_train.jsonl and miniwob_heldback.jsonl")
    serve = commands.add_parser("serve", help="serve the adapted pages until interrupted")
    for command in (rows, serve):
        command.add_argument("--key-file", type=Path, required=True, help="the grade key (made when missing)")
        command.add_argument("--port", type=int, default=MINIWOB_PORT, help=f"the site's port (default {MINIWOB_PORT})")
    rows.add_argument("--output-dir", type=Path, required=True)
    rows.add_argument("--train-per-task", type=int, default=64)
    rows.add_argument("--heldback-per-task", type=int, default=16)
    rows.add_argument("--tasks", help="comma-separated task names (default: every included task)")
    rows.add_argument("--tool-interface", choices=TOOL_INTERFACES, default="browser")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        key = GradeKey.load_or_create(args.key_file)
        if args.command == "serve":
            site = MiniWobSite(key, port=args.port).start()
            print(f"serving MiniWoB++ at {site.url}/miniwob/<task>.html?seed=<n>; Ctrl-C stops", flush=True)
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                pass
            finally:
                site.stop()
            return 0
        tasks = args.tasks.split(",") if args.tasks else None
        written = write_rows(
            key,
            args.output_dir,
            per_task={"train": args.train_per_task, "heldback": args.heldback_per_task},
            tasks=tasks,
            port=args.port,
            tool_interface=args.tool_interface,
        )
    except (GradeKeyError, MiniWobMissing, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for split in SPLITS:
        print(f"{split}: {written[split]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
