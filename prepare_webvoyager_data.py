"""WebVoyager task lists -> NeMo Gym rollout rows for this recipe, split into train and validation files.

The command (``python prepare_webvoyager_data.py --help``; :func:`prepare_rows` is its library form). It reads
tasks from a local JSONL, a Hugging Face dataset (``datasets.load_dataset``) or a dataset folder written by
``save_to_disk``; parses each record (:mod:`tasks`; lines that already are NeMo Gym rows pass through, validated);
attaches WebVoyager's reference answers; filters by site; lists the tasks whose question names only dates already
past (:mod:`named_dates`); builds the rows (:mod:`task_rows`); and splits them: a task is in validation when a hash
of ``(seed, task id)`` falls below the validation fraction, so adding or removing other tasks never moves it.
A field and its alias that differ are warned about once per input, with a count and the first place.

Guarantees
    * Bad input (malformed JSON, a missing or wrong field, a duplicate id, an unknown verifier key, an unknown
      site in a filter, an empty result) exits 2 and names the file and line (or dataset record) of each error.
    * Nothing is half-written: every row is validated before any file is opened for writing, and each output
      file is written to a temporary file in the output folder and renamed into place.
    * It never contacts a website, and touches the network only when ``--hf-dataset`` names a Hub dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nemo_gym_browser.gym_contract.browser_calls import SINGLE_TOOL_NAME
from nemo_gym_browser.gym_contract.rows import VERIFIER_KEYS, RowValueError, parse_row_json
from nemo_gym_browser.gym_contract.text import shorten
from nemo_gym_browser.task_lists.named_dates import DateCheck, check_dates
from nemo_gym_browser.task_lists.task_rows import TOOL_INTERFACES, build_row
from nemo_gym_browser.task_lists.tasks import (
    ID_FIELDS,
    InputError,
    ReferenceAnswer,
    Task,
    load_reference_answers,
    parse_record,
    reference_key,
)

TRAIN_FILE = "train.jsonl"
VAL_FILE = "val.jsonl"
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_SEED = 0
# Below this many records a progress bar is noise; above it, reading a Hub dataset can take a while.
PROGRESS_MIN_RECORDS = 1000
# Enough errors to see a pattern without burying the first one.
MAX_ERRORS_SHOWN = 20
# A question longer than this is cut in the stale-date listing, which is one line per task.
LISTING_QUESTION_CHARS = 70


# ---------------------------------------------------------------------------------------------------------------------
# Reading inputs


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:line``, parsed object or the InputError that line raised) for each non-blank line."""
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            location = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield location, InputError(location, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                yield location, parse_row_json(text)
            except RowValueError as exc:
                yield location, InputError(location, str(exc))


def _count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def _dataset_records(dataset: Any, source: str) -> Iterator[tuple[str, Any]]:
    for index, record in enumerate(dataset):
        yield f"{source}#{index}", record


def load_hub_dataset(name: str, config: str | None, split: str, cache_dir: str | None) -> Any:
    """``datasets.load_dataset`` (a Hub name, or a local folder laid out like a Hub dataset repository)."""
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as exc:  # datasets raises many unrelated types; all mean "cannot use this input"
        raise InputError(f"{name}[{split}]", f"cannot load the dataset: {type(exc).__name__}: {exc}") from exc


def load_disk_dataset(path: str, split: str | None) -> tuple[Any, str]:
    """A ``Dataset`` or one split of a ``DatasetDict`` written by ``save_to_disk``."""
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # see load_hub_dataset
        raise InputError(path, f"cannot load a saved dataset: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            raise InputError(path, f"choose a split with --hf-split; the saved dataset has {splits}")
        return loaded[split], f"{path}[{split}]"
    if split is not None:
        raise InputError(path, f"--hf-split {split} given, but the saved dataset has no splits")
    return loaded, path


# ---------------------------------------------------------------------------------------------------------------------
# Split and writing


def split_of(task_id: str, seed: int, val_fraction: float) -> str:
    """The split of a task, from its own id and the seed only: adding tasks never moves another one."""
    digest = hashlib.sha256(f"{seed}\x00{task_id}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def write_jsonl_files(outputs: Mapping[Path, Iterable[Mapping[str, Any]]]) -> None:
    """Write every file or none: each goes to a temporary file beside it, and is renamed only when all are written.

    A failure removes the temporary files, and the output folder too when this call created it and it is empty.
    """
    folders = {path.parent for path in outputs}
    # every folder this call creates, deepest first, so that a failure can remove them in that order
    created = sorted(
        {folder for leaf in folders for folder in (leaf, *leaf.parents) if not folder.exists()},
        key=lambda folder: len(folder.parts),
        reverse=True,
    )
    temporaries: list[tuple[str, Path]] = []
    try:
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
        umask = os.umask(0)
        os.umask(umask)
        for path, rows in outputs.items():
            handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            temporaries.append((temporary, path))
            os.fchmod(handle, 0o666 & ~umask)  # mkstemp makes 0600; an output file gets the usual mode
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                for row in rows:
                    stream.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
                stream.flush()
                os.fsync(stream.fileno())
        for temporary, path in temporaries:
            os.replace(temporary, path)
    except BaseException:
        for temporary, _ in temporaries:
            if os.path.exists(temporary):
                os.unlink(temporary)
        for folder in created:
            if folder.exists() and not any(folder.iterdir()):
                folder.rmdir()
        raise


# ---------------------------------------------------------------------------------------------------------------------
# The command


@dataclass
class Report:
    source: str
    records: int = 0
    kept: list[tuple[Task, dict[str, Any], str]] = field(default_factory=list)  # (task, row, split)
    dropped: Counter[str] = field(default_factory=Counter)
    date_checks: dict[str, DateCheck] = field(default_factory=dict)
    past_listed: list[Task] = field(default_factory=list)
    references: int | None = None
    references_used: int = 0
    warnings: list[str] = field(default_factory=list)  # about input that was used, e.g. alias conflicts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_webvoyager_data.py",
        description=(
            "Turn a WebVoyager task list into NeMo Gym rollout rows for this recipe, split into "
            f"OUTPUT_DIR/{TRAIN_FILE} and OUTPUT_DIR/{VAL_FILE}."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
examples:
  # the WebVoyager task list with its reference answers, 10% validation
  python prepare_webvoyager_data.py --input WebVoyager_data.jsonl \\
      --reference-answers reference_answer.json --output-dir data/webvoyager

  # see what would be written, and which tasks name dates already past, without writing
  python prepare_webvoyager_data.py --input WebVoyager_data.jsonl --output-dir data/webvoyager --dry-run

  # two sites only, no tasks with past dates, rows for NeMo Gym's five native browser tools
  python prepare_webvoyager_data.py --input WebVoyager_data.jsonl --output-dir data/two_sites \\
      --include-site Allrecipes --include-site ArXiv --exclude-stale-dates --tool-interface native

  # a Hugging Face dataset, or one saved with save_to_disk
  python prepare_webvoyager_data.py --hf-dataset ORG/NAME --hf-split test --output-dir data/hf
  python prepare_webvoyager_data.py --from-disk saved/webvoyager --hf-split train --output-dir data/disk

input:
  One JSON object per line (blank lines are skipped, a missing final newline is fine). WebVoyager's fields:
  id, ques, web, optional web_name (aliases: task_id, question, start_url/initial_url, site). Other fields are
  kept under task_metadata. A row with a field and its alias uses WebVoyager's field (id is the task id) and keeps
  the alias under task_metadata; a warning per input counts the rows where the two differ. A line with
  responses_create_params is a NeMo Gym row and passes through, validated. verifier_metadata, where given, must
  hold exactly one of {", ".join(VERIFIER_KEYS)}, a non-empty string (the server grades only the first of
  these it finds, in this order, and ignores the rest).

split:
  A task goes to validation when sha256(seed, task id) falls below --val-fraction: deterministic, and stable
  when tasks are added or removed. The validation share is therefore close to, not exactly, the fraction.

exit status: 0 written (or dry run done), 2 bad usage or bad input (each error names its file and line).""",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, action="append", metavar="FILE.jsonl", help="local JSONL (repeatable)")
    source.add_argument("--hf-dataset", metavar="NAME", help="Hugging Face dataset name (or a local dataset folder)")
    source.add_argument("--from-disk", metavar="PATH", help="a dataset folder written by save_to_disk")
    parser.add_argument("--hf-split", metavar="SPLIT", help="split to read (--hf-dataset default: train)")
    parser.add_argument("--hf-config", metavar="CONFIG", help="dataset configuration name for --hf-dataset")
    parser.add_argument("--cache-dir", metavar="DIR", help="datasets cache folder for --hf-dataset")
    parser.add_argument("--output-dir", type=Path, required=True, metavar="DIR", help="where the files go")
    parser.add_argument("--reference-answers", type=Path, metavar="FILE", help="WebVoyager reference_answer.json")
    parser.add_argument(
        "--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
        help=f"share of tasks for validation, 0 <= F < 1 (default {DEFAULT_VAL_FRACTION})",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"split seed (default {DEFAULT_SEED})")
    parser.add_argument("--include-site", action="append", default=[], metavar="SITE", help="keep only these sites")
    parser.add_argument("--exclude-site", action="append", default=[], metavar="SITE", help="drop these sites")
    parser.add_argument("--limit", type=int, metavar="N", help="keep the first N tasks left after the filters")
    parser.add_argument(
        "--exclude-stale-dates", action="store_true",
        help="drop tasks whose question names only dates before today (listed either way)",
    )  # fmt: skip
    parser.add_argument("--today", type=dt.date.fromisoformat, metavar="YYYY-MM-DD", help="date the check uses")
    parser.add_argument(
        "--tool-interface", choices=TOOL_INTERFACES, default="browser",
        help="the tools the prompt teaches: 'browser' (one tool with an action, the recipe's default) or "
        "'native' (NeMo Gym's five browser_* tools; such rows also run in NeMo Gym's own agent)",
    )  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="validate and report, write nothing")
    return parser


def alias_warnings(conflicts: Mapping[tuple[str, str, str], tuple[int, str]]) -> list[str]:
    """One line per (input, field used, alias) from ``{(input, field, alias): (rows, first location)}``."""
    lines = []
    for (origin, used, alias), (rows, first) in conflicts.items():
        verb = "rows give" if rows != 1 else "row gives"
        key = " (WebVoyager's key)" if used == ID_FIELDS[0] else ""
        lines.append(
            f"{origin}: {rows} {verb} both '{used}' and '{alias}' with different values (first at {first}); "
            f"'{used}' is used{key}, '{alias}' is kept in task_metadata"
        )
    return lines


def _read_tasks(args: argparse.Namespace) -> tuple[str, list[Task], list[InputError], int, list[str]]:
    """(source description, tasks, errors, records read, alias warnings). Errors are collected, not raised, to
    report them all; alias conflicts are counted per input (file or dataset) and reported once each."""
    records: Iterable[tuple[str, str, Any]]  # (input, location, parsed object or InputError)
    if args.input:
        missing = [path for path in args.input if not path.is_file()]
        if missing:
            raise InputError(str(missing[0]), "no such file")
        source = ", ".join(str(path) for path in args.input)
        total = sum(_count_lines(path) for path in args.input)
        records = ((str(path), *record) for path in args.input for record in _jsonl_records(path))
    else:
        if args.hf_dataset:
            split = args.hf_split or "train"
            dataset = load_hub_dataset(args.hf_dataset, args.hf_config, split, args.cache_dir)
            source = f"{args.hf_dataset}[{split}]"
        else:
            dataset, source = load_disk_dataset(args.from_disk, args.hf_split)
        total = len(dataset)
        records = ((source, *record) for record in _dataset_records(dataset, source))

    tasks: list[Task] = []
    errors: list[InputError] = []
    first_seen: dict[str, str] = {}
    conflicts: dict[tuple[str, str, str], tuple[int, str]] = {}
    count = 0
    progress = tqdm(
        records, total=total, unit="rows", desc="reading", disable=True if total < PROGRESS_MIN_RECORDS else None
    )
    for origin, location, obj in progress:
        count += 1
        try:
            if isinstance(obj, InputError):
                raise obj
            task = parse_record(obj, location)
            if task.task_id in first_seen:
                what = "same content as" if task.id_derived else "first at"
                raise InputError(location, f"duplicate task id {task.task_id!r} ({what} {first_seen[task.task_id]})")
            first_seen[task.task_id] = location
            tasks.append(task)
        except InputError as exc:
            errors.append(exc)
            continue
        for used, alias in task.alias_conflicts:
            rows, first = conflicts.get((origin, used, alias), (0, location))
            conflicts[(origin, used, alias)] = (rows + 1, first)
    return source, tasks, errors, count, alias_warnings(conflicts)


def _attach_references(tasks: list[Task], answers: Mapping[tuple[str, int], ReferenceAnswer]) -> list[Task]:
    attached = []
    for task in tasks:
        key = reference_key(task)
        reference = answers.get(key) if key is not None else None
        if reference is not None:
            if task.reference_answer is not None and task.reference_answer != reference.answer:
                raise InputError(task.location, "its reference_answer differs from the one in --reference-answers")
            task = dataclasses.replace(task, reference_answer=reference.answer, reference_type=reference.type)
        attached.append(task)
    return attached


def _select_sites(tasks: list[Task], include: list[str], exclude: list[str], report: Report) -> list[Task]:
    known = {(task.site or "").casefold(): task.site for task in tasks}
    for name in [*include, *exclude]:
        if name.casefold() not in known:
            sites = ", ".join(sorted(str(site) for site in known.values()))
            raise InputError(None, f"unknown site {name!r} in a site filter; the input has: {sites}")
    wanted = {name.casefold() for name in include}
    unwanted = {name.casefold() for name in exclude}
    kept = []
    for task in tasks:
        site = (task.site or "").casefold()
        if (wanted and site not in wanted) or site in unwanted:
            report.dropped["site filter"] += 1
        else:
            kept.append(task)
    return kept


def prepare(args: argparse.Namespace, today: dt.date) -> Report:
    """Read, validate, filter, split. Raises InputError; writes nothing."""
    answers = load_reference_answers(args.reference_answers) if args.reference_answers else None
    source, tasks, errors, count, warnings = _read_tasks(args)
    if errors:
        raise _Errors(errors)
    report = Report(source=source, records=count, warnings=warnings)
    if answers is not None:
        tasks = _attach_references(tasks, answers)
        report.references = len(answers)
    tasks = _select_sites(tasks, args.include_site, args.exclude_site, report)
    selected = []
    for task in tasks:
        check = check_dates(task.question, today)
        report.date_checks[task.task_id] = check
        if check.past:
            report.past_listed.append(task)
            if args.exclude_stale_dates:
                report.dropped["past date"] += 1
                continue
        selected.append(task)
    if args.limit is not None and len(selected) > args.limit:
        report.dropped["--limit"] += len(selected) - args.limit
        selected = selected[: args.limit]
    if not selected:
        raise InputError(source, "no task left to write" + (" after the filters" if report.dropped else ""))
    for task in selected:
        report.kept.append(
            (task, build_row(task, args.tool_interface), split_of(task.task_id, args.seed, args.val_fraction))
        )
    if answers is not None:
        report.references_used = sum(1 for task, _, _ in report.kept if reference_key(task) in answers)
    return report


def prepare_rows(task_file: Path, output_dir: Path, tool_interface: str = SINGLE_TOOL_NAME) -> Path:
    """Every task of ``task_file`` (any input format ``--input`` reads) as rows in ``output_dir/train.jsonl``.

    The library form of ``--input FILE --val-fraction 0 --output-dir DIR``: the same validation and rows, no report.
    Raises :class:`InputError` naming every record it refuses.
    """
    argv = ["--input", str(task_file), "--val-fraction", "0", "--output-dir", str(output_dir)]
    args = _parser().parse_args([*argv, "--tool-interface", tool_interface])
    try:
        report = prepare(args, dt.date.today())
    except _Errors as exc:
        raise InputError(str(task_file), "; ".join(str(error) for error in exc.errors[:MAX_ERRORS_SHOWN])) from None
    path = Path(output_dir) / TRAIN_FILE
    write_jsonl_files({path: [row for _, row, _ in report.kept]})
    return path


class _Errors(Exception):
    def __init__(self, errors: list[InputError]):
        super().__init__(f"{len(errors)} input errors")
        self.errors = errors


def format_report(report: Report, args: argparse.Namespace, today: dt.date, written: Sequence[Path]) -> str:
    lines = [f"source: {report.source} ({report.records} records)"]
    if report.references is not None:
        lines.append(
            f"reference answers: {args.reference_answers} ({report.references}, {report.references_used} used)"
        )
    lines.append(f"split: validation fraction {args.val_fraction}, seed {args.seed} (hash of the task id)")
    lines.append(f"tool interface: {args.tool_interface}")
    action = "excluded" if args.exclude_stale_dates else "kept; --exclude-stale-dates drops them"
    lines.append("")
    lines.append(f"tasks naming only dates before {today.isoformat()}: {len(report.past_listed)} ({action})")
    for task in report.past_listed:
        check = report.date_checks[task.task_id]
        dated = sorted({named.date for named in check.dates if named.date is not None})
        span = dated[0].isoformat() if len(dated) == 1 else f"{dated[0].isoformat()}..{dated[-1].isoformat()}"
        lines.append(f"  {task.task_id:<20} {span:<22} {shorten(task.question, LISTING_QUESTION_CHARS, one_line=True)}")

    sites = sorted({task.site or "-" for task, _, _ in report.kept}, key=str.casefold)
    types = sorted({task.reference_type for task, _, _ in report.kept if task.reference_type is not None})
    header = ["site", "train", "val", "total", *types, "no ref", "verifier", "past date", "no year"]
    table: list[list[Any]] = []
    totals = Counter()
    for site in [*sites, None]:
        rows = [(task, split) for task, _, split in report.kept if site is None or (task.site or "-") == site]
        counts = Counter(
            train=sum(split == "train" for _, split in rows),
            val=sum(split == "val" for _, split in rows),
            total=len(rows),
            **{kind: sum(task.reference_type == kind for task, _ in rows) for kind in types},
        )
        counts["no ref"] = sum(task.reference_answer is None for task, _ in rows)
        counts["verifier"] = sum(task.verifier_metadata is not None for task, _ in rows)
        counts["past date"] = sum(report.date_checks[task.task_id].past for task, _ in rows)
        counts["no year"] = sum(report.date_checks[task.task_id].undated for task, _ in rows)
        table.append(["total" if site is None else site, *(counts[name] for name in header[1:])])
        totals = counts
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]

    def render(row: Sequence[Any]) -> str:
        return "  ".join(
            str(cell).ljust(widths[0]) if i == 0 else str(cell).rjust(widths[i]) for i, cell in enumerate(row)
        )

    lines += ["", render(header), render(["-" * width for width in widths]), *map(render, table[:-1])]
    lines += [render(["-" * width for width in widths]), render(table[-1]), ""]
    dropped = ", ".join(f"{reason}: {n}" for reason, n in sorted(report.dropped.items())) or "none"
    lines.append(f"dropped: {sum(report.dropped.values())} ({dropped})")
    if totals["val"] == 0 and args.val_fraction > 0:
        lines.append("warning: the validation split is empty; verl needs at least one validation row")
    if written:
        counts = Counter(split for _, _, split in report.kept)
        lines.append("wrote: " + ", ".join(f"{path} ({counts[path.stem]} rows)" for path in written))
    else:
        lines.append("dry run: nothing written")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        print(f"error: --val-fraction must be in [0, 1), got {args.val_fraction}", file=sys.stderr)
        return 2
    if args.limit is not None and args.limit < 1:
        print(f"error: --limit must be at least 1, got {args.limit}", file=sys.stderr)
        return 2
    if args.hf_split and args.input:
        print("error: --hf-split applies to --hf-dataset and --from-disk only", file=sys.stderr)
        return 2
    today = args.today or dt.date.today()
    try:
        report = prepare(args, today)
    except _Errors as exc:
        for error in exc.errors[:MAX_ERRORS_SHOWN]:
            print(f"error: {error}", file=sys.stderr)
        if len(exc.errors) > MAX_ERRORS_SHOWN:
            print(f"error: ... and {len(exc.errors) - MAX_ERRORS_SHOWN} more", file=sys.stderr)
        print("nothing written", file=sys.stderr)
        return 2
    except InputError as exc:
        print(f"error: {exc}\nnothing written", file=sys.stderr)
        return 2
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)

    written: list[Path] = []
    if not args.dry_run:
        outputs = {
            args.output_dir / TRAIN_FILE: [row for _, row, split in report.kept if split == "train"],
            args.output_dir / VAL_FILE: [row for _, row, split in report.kept if split == "val"],
        }
        try:
            write_jsonl_files(outputs)
        except OSError as exc:
            print(f"error: cannot write to {args.output_dir}: {exc}\nnothing written", file=sys.stderr)
            return 2
        written = list(outputs)
    print(format_report(report, args, today, written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
