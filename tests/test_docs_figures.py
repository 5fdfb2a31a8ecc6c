"""Every figure the README and ``docs/`` quote from a benchmark is the one the benchmark's JSON holds.

Each quoted figure is tied here to the JSON that holds it: a :class:`Quote` is a page, the text as it stands there
with ``{name}`` fields, the ``bench/*.json`` file, and for each field a :class:`Value` (a key path into the JSON, or a
small formula over key paths, and its format). The test renders each quote from the JSON and looks for it on its
page, so it fails when a figure on the page changes (the quote is no longer there) and when the JSON changes (the
rendered quote differs); line breaks count as spaces, so a page may rewrap its paragraphs. A table is a quote per row.

Key paths: ``figures.points[3].correct[0]``; ``runs[arm=recipe,rate=0.85]`` keeps the list items whose fields match
(several may, then the value names how to reduce them: ``mean``, ``min``, ``max``, ``sum``); ``*`` is every value of a
mapping or list; ``bench/other.json:runs[0].minutes`` reads another benchmark's JSON.
"""

from __future__ import annotations

import difflib
import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "mean": statistics.fmean,
    "min": min,
    "max": max,
    "sum": sum,
}


def lookup(data: Any, path: str) -> list[Any]:
    """Every value at ``path`` (see the module docstring); raises ``KeyError`` naming the step that found nothing."""
    found = [data]
    for step in re.findall(r"[^.\[\]]+|\[[^\]]*\]", path):
        following = []
        for item in found:
            if step in ("*", "[*]"):
                following += list(item.values()) if isinstance(item, dict) else list(item)
            elif step.startswith("[") and "=" in step:
                wanted = dict(part.split("=", 1) for part in step[1:-1].split(","))
                following += [entry for entry in item if all(_same(entry.get(k), v) for k, v in wanted.items())]
            elif step.startswith("["):
                following.append(item[int(step[1:-1])])
            else:
                following.append(item[step])
        if not following:
            raise KeyError(f"{path}: nothing at {step}")
        found = following
    return found


def _same(value: Any, text: str) -> bool:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(text) == value
    return str(value) == text


@dataclass(frozen=True)
class Value:
    """One figure: the value at ``path`` (reduced by ``reduce`` when the path finds several), or ``formula`` of the
    values at several paths; times ``scale``, formatted by ``fmt``; ``pattern``'s first group of a text value."""

    path: str | tuple[str, ...]
    fmt: str = "{}"
    reduce: str | None = None
    scale: float = 1.0
    formula: Callable[..., float] | None = None
    pattern: str | None = None

    def render(self, data: Any) -> str:
        paths = (self.path,) if isinstance(self.path, str) else self.path
        numbers = [self._one(data, path) for path in paths]
        number = self.formula(*numbers) if self.formula else numbers[0]
        if self.scale != 1.0:
            number = number * self.scale
        return self.fmt.format(number)

    def _one(self, data: Any, path: str) -> Any:
        if ".json:" in path:  # a value of another benchmark's JSON, for a figure that compares two runs
            source, path = path.split(":", 1)
            data = json.loads((ROOT / source).read_text(encoding="utf-8"))
        values = lookup(data, path)
        if self.pattern is not None:
            values = [re.search(self.pattern, str(value)).group(1) for value in values]
            return values[0] if len(values) == 1 else values
        if self.reduce is None:
            assert len(values) == 1, f"{path}: {len(values)} values and no reduce"
            return values[0]
        return REDUCERS[self.reduce]([value for value in values if value is not None])


@dataclass(frozen=True)
class Quote:
    page: str
    text: str
    source: str
    values: dict[str, Value] = field(default_factory=dict)

    def render(self) -> str:
        data = json.loads((ROOT / self.source).read_text(encoding="utf-8"))
        return self.text.format(**{name: value.render(data) for name, value in self.values.items()})


def V(path: str | tuple[str, ...], fmt: str = "{}", **options: Any) -> Value:
    return Value(path, fmt, **options)


QUOTES: list[Quote] = []


def quote(page: str, source: str, text: str, **values: Value) -> None:
    QUOTES.append(Quote(page, text, source, values))


# ----- the bias table (README) ---------------------------------------------------------------------------------------

BIAS = "bench/baseline_bias.json"
for label, shown in (("0%", "0 %"), ("30%", "30 %"), ("60%", "60 %"), ("90%", "90 %"), ("mission", "{rate} %")):
    point = f"figures.points[label={label}]"
    quote(
        "README.md",
        BIAS,
        f"| {shown}{' (the run above)' if label == 'mission' else ''} "
        "| {i0} / {i1} / {i2} | {c0} / {c1} / {c2} |",
        rate=V(f"{point}.failure_rate", "{:.1f}", scale=100),
        **{f"i{k}": V(f"{point}.incorrect[{k}]", "{:+.3f}") for k in range(3)},
        **{f"c{k}": V(f"{point}.correct[{k}]", "{:+.3f}") for k in range(3)},
    )
MISSION = "figures.points[label=mission]"
quote(
    "docs/benchmarks.md",
    BIAS,
    "a correct survivor gets {due}x its due at the\nmission's failure rate, a wrong one is pushed down {less}x less",
    due=V((f"{MISSION}.correct[0]", f"{MISSION}.correct[2]"), "{:.1f}", formula=lambda stock, best: stock / best),
    less=V((f"{MISSION}.incorrect[2]", f"{MISSION}.incorrect[0]"), "{:.1f}", formula=lambda best, stock: best / stock),
)

# ----- the learning curve (README, docs/learning-results.md) ----------------------------------------------------------

CURVE = "bench/learning_curve.json"


def curve(arm: str, rate: float, step: int, key: str, reduce: str, fmt: str = "{:.2f}", scale: float = 1.0) -> Value:
    return V(f"runs[arm={arm},rate={rate}].evaluated.{step}.{key}", fmt, reduce=reduce, scale=scale)


quote(
    "README.md",
    CURVE,
    "the recipe takes held-back success from {start} to {end} in 8 steps in each of 3 seeds,\n"
    "while stock GRPO, trained on every failed look as a zero, teaches the policy to stop looking (browsing {b0} % → "
    "{b8} %) and\nends at {stock}, what guessing gives",
    start=curve("recipe", 0.85, 0, "heldback_success", "mean"),
    end=curve("recipe", 0.85, 8, "heldback_success", "mean"),
    b0=curve("stock", 0.85, 0, "heldback_browsed", "mean", "{:.0f}", 100),
    b8=curve("stock", 0.85, 8, "heldback_browsed", "mean", "{:.0f}", 100),
    stock=curve("stock", 0.85, 8, "heldback_success", "mean"),
)
for rate, shown in ((0.0, "0%"), (0.85, "85%")):
    for arm in ("recipe", "stock") if rate else ("recipe",):
        for step in (0, 2, 4, 6, 8):
            cells = {}
            for column, key in (("h", "heldback_success"), ("t", "train_success"), ("b", "heldback_browsed")):
                for reduce in ("mean", "min", "max"):
                    cells[f"{column}_{reduce}"] = curve(arm, rate, step, key, reduce)
            quote(
                "docs/learning-results.md",
                CURVE,
                f"| {shown} | {arm} (3 seeds) | {step} "
                "| {h_mean} ({h_min}–{h_max}) | {t_mean} ({t_min}–{t_max}) | {b_mean} ({b_min}–{b_max}) |",
                **cells,
            )
for arm, rate, seed in [
    ("recipe", 0.0, 0),
    ("recipe", 0.0, 1),
    ("recipe", 0.0, 2),
    ("recipe", 0.85, 0),
    ("stock", 0.85, 0),
    ("recipe", 0.85, 1),
    ("stock", 0.85, 1),
    ("recipe", 0.85, 2),
    ("stock", 0.85, 2),
]:
    run = f"runs[arm={arm},rate={rate},seed={seed}]"
    flags = "| {invalid} | {resampled} |" if arm == "recipe" else "| - | - |"
    quote(
        "docs/learning-results.md",
        CURVE,
        f"| {rate:.0%} {arm} seed {seed} | {{minutes}} | {{step_s}} | {{gen_s}} | {{peak}} {flags} {{faults}} |",
        minutes=V(f"{run}.minutes", "{:.1f}"),
        step_s=V(f"{run}.training.*.step_s", "{:.2f}", reduce="mean"),
        gen_s=V(f"{run}.training.*.gen_s", "{:.2f}", reduce="mean"),
        peak=V(f"{run}.peak_memory_gib", "{:.1f}"),
        **(
            {
                "invalid": V(f"{run}.training.*.invalid_rate", "{:.2f}", reduce="mean"),
                "resampled": V(f"{run}.training.*.resampled_rate", "{:.2f}", reduce="mean"),
            }
            if arm == "recipe"
            else {}
        ),
        faults=V(f"{run}.faults_injected.*", "{:.0f}", reduce="sum") if rate else V(f"{run}.faults_injected", "0"),
    )


def _per_run(arm: str, key: str, reduce: str, fmt: str, scale: float = 1.0) -> Value:
    """``reduce`` over the 85 % runs of ``arm`` of each run's mean ``training.<step>.<key>``."""
    paths = tuple(f"runs[arm={arm},rate=0.85,seed={seed}].training.*.{key}" for seed in range(3))
    return V(
        paths,
        fmt,
        reduce="mean",
        scale=scale,
        formula=lambda *means: REDUCERS[reduce](list(means)),
    )


quote(
    "docs/learning-results.md",
    CURVE,
    "{runs} runs, {minutes} min in all",
    runs=V("runs", "{}", formula=len),
    minutes=V("runs[*].minutes", "{:.0f}", reduce="sum"),
)
quote(
    "docs/learning-results.md",
    CURVE,
    "{low}–{high} min and {peak_low}–{peak_high} GiB peak",
    low=V("runs[*].minutes", "{:.1f}", reduce="min"),
    high=V("runs[*].minutes", "{:.1f}", reduce="max"),
    peak_low=V("runs[*].peak_memory_gib", "{:.1f}", reduce="min"),
    peak_high=V("runs[*].peak_memory_gib", "{:.1f}", reduce="max"),
)
quote(
    "docs/learning-results.md",
    CURVE,
    "held-back success goes from {start} to {end} in 8 steps in every seed",
    start=V("runs[arm=recipe].evaluated.0.heldback_success", "{:.2f}", reduce="max"),
    end=V("runs[arm=recipe].evaluated.8.heldback_success", "{:.2f}", reduce="min"),
)
quote(
    "docs/learning-results.md",
    CURVE,
    "(browsing {b0} % → {low}–{high} %)",
    b0=curve("recipe", 0.0, 0, "heldback_browsed", "mean", "{:.0f}", 100),
    low=V("runs[arm=recipe].evaluated.8.heldback_browsed", "{:.0f}", reduce="min", scale=100),
    high=V("runs[arm=recipe].evaluated.8.heldback_browsed", "{:.0f}", reduce="max", scale=100),
)
quote(
    "docs/learning-results.md",
    CURVE,
    "(browsing {b0} % → {low}–{high} % by step 8 in all three seeds) and held-back success falls to what guessing "
    "gives\n({end}; {s4}–{s6} at steps 4–6)",
    b0=curve("stock", 0.85, 0, "heldback_browsed", "mean", "{:.0f}", 100),
    low=curve("stock", 0.85, 8, "heldback_browsed", "min", "{:.0f}", 100),
    high=curve("stock", 0.85, 8, "heldback_browsed", "max", "{:.0f}", 100),
    end=curve("stock", 0.85, 8, "heldback_success", "mean"),
    s4=curve("stock", 0.85, 4, "heldback_success", "mean"),
    s6=curve("stock", 0.85, 6, "heldback_success", "mean"),
)
quote(
    "docs/learning-results.md",
    CURVE,
    "The recipe re-ran {r_low}–{r_high} % of its rollouts and kept the {i_low}–{i_high} % that still failed\n"
    "out of the loss and the baseline; that is what its extra generation time per step ({g_low}–{g_high} s against "
    "{s_low}–{s_high} s) pays for.",
    r_low=_per_run("recipe", "resampled_rate", "min", "{:.0f}", 100),
    r_high=_per_run("recipe", "resampled_rate", "max", "{:.0f}", 100),
    i_low=_per_run("recipe", "invalid_rate", "min", "{:.0f}", 100),
    i_high=_per_run("recipe", "invalid_rate", "max", "{:.0f}", 100),
    g_low=_per_run("recipe", "gen_s", "min", "{:.0f}"),
    g_high=_per_run("recipe", "gen_s", "max", "{:.0f}"),
    s_low=_per_run("stock", "gen_s", "min", "{:.0f}"),
    s_high=_per_run("stock", "gen_s", "max", "{:.0f}"),
)
quote(
    "docs/learning-results.md",
    "bench/learning_curve_beside_hog.json",
    "the 85 % recipe run of seed 0 took {minutes} min beside a\nprocess spinning one core",
    minutes=V("runs[0].minutes", "{:.1f}"),
)
quote(
    "docs/learning-results.md",
    "bench/learning_curve_without_hog.json",
    "and {minutes} min without it, minutes apart on the same machine",
    minutes=V("runs[0].minutes", "{:.1f}"),
)
quote(
    "docs/learning-results.md",
    "bench/learning_curve_beside_hog.json",
    "({slower} %; held-back success {start} →\n{end} in both;",
    slower=V(
        ("runs[0].minutes", "bench/learning_curve_without_hog.json:runs[0].minutes"),
        "{:+.0f}",
        formula=lambda beside, alone: (beside / alone - 1) * 100,
    ),
    start=V("runs[0].evaluated.0.heldback_success", "{:.2f}"),
    end=V("runs[0].evaluated.8.heldback_success", "{:.2f}"),
)
quote(
    "docs/learning-results.md",
    "bench/learning_curve_without_hog.json",
    "held-back success {start} →\n{end} in both;",
    start=V("runs[0].evaluated.0.heldback_success", "{:.2f}"),
    end=V("runs[0].evaluated.8.heldback_success", "{:.2f}"),
)

# docs/learning-results.md's "Not the rehearsal's evaluation": the benchmark's column and figures from its JSON (the
# rehearsal's column from scripts/rehearse.sh: test_the_rehearsals_evaluation_is_the_one_the_learning_results_name)
REHEARSAL_EVAL_ROWS = {
    "answers": "| answers per held-back board | 1, greedy (verl's default `val_kwargs`: temperature 0, n 1) "
    "| {n}, sampled at temperature 1 (`val_kwargs.do_sample=True`, n {n}) |",
    "boards": "| held-back boards | the first {tasks} (`--val-tasks {tasks}`) | the first {v} (`--val-tasks {v}`) |",
    "evaluated": "| evaluated | before training and after step {steps} (`--test-freq {freq}`) "
    "| before training and every {e} steps |",
    "step": "| a training step | {prompts} tasks x {group} episodes | {p} tasks x {g} episodes |",
}
REHEARSAL_EVAL_FIELDS = {
    "answers": {"n": V("settings.val_samples")},
    "boards": {"v": V("settings.val_tasks")},
    "evaluated": {"e": V("settings.eval_every")},
    "step": {"p": V("settings.prompts_per_step"), "g": V("settings.group_size")},
}
# The rehearsal's values as the page gives them; the test below reads them from scripts/rehearse.sh.
REHEARSAL_EVAL_AS_WRITTEN = {"tasks": "48", "steps": "8", "freq": "8", "prompts": "4", "group": "8"}
for name, text in REHEARSAL_EVAL_ROWS.items():
    fields = REHEARSAL_EVAL_FIELDS[name]
    quote(
        "docs/learning-results.md",
        CURVE,
        text.format(**{key: "{" + key + "}" for key in fields}, **REHEARSAL_EVAL_AS_WRITTEN),
        **fields,
    )
quote(
    "docs/learning-results.md",
    CURVE,
    "| seeds | 1 (0) | {count} ({seeds}), mean and range |",
    count=V("settings.seeds", formula=len),
    seeds=V("settings.seeds", formula=lambda seeds: ", ".join(map(str, seeds))),
)
quote(
    "docs/learning-results.md",
    CURVE,
    "The same in both: {steps} steps, lr {lr}, {rate} % of browser calls {kind}",
    steps=V("settings.steps"),
    kind=V("settings.fault_kind", formula=lambda kind: {"lose_session": "losing their session"}[kind]),
    lr=V("settings.lr", formula=lambda lr: f"{lr:.0e}".replace("e-0", "e-")),
    rate=V("runs[arm=recipe,seed=0].rate", "{:.0f}", reduce="max", scale=100),
)
quote(
    "docs/learning-results.md",
    CURVE,
    "at\ntemperature 1 it reads the board on {b0} % of episodes and starts at {start}. Trained, it reads the board "
    "either way:\n0.96 greedy in the rehearsal's one run, {end} sampled here, over {seeds} seeds.",
    b0=curve("recipe", 0.85, 0, "heldback_browsed", "mean", "{:.0f}", 100),
    start=curve("recipe", 0.85, 0, "heldback_success", "mean"),
    end=curve("recipe", 0.85, 8, "heldback_success", "mean"),
    seeds=V("settings.seeds", formula=len),
)

# bench/learning_curve_vllm.json: docs/learning-results.md's "On verl's vLLM rollout" section
VLLM_CURVE = "bench/learning_curve_vllm.json"


def vllm_curve(arm: str, step: int, key: str, reduce: str, fmt: str = "{:.2f}", scale: float = 1.0) -> Value:
    return V(f"runs[arm={arm}].evaluated.{step}.{key}", fmt, reduce=reduce, scale=scale)


def vllm_step_s(arm: str, reduce: str) -> Value:
    """``reduce`` over the seeds of ``arm`` of each run's mean step time."""
    paths = tuple(f"runs[arm={arm},seed={seed}].training.*.step_s" for seed in range(3))
    return V(paths, "{:.0f}", reduce="mean", formula=lambda *means: REDUCERS[reduce](list(means)))


VLLM_LEARNING_QUOTES: list[Quote] = [
    Quote(
        "docs/learning-results.md",
        "copy on vLLM's CPU build; `bench/learning_curve_vllm.json`, {minutes} min for 6 runs): the recipe takes "
        "held-back\nsuccess from {r0} ({r0min}–{r0max}) to {r8} ({r8min}–{r8max}) in 8 steps, every seed above 0.8 "
        "from step 4 on\n"
        "({r4min}–{r4max} there), and held-back browsing from {rb0} % to {rb8} %; stock GRPO goes from {s0} to {s8}\n"
        "({s8min}–{s8max}) and stops browsing ({sb8} %). Steps take {rs_min}–{rs_max} s (recipe) and {ss} s (stock),\n"
        "{peak} GiB peak.",
        VLLM_CURVE,
        {
            "minutes": V("runs[*].minutes", "{:.0f}", reduce="sum"),
            "r0": vllm_curve("recipe", 0, "heldback_success", "mean"),
            "r0min": vllm_curve("recipe", 0, "heldback_success", "min"),
            "r0max": vllm_curve("recipe", 0, "heldback_success", "max"),
            "r8": vllm_curve("recipe", 8, "heldback_success", "mean"),
            "r8min": vllm_curve("recipe", 8, "heldback_success", "min"),
            "r8max": vllm_curve("recipe", 8, "heldback_success", "max"),
            "r4min": vllm_curve("recipe", 4, "heldback_success", "min"),
            "r4max": vllm_curve("recipe", 4, "heldback_success", "max"),
            "rb0": vllm_curve("recipe", 0, "heldback_browsed", "mean", "{:.0f}", 100),
            "rb8": vllm_curve("recipe", 8, "heldback_browsed", "mean", "{:.0f}", 100),
            "s0": vllm_curve("stock", 0, "heldback_success", "mean"),
            "s8": vllm_curve("stock", 8, "heldback_success", "mean"),
            "s8min": vllm_curve("stock", 8, "heldback_success", "min"),
            "s8max": vllm_curve("stock", 8, "heldback_success", "max"),
            "sb8": vllm_curve("stock", 8, "heldback_browsed", "mean", "{:.0f}", 100),
            "rs_min": vllm_step_s("recipe", "min"),
            "rs_max": vllm_step_s("recipe", "max"),
            "ss": vllm_step_s("stock", "mean"),
            "peak": V("runs[*].peak_memory_gib", "{:.1f}", reduce="max"),
        },
    )
]
QUOTES += VLLM_LEARNING_QUOTES

# ----- the aisle suite in both sample modes (docs/learning-results.md) --------------------------------------------

AISLE = "bench/learning_curve_aisle.json"
AISLE_STEPS = (0, 2, 4, 6, 10, 20)
MODE_NAMES = {"trajectory": "one per episode", "stepwise": "one per step"}


def last_three(runs: tuple[str, ...], final: int, reduce: Callable[[list[float]], float] = statistics.fmean) -> Value:
    """Held-back success over the last three evaluations (``final`` and the two before: every 2 steps), each run's
    own mean, then ``reduce`` over ``runs`` (one key path per run)."""
    paths = tuple(f"{run}.evaluated.{step}.heldback_success" for run in runs for step in (final - 4, final - 2, final))
    return V(paths, "{:.2f}", formula=lambda *v: reduce([statistics.fmean(v[k : k + 3]) for k in range(0, len(v), 3)]))


def aisle_cells(
    mode: str,
    rate: float,
    arm: str,
    steps: tuple[int, ...] = AISLE_STEPS,
    with_last_three: bool = False,
    label: str | None = None,
) -> tuple[str, dict[str, Value]]:
    """One row of an aisle learning table: held-back success at each of ``steps``, mean (min–max) over seeds
    (``with_last_three``: and over the last three evaluations, :func:`last_three`), browsing at the last step, and
    each seed's steps to 0.8; the arm's column says ``label`` (default: the arm)."""
    runs = f"runs[sample_mode={mode},rate={rate},arm={arm}]"
    summary = f"by_mode[sample_mode={mode},rate={rate},arm={arm}]"
    cells, values = [], {}
    for step in steps:
        cells.append(f"{{s{step}}} ({{s{step}min}}–{{s{step}max}})")
        for reduce in ("mean", "min", "max"):
            name = f"s{step}" + ("" if reduce == "mean" else reduce)
            values[name] = V(f"{runs}.evaluated.{step}.heldback_success", "{:.2f}", reduce=reduce)
    if with_last_three:
        cells.append("{last} ({lastmin}–{lastmax})")
        seeds = tuple(f"runs[sample_mode={mode},rate={rate},arm={arm},seed={seed}]" for seed in range(3))
        for name, reduce in (("last", statistics.fmean), ("lastmin", min), ("lastmax", max)):
            values[name] = last_three(seeds, steps[-1], reduce)
    values["browsed"] = V(f"{runs}.evaluated.{steps[-1]}.heldback_browsed", "{:.0f}", reduce="mean", scale=100)
    reached = []
    for seed in range(3):
        values[f"reach{seed}"] = V(
            f"{summary}.steps_to_target[{seed}]", "{}", formula=lambda step: "-" if step is None else step
        )
        reached.append(f"{{reach{seed}}}")
    text = (
        f"| {MODE_NAMES[mode]} | {rate:.0%} | {label or arm} | "
        + " | ".join(cells)
        + " | {browsed} % | "
        + ", ".join(reached)
    )
    return text + " |", values


AISLE_ROWS = [("trajectory", 0.0, "recipe"), ("stepwise", 0.0, "recipe"), ("trajectory", 0.85, "recipe"),
              ("trajectory", 0.85, "stock"), ("stepwise", 0.85, "recipe"), ("stepwise", 0.85, "stock")]  # fmt: skip
for mode, rate, arm in AISLE_ROWS:
    row_text, row_values = aisle_cells(mode, rate, arm)
    quote("docs/learning-results.md", AISLE, row_text, **row_values)

# the start and the last seed's step to 0.8 without failures, in both modes: quoted by the README and the page
AISLE_LEARNED = {
    "start": V("runs[rate=0].evaluated.0.heldback_success", "{:.2f}", reduce="mean"),
    "reached": V("by_mode[rate=0].steps_to_target[*]", "{}", reduce="max"),
}
for page, text in [
    (
        "docs/learning-results.md",
        "held-back success from {start} to 0.8 or more by step\n{reached} in every seed of both modes, every held-back "
        "episode browsing by the end.",
    ),
    ("README.md", "held-back success {start} → 0.8 or\nmore by step {reached} in every seed"),
]:
    quote(page, AISLE, text, **AISLE_LEARNED)


def at_85(mode: str, arm: str, seed: int | None = None) -> str:
    return f"runs[sample_mode={mode},rate=0.85,arm={arm}" + ("]" if seed is None else f",seed={seed}]")


def recipe_85(seed: int | None = None) -> str:
    """The recipe's runs at 85 %, one sample per episode: every seed's, or one seed's."""
    return at_85("trajectory", "recipe", seed)


def survivors(mode: str, seed: int, steps: range, none: str | None = None) -> Value:
    """How many of a recipe run's kept training episodes at 85 % browsed and no failure hit, over ``steps``: the
    browsing share minus the invalid share (only a browsing episode can fail) times the episodes per step; ``none``
    is the word the page uses for a count of 0."""
    paths = tuple(
        f"{at_85(mode, 'recipe', seed)}.training.{step}.{rate}"
        for step in steps
        for rate in ("browsed_rate", "invalid_rate")
    )

    def count(*values: float) -> float | str:
        *rates, prompts, group = values
        number = round((sum(rates[0::2]) - sum(rates[1::2])) * prompts * group)
        return none if none is not None and number == 0 else number

    return V((*paths, "settings.prompts_per_step", "settings.group_size"), "{}", formula=count)


def seeds_85(mode: str, arm: str) -> tuple[str, ...]:
    """Each seed's run at 85 %, one key path per run (for :func:`last_three`)."""
    return tuple(at_85(mode, arm, seed) for seed in range(3))


STOCK_85 = at_85("trajectory", "stock")
quote(
    "docs/learning-results.md",
    AISLE,
    "stops browsing in every seed (held-back browsing {sb} % at step 20) and\nends at {s20} ({s20min}–{s20max}) "
    "held-back success at step 20.",
    sb=V(f"{STOCK_85}.evaluated.20.heldback_browsed", "{:.0f}", reduce="mean", scale=100),
    s20=V(f"{STOCK_85}.evaluated.20.heldback_success", "{:.2f}", reduce="mean"),
    s20min=V(f"{STOCK_85}.evaluated.20.heldback_success", "{:.2f}", reduce="min"),
    s20max=V(f"{STOCK_85}.evaluated.20.heldback_success", "{:.2f}", reduce="max"),
)
quote(
    "docs/learning-results.md",
    AISLE,
    "over the last three (steps 16–20) stock GRPO averages\n{t} with one sample per episode and {w} with one per step",
    t=last_three(seeds_85("trajectory", "stock"), 20),
    w=last_three(seeds_85("stepwise", "stock"), 20),
)
quote(
    "docs/learning-results.md",
    AISLE,
    "Over steps 1–4 only\n{rb} % of the kept episodes (the attempt each episode ends with) browsed.",
    rb=V(
        tuple(f"{recipe_85()}.training.{step}.browsed_rate" for step in range(1, 5)),
        "{:.0f}",
        reduce="mean",
        scale=100,
        formula=lambda *rates: sum(rates) / len(rates),
    ),
)
quote(
    "docs/learning-results.md",
    AISLE,
    "held-back success reached {r1} and {r2} by step 20, while {i1} % and {i2} % of\ntheir kept episodes at step 20 "
    "were browsing episodes that failed all 3 attempts",
    r1=V(f"{recipe_85(1)}.evaluated.20.heldback_success", "{:.2f}"),
    r2=V(f"{recipe_85(2)}.evaluated.20.heldback_success", "{:.2f}"),
    i1=V(f"{recipe_85(1)}.training.20.invalid_rate", "{:.0f}", scale=100),
    i2=V(f"{recipe_85(2)}.training.20.invalid_rate", "{:.0f}", scale=100),
)
quote(
    "docs/learning-results.md",
    AISLE,
    "re-runs most of its episodes ({q1} % and {q2} % at step 20) and its logged reward (verl's\n`critic/score/mean`, a "
    "failed episode scoring 0) falls, to {w1} and {w2} at step 20",
    q1=V(f"{recipe_85(1)}.training.20.resampled_rate", "{:.0f}", scale=100),
    q2=V(f"{recipe_85(2)}.training.20.resampled_rate", "{:.0f}", scale=100),
    w1=V(f"{recipe_85(1)}.training.20.reward", "{:.2f}"),
    w2=V(f"{recipe_85(2)}.training.20.reward", "{:.2f}"),
)
quote(
    "docs/learning-results.md",
    AISLE,
    "In seed 0 {none} browsing episode got through in the\nfirst 11 steps ({all0} in all): held-back browsing rose "
    "only from {b0} % to {b20} % and success from {s0} to\n{r0}.",
    none=survivors("trajectory", 0, range(1, 12), none="no"),
    all0=survivors("trajectory", 0, range(1, 21)),
    b0=V(f"{recipe_85(0)}.evaluated.0.heldback_browsed", "{:.0f}", scale=100),
    b20=V(f"{recipe_85(0)}.evaluated.20.heldback_browsed", "{:.0f}", scale=100),
    s0=V(f"{recipe_85(0)}.evaluated.0.heldback_success", "{:.2f}"),
    r0=V(f"{recipe_85(0)}.evaluated.20.heldback_success", "{:.2f}"),
)

STEPWISE_RECIPE_85, STEPWISE_STOCK_85 = at_85("stepwise", "recipe"), at_85("stepwise", "stock")
quote(
    "docs/learning-results.md",
    AISLE,
    "in the first 10 steps, when seeds 1 and 2 of the default mode took off, {w0}, {w1} and {w2} browsing\n"
    "episodes got through in the step-wise seeds against {e0}, {e1} and {e2} in the default mode ({a0}, {a1} and {a2} "
    "over all\n20 steps).",
    **{f"w{seed}": survivors("stepwise", seed, range(1, 11)) for seed in range(3)},
    **{f"e{seed}": survivors("trajectory", seed, range(1, 11)) for seed in range(3)},
    **{f"a{seed}": survivors("stepwise", seed, range(1, 21)) for seed in range(3)},
)
quote(
    "docs/learning-results.md",
    AISLE,
    "held-back success {r} ({rmin}–{rmax}) at step 20, {r3} over the last three\nevaluations, held-back browsing "
    "{b0} %, {b1} % and {b2} % per seed at step 20. Stock GRPO, one sample per step, stopped\nbrowsing here too "
    "({sb} %) and ended at {s} ({smin}–{smax}).",
    **{
        f"{name}{suffix}": V(f"{runs}.evaluated.20.heldback_success", "{:.2f}", reduce=reduce)
        for name, runs in (("r", STEPWISE_RECIPE_85), ("s", STEPWISE_STOCK_85))
        for suffix, reduce in (("", "mean"), ("min", "min"), ("max", "max"))
    },
    r3=last_three(seeds_85("stepwise", "recipe"), 20),
    **{
        f"b{seed}": V(f"{at_85('stepwise', 'recipe', seed)}.evaluated.20.heldback_browsed", "{:.0f}", scale=100)
        for seed in range(3)
    },
    sb=V(f"{STEPWISE_STOCK_85}.evaluated.20.heldback_browsed", "{:.0f}", reduce="mean", scale=100),
)

# the 85 % arms again over 40 steps, in both modes: new runs, in their own JSON
AISLE_40 = "bench/learning_curve_aisle_85_40steps.json"
AISLE_40_STEPS = (0, 10, 20, 30, 40)
for mode, arm in (("trajectory", "recipe"), ("trajectory", "stock"), ("stepwise", "recipe"), ("stepwise", "stock")):
    row_text, row_values = aisle_cells(mode, 0.85, arm, steps=AISLE_40_STEPS, with_last_three=True)
    quote("docs/learning-results.md", AISLE_40, row_text, **row_values)


TRAJECTORY_40 = "by_mode[sample_mode=trajectory,rate=0.85,arm=recipe]"
quote(
    "docs/learning-results.md",
    AISLE_40,
    "With one sample per episode all three recipe seeds learned the two-call route (0.8 passed at steps {t0}, {t1} "
    "and\n{t2}; held-back success {l0}, {l1} and {l2} over the last three evaluations).",
    **{f"t{seed}": V(f"{TRAJECTORY_40}.steps_to_target[{seed}]", "{}") for seed in range(3)},
    **{f"l{seed}": last_three((at_85("trajectory", "recipe", seed),), 40) for seed in range(3)},
)
quote(
    "docs/learning-results.md",
    AISLE_40,
    "With one sample per step two of three did (0.8 at steps {w1} and {w2}; {l1} and {l2} over the last three\n"
    "evaluations), after {e1} and {e2} browsing episodes got through in their first 10 steps; the third, with {e0}, "
    "stayed\nnear its start ({l0}, held-back browsing {b0} % at step 40).",
    **{f"w{seed}": V(f"by_mode[sample_mode=stepwise,rate=0.85,arm=recipe].steps_to_target[{seed}]") for seed in (1, 2)},
    **{f"l{seed}": last_three((at_85("stepwise", "recipe", seed),), 40) for seed in range(3)},
    **{f"e{seed}": survivors("stepwise", seed, range(1, 11)) for seed in range(3)},
    b0=V(f"{at_85('stepwise', 'recipe', 0)}.evaluated.40.heldback_browsed", "{:.0f}", scale=100),
)
quote(
    "docs/learning-results.md",
    AISLE_40,
    "Stock GRPO stopped browsing in all six runs and ended at\n{low}–{high} over its last three evaluations, guessing.",
    low=last_three(seeds_85("trajectory", "stock") + seeds_85("stepwise", "stock"), 40, min),
    high=last_three(seeds_85("trajectory", "stock") + seeds_85("stepwise", "stock"), 40, max),
)


def reached(arm: str, modes: tuple[str, ...], sources: tuple[str, ...] = (AISLE, AISLE_40)) -> Value:
    """How many runs at 85 % of ``arm`` in ``modes`` reached 0.8 held-back success, over the benchmarks ``sources``
    (a run that never did has no step to it); ``none`` for zero."""
    paths = tuple(
        f"{source}:by_mode[sample_mode={mode},rate=0.85,arm={arm}].steps_to_target"
        for source in sources
        for mode in modes
    )

    def count(*lists: list[int | None]) -> int | str:
        number = sum(step is not None for steps in lists for step in steps)
        return "none" if number == 0 else number

    return V(paths, formula=count)


quote(
    "docs/learning-results.md",
    AISLE_40,
    "Over both sets the recipe learned the route in {t} of 6 runs with one sample per episode ({t20} of 3 within 20 "
    "steps, {t40}\nof 3 within 40) and in {w} of 6 with one per step ({w20} of 3, {w40} of 3); stock GRPO in {s} of "
    "12.",
    t=reached("recipe", ("trajectory",)),
    t20=reached("recipe", ("trajectory",), (AISLE,)),
    t40=reached("recipe", ("trajectory",), (AISLE_40,)),
    w=reached("recipe", ("stepwise",)),
    w20=reached("recipe", ("stepwise",), (AISLE,)),
    w40=reached("recipe", ("stepwise",), (AISLE_40,)),
    s=reached("stock", ("trajectory", "stepwise")),
)

quote(
    "README.md",
    AISLE_40,
    "it still learned that route in {t} of 6 runs\nwith one sample per episode and {w} of 6 with one per step, stock "
    "GRPO in {s} of 12",
    t=reached("recipe", ("trajectory",)),
    w=reached("recipe", ("stepwise",)),
    s=reached("stock", ("trajectory", "stepwise")),
)

# ----- resuming instead of re-running: the aisle and deal suites at 30 % and 85 % (docs/learning-results.md) -------

CURVE_RESUME_30 = "bench/learning_curve_resume_aisle_30.json"
CURVE_RESUME_85 = "bench/learning_curve_resume_aisle_85.json"
CURVE_RESUME_DEAL = "bench/learning_curve_resume_deal.json"
RESUME_STEPS = (0, 2, 4, 6, 8, 12)
LEARNING = "docs/learning-results.md"

for mode in ("trajectory", "stepwise"):
    for source, rate, label in ((AISLE, 0.0, "recipe"), (CURVE_RESUME_30, 0.3, "recipe, resuming")):
        row_text, row_values = aisle_cells(mode, rate, "recipe", steps=RESUME_STEPS, label=label)
        quote(LEARNING, source, row_text, **row_values)


def resume_share(runs: str, key: str) -> Value:
    """The mean over ``runs``' training steps of a per-step share (``training.<step>.<key>``), in per cent."""
    return V(f"{runs}.training.*.{key}", "{:.0f}", reduce="mean", scale=100)


def resume_row(source: str, mode: str, rate: float) -> None:
    runs = f"runs[sample_mode={mode},rate={rate},arm=recipe]"
    quote(
        LEARNING,
        source,
        f"| {MODE_NAMES[mode]} | {rate:.0%} | {{resumed}} % | {{diverged}} % | {{rerun}} % | {{invalid}} % | "
        "{seconds} | {zero} |",
        resumed=resume_share(runs, "resumed_rate"),
        diverged=resume_share(runs, "resume_diverged_rate"),
        rerun=resume_share(runs, "rerun_after_action_rate"),
        invalid=resume_share(runs, "invalid_rate"),
        seconds=V(f"by_mode[sample_mode={mode},rate={rate},arm=recipe].seconds_per_step", "{:.1f}"),
        zero=V(f"{AISLE}:by_mode[sample_mode={mode},rate=0,arm=recipe].seconds_per_step", "{:.1f}"),
    )


for mode in ("trajectory", "stepwise"):
    resume_row(CURVE_RESUME_30, mode, 0.3)


def steps_list(source: str, mode: str, rate: float) -> Value:
    """Each seed's steps to 0.8 (``-``: not within the run), comma-separated."""
    return V(
        f"{source}:by_mode[sample_mode={mode},rate={rate},arm=recipe].steps_to_target",
        formula=lambda steps: ", ".join("-" if step is None else str(step) for step in steps),
    )


for mode in ("trajectory", "stepwise"):
    quote(
        LEARNING,
        CURVE_RESUME_30,
        f"{MODE_NAMES[mode].capitalize()}: 0.8 at steps {{zero}} without failures, {{thirty}} at 30 %",
        zero=steps_list(AISLE, mode, 0.0),
        thirty=steps_list(CURVE_RESUME_30, mode, 0.3),
    )


# the deal suite (one browser call) resuming at 30 % and 85 %, beside bench/learning_curve.json's runs of the tree
# before resuming (0 %, and 85 % re-running)
DEAL_STEPS = (0, 2, 4, 6, 8)


def deal_cells(source: str, rate: float, label: str) -> None:
    runs = f"runs[rate={rate},arm=recipe]"
    cells, values = [], {}
    for step in DEAL_STEPS:
        cells.append(f"{{s{step}}} ({{s{step}min}}–{{s{step}max}})")
        for reduce in ("mean", "min", "max"):
            name = f"s{step}" + ("" if reduce == "mean" else reduce)
            values[name] = V(f"{runs}.evaluated.{step}.heldback_success", "{:.2f}", reduce=reduce)

    def first_steps(*successes: float) -> str:
        """Each seed's first evaluated step at 0.8 or more (``-``: none), from its successes in step order."""
        n = len(DEAL_STEPS)
        per_seed = [successes[k : k + n] for k in range(0, len(successes), n)]
        reached_at = (
            next((str(step) for step, value in zip(DEAL_STEPS, seed, strict=True) if value >= 0.8), "-")
            for seed in per_seed
        )
        return ", ".join(reached_at)

    values["reach"] = V(
        tuple(f"runs[rate={rate},arm=recipe,seed={seed}].evaluated.{step}.heldback_success"
              for seed in range(3) for step in DEAL_STEPS),
        formula=first_steps,
    )  # fmt: skip
    quote(LEARNING, source, f"| {rate:.0%} | {label} | " + " | ".join(cells) + " | {reach} |", **values)


for source, rate, label in (
    (CURVE, 0.0, "recipe"),
    (CURVE_RESUME_DEAL, 0.3, "recipe, resuming"),
    (CURVE, 0.85, "recipe, re-running"),
    (CURVE_RESUME_DEAL, 0.85, "recipe, resuming"),
):
    deal_cells(source, rate, label)
quote(
    LEARNING,
    CURVE_RESUME_DEAL,
    "Resuming at 85 % reaches 0.8\nat step {reached} too, a little nearer the runs without failures on the way "
    "({resumed} at step 2, against {rerun} re-running and\n{zero} without failures)",
    reached=V("by_mode[rate=0.85,arm=recipe].steps_to_target[*]", reduce="max"),
    resumed=V("runs[rate=0.85,arm=recipe].evaluated.2.heldback_success", "{:.2f}", reduce="mean"),
    rerun=V(f"{CURVE}:runs[rate=0.85,arm=recipe].evaluated.2.heldback_success", "{:.2f}", reduce="mean"),
    zero=V(f"{CURVE}:runs[rate=0.0,arm=recipe].evaluated.2.heldback_success", "{:.2f}", reduce="mean"),
)


# the aisle tasks at 85 %, 20 steps: resuming beside the 20-step re-running runs above
for mode, per in (("stepwise", "step"), ("trajectory", "episode")):
    for source, label in ((AISLE, "recipe, re-running"), (CURVE_RESUME_85, "recipe, resuming")):
        row_text, row_values = aisle_cells(mode, 0.85, "recipe", label=label)
        quote(LEARNING, source, row_text, **row_values)
    resume_row(CURVE_RESUME_85, mode, 0.85)
    quote(
        LEARNING,
        CURVE_RESUME_85,
        f"With one sample per {per} {{resumed}} of 3 resuming runs reached 0.8 within 20 steps (at steps {{steps}}), "
        "where {rerun} of 3 re-running runs did",
        resumed=reached("recipe", (mode,), (CURVE_RESUME_85,)),
        steps=steps_list(CURVE_RESUME_85, mode, 0.85),
        rerun=reached("recipe", (mode,), (AISLE,)),
    )
quote(
    "README.md",
    CURVE_RESUME_30,
    "keeps the schedule of the runs without failures when 30 % of browser calls\nfail (0.8 by step {t} with one "
    "sample per episode and by step {w} with one per step, in every seed), and with 85 %\nfailing and one sample per "
    "step took off in {resumed} of 3 runs within 20 steps, where re-running did in {rerun} of 3",
    t=V("by_mode[sample_mode=trajectory,rate=0.3,arm=recipe].steps_to_target[*]", reduce="max"),
    w=V("by_mode[sample_mode=stepwise,rate=0.3,arm=recipe].steps_to_target[*]", reduce="max"),
    resumed=reached("recipe", ("stepwise",), (CURVE_RESUME_85,)),
    rerun=reached("recipe", ("stepwise",), (AISLE,)),
)
quote(
    LEARNING,
    CURVE_RESUME_85,
    "over steps 1–4,\n{s0}, {s1} and {s2} browsing episodes got through without a failure left in them",
    **{f"s{seed}": survivors("stepwise", seed, range(1, 5)) for seed in range(3)},
)


for mode in ("trajectory", "stepwise"):
    summary = f"by_mode[sample_mode={mode},rate=0,arm=recipe]"
    quote(
        "docs/learning-results.md",
        AISLE,
        f"| {MODE_NAMES[mode]} | {{samples}} | {{updates}} | {{tokens}} ({{tokens_max}}) | {{per_step}} | {{seconds}} "
        "| {reach0}, {reach1}, {reach2} ({up0}, {up1}, {up2}) | {minutes} | {peak} |",
        samples=V(f"{summary}.samples_per_step", "{:.0f}"),
        updates=V(f"{summary}.updates_per_step", "{:.1f}"),
        tokens=V(f"{summary}.tokens_per_sample_mean", "{:,.0f}"),
        tokens_max=V(f"{summary}.tokens_per_sample_max", "{:,.0f}"),
        per_step=V(
            (f"{summary}.samples_per_step", f"{summary}.tokens_per_sample_mean"), "{:,.0f}", formula=lambda n, t: n * t
        ),
        seconds=V(f"{summary}.seconds_per_step", "{:.1f}"),
        **{f"reach{seed}": V(f"{summary}.steps_to_target[{seed}]", "{}") for seed in range(3)},
        **{f"up{seed}": V(f"{summary}.updates_to_target[{seed}]", "{}") for seed in range(3)},
        minutes=V(f"{summary}.minutes_to_target", "{:.1f}"),
        peak=V(f"{summary}.peak_memory_gib", "{:.1f}"),
    )

# ----- benchmarks (docs/benchmarks.md) ----------------------------------------------------------------------------

BENCH = "docs/benchmarks.md"

SPEED = "bench/grpo_speed.json"
for index, (samples, group, stock_fmt, stock_scale, ours_fmt) in enumerate(
    [
        ("4,096", 8, "{:.0f} ms", 1000, "{:.1f}"),
        ("4,096", 16, "{:.0f} ms", 1000, "{:.1f}"),
        ("65,536", 8, "{:.0f} ms", 1000, "{:.1f}"),
        ("65,536", 16, "{:.0f} ms", 1000, "{:.1f}"),
        ("1,048,576", 8, "{:.1f} s", 1, "{:.0f}"),
        ("1,048,576", 16, "{:.1f} s", 1, "{:.0f}"),
    ]
):
    row = f"figures.rows[{index}]"
    quote(
        BENCH,
        SPEED,
        f"| {samples} | {group} | {{stock}} | {{ours}} ms | {{flagged}} ms | {{speed_up}}x |",
        stock=V(f"{row}.stock_s", stock_fmt, scale=stock_scale),
        ours=V(f"{row}.ours_s", ours_fmt, scale=1000),
        flagged=V(f"{row}.ours_flagged_s", ours_fmt, scale=1000),
        speed_up=V(f"figures.speed_ups[{index}].speed_up", "{:.0f}"),
    )

OVERHEAD = "bench/rollout_overhead.json"
for index, episodes, fmt in [(0, 1, "{:.1f}"), (1, 64, "{:.0f}"), (2, 256, "{:.0f}")]:
    row = f"figures.results[{index}]"
    quote(
        BENCH,
        OVERHEAD,
        f"| {episodes} | {{raw}} ms | {{verl}} / {{recipe}} ms | {{share}} % | {{per_s}} "
        "| {cpu_verl} / {cpu_recipe} ms | {heap} KiB |",
        raw=V(f"{row}.raw_call_ms", "{:.1f}"),
        verl=V(f"{row}.added_ms_per_step.verl", fmt),
        recipe=V(f"{row}.added_ms_per_step.recipe", fmt),
        share=V(f"{row}.share", fmt, scale=100),
        per_s=V(f"{row}.episodes_per_s.recipe", "{:.1f}"),
        cpu_verl=V(f"{row}.cpu_ms_per_step.verl", "{:.2f}"),
        cpu_recipe=V(f"{row}.cpu_ms_per_step.recipe", "{:.2f}"),
        heap=V(f"{row}.traced_kib_per_episode", "{:.0f}"),
    )

PLACEMENT = "bench/placement_overhead.json"
for key, label, process_fmt in [
    ("lease", "lease alone (acquire + release, no HTTP)", "{:.3f}"),
    ("seq", "one session at a time", "{:.2f}"),
    ("conc", "64 sessions at once", "{:.2f}"),
]:
    cell = f"figures.median_ms_per_session.{key}"
    quote(
        BENCH,
        PLACEMENT,
        f"| {label} | {{process}} | {{ray}} | {{added}} |",
        process=V(f"{cell}.process_ms", process_fmt),
        ray=V(f"{cell}.ray_ms", "{:.2f}"),
        added=V(f"{cell}.added_ms", "{:+.2f}"),
    )

SHARE = "bench/placement_share.json"
quote(
    BENCH,
    SHARE,
    "A static share (2 slots per worker, decided\nlocally) finished in {static_s} s with the servers {static_busy} % "
    "busy; the run-wide Ray actor in {actor_s} s, {actor_busy} % busy ({ratio}x;",
    static_s=V("runs[design=static,killed=False].wall_s", "{:.1f}"),
    static_busy=V("runs[design=static,killed=False].utilisation", "{:.0f}", scale=100),
    actor_s=V("runs[design=authority,killed=False].wall_s", "{:.1f}"),
    actor_busy=V("runs[design=authority,killed=False].utilisation", "{:.0f}", scale=100),
    ratio=V("static_over_authority.wall_time", "{:.1f}"),
)
quote(
    BENCH,
    SHARE,
    "the actor closed it {freed} s after the kill (`lease_ttl_s={ttl}`)",
    freed=V("runs[design=authority,killed=True].freed_after_kill_s", "{:.1f}"),
    ttl=V("settings.lease_ttl", "{:.0f}"),
)

DECODE = "bench/decode_throughput.json"
for index, shape in enumerate(["tiny policy"] * 3 + ["4 layers, 256 wide"] * 3):
    row = f"rows[{index}]"
    quote(
        BENCH,
        DECODE,
        f"| {shape} | {{parameters}} | {{at_once}} | {{serial}} | {{batched}} | {{ratio}} | {{same}}/{{at_once}} |",
        parameters=V(f"{row}.parameters", "{:,}"),
        at_once=V(f"{row}.concurrency"),
        serial=V(f"{row}.serial_tokens_per_s", "{:,.0f}"),
        batched=V(f"{row}.batched_tokens_per_s", "{:,.0f}"),
        ratio=V(f"{row}.ratio", "{:.2f}"),
        same=V(f"{row}.same"),
    )

ENGINES = "bench/engines.json"
for index in range(3):
    level = f"figures.levels[{index}]"
    quote(
        BENCH,
        ENGINES,
        "| {at_once} | {vllm_s} | {hfcpu_s} | {vllm_tok} | {hfcpu_tok} | {ratio}x | {vllm_cores} / {hfcpu_cores} |",
        at_once=V(f"{level}.concurrency"),
        vllm_s=V(f"{level}.vllm_seconds", "{:.2f}"),
        hfcpu_s=V(f"{level}.hfcpu_seconds", "{:.2f}"),
        vllm_tok=V(f"{level}.vllm_tokens_per_s", "{:,.0f}"),
        hfcpu_tok=V(f"{level}.hfcpu_tokens_per_s", "{:,.0f}"),
        ratio=V(f"{level}.ratio", "{:.2f}"),
        vllm_cores=V(f"{level}.vllm_cores", "{:.2f}"),
        hfcpu_cores=V(f"{level}.hfcpu_cores", "{:.2f}"),
    )
quote(
    BENCH,
    ENGINES,
    "(about 2 min, of which\nthe vLLM server's start {start} s; numbers in `bench/engines.json`)",
    start=V("figures.vllm_start_s", "{:.0f}"),
)
quote(
    BENCH,
    ENGINES,
    "the vLLM server starts in {vllm}-54 s against\n{hfcpu}-7.4 s for `hfcpu`",
    vllm=V("figures.vllm_start_s", "{:.0f}"),
    hfcpu=V("figures.hfcpu_start_s", "{:.1f}"),
)
quote(
    BENCH,
    ENGINES,
    "(the\nsame function: greedy tokens equal on {same} requests)",
    same=V("figures.same_greedy_tokens"),
)

CAPACITY = "bench/session_capacity.json"
for at_once in (1, 2, 4, 8, 16, 32):
    cell = f"figures.{at_once}"
    quote(
        BENCH,
        CAPACITY,
        f"| {at_once} | {{seed}} / {{seed_max}} | {{observe}} / {{observe_max}} | {{wall}} | {{memory}} |",
        seed=V(f"{cell}.seed_median_s", "{:.2f}"),
        seed_max=V(f"{cell}.seed_max_s", "{:.2f}"),
        observe=V(f"{cell}.observe_median_s", "{:.2f}"),
        observe_max=V(f"{cell}.observe_max_s", "{:.2f}"),
        wall=V(f"{cell}.wall_per_episode_s", "{:.2f}"),
        memory=V(f"{cell}.environment_peak_gib", "{:.2f}"),
    )
quote(BENCH, CAPACITY, "load average {load} from other\nwork", load=V("machine.load", "{:.0f}", formula=float))
quote(
    BENCH,
    CAPACITY,
    "memory grows by about\n{per_browser} GiB per open browser",
    per_browser=V(
        ("figures.1.environment_peak_gib", "figures.32.environment_peak_gib"),
        "{:.2f}",
        formula=lambda one, many: (many - one) / 31,
    ),
)

CHAOS = "bench/chaos.json"
FAKE, REAL = "figures.targets[0]", "figures.targets[1]"
COUNT = r"(\d+/\d+)$"
quote(
    BENCH,
    CHAOS,
    "(92 s here, of which the fakes {fake_s} s; numbers in `bench/chaos.json`)",
    fake_s=V(f"{FAKE}.wall_s", "{:.0f}"),
)
quote(
    BENCH,
    CHAOS,
    "| | fakes (4 servers, {fake_n} rollouts in {fake_s} s) | real server ({real_n} rollouts in {real_s} s) |",
    fake_n=V(f"{FAKE}.rollouts"),
    fake_s=V(f"{FAKE}.wall_s", "{:.0f}"),
    real_n=V(f"{REAL}.rollouts"),
    real_s=V(f"{REAL}.wall_s", "{:.0f}"),
)
quote(
    BENCH,
    CHAOS,
    "| injected faults classified infrastructure | {fake}, each with its expected kind "
    "| {real}, each with its expected kind |",
    fake=V(f"{FAKE}.checks[0].check", pattern=COUNT),
    real=V(f"{REAL}.checks[0].check", pattern=COUNT),
)
quote(
    BENCH,
    CHAOS,
    "| policy outcomes classified infrastructure | {fake} | {real} |",
    fake=V(f"{FAKE}.checks[2].check", pattern=COUNT),
    real=V(f"{REAL}.checks[2].check", pattern=COUNT),
)
JUDGE_DOWN = "matrix.judge stops answering.infrastructure"


def _faults_minus_judged(check: str, judged: int) -> int:
    """Faults injected (the check's ``182/182``) less those of the judge, which is not resampled."""
    return int(re.search(r"(\d+)/\d+$", check).group(1)) - judged


quote(
    BENCH,
    CHAOS,
    "| rollout slots that produced a valid sample | {fake}/{fake} | {real}/{real} |",
    fake=V((f"{FAKE}.rollouts", f"{FAKE}.{JUDGE_DOWN}"), formula=lambda n, judged: n - judged),
    real=V((f"{REAL}.rollouts", f"{REAL}.{JUDGE_DOWN}"), formula=lambda n, judged: n - judged),
)
quote(
    BENCH,
    CHAOS,
    "| longest attempt vs deadline + one call timeout | {fake} s vs {fake_bound} s (event-loop lag up to {lag} s",
    fake=V(f"{FAKE}.checks[5].check", pattern=r"longest attempt ([\d.]+) s"),
    fake_bound=V(f"{FAKE}.checks[5].check", pattern=r"= (\d+) s"),
    lag=V(f"{FAKE}.checks[5].check", "{:.1f}", pattern=r"lag ([\d.]+) s", formula=float),
)
quote(
    BENCH,
    CHAOS,
    "| {real} s vs {real_bound} s |",
    real=V(f"{REAL}.checks[5].check", "{:.1f}", pattern=r"longest attempt ([\d.]+) s", formula=float),
    real_bound=V(f"{REAL}.checks[5].check", pattern=r"= (\d+) s"),
)
quote(
    BENCH,
    CHAOS,
    "rollouts whose judge stopped answering ({fake} and {real})",
    fake=V(f"{FAKE}.{JUDGE_DOWN}"),
    real=V(f"{REAL}.{JUDGE_DOWN}"),
)
quote(
    BENCH,
    CHAOS,
    "Every rollout that a fault hit was resampled ({fake} and {real})",
    fake=V((f"{FAKE}.checks[0].check", f"{FAKE}.{JUDGE_DOWN}"), formula=_faults_minus_judged),
    real=V((f"{REAL}.checks[0].check", f"{REAL}.{JUDGE_DOWN}"), formula=_faults_minus_judged),
)

LONG = "bench/long_episodes.json"
for index, (steps, mode) in enumerate([(s, m) for s in (5, 15, 30) for m in ("one sample", "step-wise")]):
    cell = f"figures.cells[{index}]"
    quote(
        BENCH,
        LONG,
        f"| {steps} | {mode} | {{samples}} | {{tokens_max}} | {{tokens_mean}} | {{heap}} MiB |",
        samples=V(f"{cell}.samples", "{:.0f}"),
        tokens_max=V(f"{cell}.tokens_max", "{:,}"),
        tokens_mean=V(f"{cell}.tokens_mean", "{:,.0f}"),
        heap=V(f"{cell}.peak_mib", "{:.2f}"),
    )
quote(
    BENCH,
    LONG,
    "Step-wise tokens per sample are flat (+{growth} % from 5 to 30 steps",
    growth=V("figures.verdict", pattern=r"step-wise largest sample \+(\d+)%"),
)

# ----- bench/resume_lean.json: docs/failures.md's "Resume: what it keeps" --------------------------------------------

LEAN = "bench/resume_lean.json"
FAILURES = "docs/failures.md"


def lean_cell(arm: str, rate: float) -> str:
    return f"figures.cells[arm={arm},rate={rate}]"


for rate, shown in ((0.0, "0 %"), (0.3, "30 %"), (0.85, "85 %")):
    for arm in ("rerun", "resume"):
        cell = lean_cell(arm, rate)
        quote(
            FAILURES,
            LEAN,
            f"| {shown} | {arm} | {{drawn}} | {{kept}} | {{lean}} | {{tokens}} | {{wasted}} | {{seconds}} "
            "| {resumed} | {diverged} | {rerun} | {invalid} |",
            drawn=V(f"{cell}.drawn_browse_share", "{:.3f}"),
            kept=V(f"{cell}.kept_browse_share", "{:.3f}"),
            lean=V(f"{cell}.lean", "{:+.3f}"),
            tokens=V(f"{cell}.tokens_per_kept", "{:.1f}"),
            wasted=V(f"{cell}.wasted_tokens_per_kept", "{:.1f}"),
            seconds=V(f"{cell}.episode_wall_s", "{:.2f}"),
            resumed=V(f"{cell}.resumed"),
            diverged=V(f"{cell}.diverged"),
            rerun=V(f"{cell}.rerun_after_action"),
            invalid=V(f"{cell}.still_invalid"),
        )
RERUN_30, RESUME_30 = lean_cell("rerun", 0.3), lean_cell("resume", 0.3)
RERUN_85, RESUME_85 = lean_cell("rerun", 0.85), lean_cell("resume", 0.85)
quote(
    FAILURES,
    LEAN,
    "Re-running keeps {kept} browsing samples where {drawn} were drawn (the arithmetic for a policy browsing half the "
    "time says {arithmetic}: about a third); resuming keeps {resumed}, a lean of {lean}, within the 0.05 targeted. "
    "What lean is left comes from the {rerun} episodes re-run all the same",
    kept=V(f"{RERUN_30}.kept_browse_share", "{:.3f}"),
    drawn=V(f"{RERUN_30}.drawn_browse_share", "{:.3f}"),
    arithmetic=V(f"{RERUN_30}.rerun_expected_share", "{:.3f}"),
    resumed=V(f"{RESUME_30}.kept_browse_share", "{:.3f}"),
    lean=V(f"{RESUME_30}.lean", "{:+.3f}"),
    rerun=V(f"{RESUME_30}.rerun_after_action"),
)
quote(
    FAILURES,
    LEAN,
    "{resumed} browsing kept against {rerun} re-running, {after} episodes re-run after an action and {invalid} still "
    "invalid",
    resumed=V(f"{RESUME_85}.kept_browse_share", "{:.3f}"),
    rerun=V(f"{RERUN_85}.kept_browse_share", "{:.3f}"),
    after=V(f"{RESUME_85}.rerun_after_action"),
    invalid=V(f"{RESUME_85}.still_invalid"),
)
quote(
    FAILURES,
    LEAN,
    "At 30 %, resuming generates {resume_30} tokens per kept sample that no kept sample holds, re-running {rerun_30}. "
    "At 85 % both waste about as much ({resume_85} and {rerun_85})",
    resume_30=V(f"{RESUME_30}.wasted_tokens_per_kept", "{:.1f}"),
    rerun_30=V(f"{RERUN_30}.wasted_tokens_per_kept", "{:.1f}"),
    resume_85=V(f"{RESUME_85}.wasted_tokens_per_kept", "{:.1f}"),
    rerun_85=V(f"{RERUN_85}.wasted_tokens_per_kept", "{:.1f}"),
)
quote(
    FAILURES,
    LEAN,
    "a mean episode takes {resume_30} s resuming against {rerun_30} s re-running at 30 %, {resume_85} s against "
    "{rerun_85} s at 85 % ({latency} s per call, {concurrency} episodes at once, load average {load} from other work)",
    resume_30=V(f"{RESUME_30}.episode_wall_s", "{:.2f}"),
    rerun_30=V(f"{RERUN_30}.episode_wall_s", "{:.2f}"),
    resume_85=V(f"{RESUME_85}.episode_wall_s", "{:.2f}"),
    rerun_85=V(f"{RERUN_85}.episode_wall_s", "{:.2f}"),
    latency=V("settings.latency_s", "{:.2f}"),
    concurrency=V("settings.concurrency"),
    load=V("machine.load", "{:.0f}", formula=float),
)
quote(
    FAILURES,
    LEAN,
    "{episodes} episodes per row, the same routes and fault draws in both arms, `max_attempts` {attempts}",
    episodes=V("settings.episodes"),
    attempts=V("figures.max_attempts"),
)

# ----- the machine each benchmark ran on (docs/benchmarks.md): its JSON's ``machine`` --------------------------------


def _cpu_name(reported: str) -> str:
    """The CPU model as the pages name it: ``Intel(R) Xeon(R) Processor`` -> ``Intel Xeon``."""
    return reported.replace("(R)", "").replace(" Processor", "").strip()


def cpu(path: str = "machine.cpu") -> Value:
    return V(path, formula=_cpu_name)


def load(fmt: str, path: str = "machine.load") -> Value:
    return V(path, fmt, formula=float)


MACHINE_SOURCES = tuple(
    f"bench/{path.name}"
    for path in sorted((ROOT / "bench").glob("*.json"))
    if "machine" in json.loads(path.read_text(encoding="utf-8"))
)


def _count_cpu(name: str) -> Value:
    paths = tuple(f"{source}:machine.cpu" for source in MACHINE_SOURCES)
    return V(paths, formula=lambda *cpus: sum(_cpu_name(reported) == name for reported in cpus))


quote(
    BENCH,
    BIAS,
    "The CPU it reported was an Intel Xeon for {intel} of the\nbenchmarks and an AMD EPYC for the other {amd}, and the "
    "load average when each started ranged from {low} to {high}",
    intel=_count_cpu("Intel Xeon"),
    amd=_count_cpu("AMD EPYC"),
    low=V(tuple(f"{s}:machine.load" for s in MACHINE_SOURCES), "{:.1f}", formula=lambda *v: min(map(float, v))),
    high=V(tuple(f"{s}:machine.load" for s in MACHINE_SOURCES), "{:.0f}", formula=lambda *v: max(map(float, v))),
)
for source, text, fmt in [
    (BIAS, "`bench/baseline_bias.json`; 2 cores ({cpu}), load average {load})", "{:.1f}"),
    (SPEED, "`bench/grpo_speed.json`; 2 cores ({cpu}), load average {load}; same batches", "{:.1f}"),
    (OVERHEAD, "episode) / 10. 2 cores ({cpu}), load average {load}:", "{:.1f}"),
    (PLACEMENT, "medians of 5 rounds on 2 cores ({cpu}), load average {load}:", "{:.1f}"),
    (SHARE, "`bench/placement_share.json`; 2 cores ({cpu}), load average {load} from other work)", "{:.0f}"),
    (CAPACITY, "Memory is the PSS of the server and Chromium; 2 cores ({cpu}), load average {load}", "{:.0f}"),
    (DECODE, "2 cores ({cpu}), one decode thread, load average {load} from other work", "{:.1f}"),
    (CHAOS, "Measured on 2 cores ({cpu}), load average {load}:", "{:.1f}"),
    (LONG, "2\ncores ({cpu}), load average {load}:", "{:.1f}"),
    (LEAN, "2 cores\n({cpu}), load average {load} from other work; the table", "{:.0f}"),
]:
    quote(BENCH, source, text, cpu=cpu(), load=load(fmt))
quote(
    BENCH,
    ENGINES,
    "2 cores ({cpu}), load average {low}-{high} from other work over the waves:",
    cpu=cpu(),
    low=V("figures.waves[*].load", "{:.1f}", reduce="min"),
    high=V("figures.waves[*].load", "{:.1f}", reduce="max"),
)
quote(BENCH, ENGINES, "(`engines.py`: `.venv-vllm`'s torch {torch})", torch=V("machine.torch"))


# ----- the tests ------------------------------------------------------------------------------------------------------


def _page(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def _flat(text: str) -> str:
    """``text`` with every run of white space (line breaks included) as one space."""
    return " ".join(text.split())


@pytest.mark.parametrize("quoted", QUOTES, ids=lambda q: f"{q.page}:{q.text.splitlines()[0][:60]}")
def test_each_quoted_figure_is_the_one_its_benchmark_json_holds(quoted: Quote) -> None:
    expected = quoted.render()
    page = _page(quoted.page)
    if _flat(expected) not in _flat(page):  # where a paragraph wraps its lines does not matter
        lines = page.splitlines()
        first = expected.splitlines()[0]
        near = difflib.get_close_matches(first, lines, n=1, cutoff=0.3)
        pytest.fail(
            f"{quoted.page} should quote, from {quoted.source}:\n  {expected!r}\nclosest line there:\n  {near!r}"
        )


def _rehearsal_training_flags() -> dict[str, str]:
    """The flags ``scripts/rehearse.sh --train`` gives ``training_run``."""
    script = (ROOT / "scripts" / "rehearse.sh").read_text(encoding="utf-8")
    command = script[script.index("-m nemo_gym_browser.local.training_run") :].split("\nfi", 1)[0]
    return dict(re.findall(r"(--[\w-]+) ([^\s\\]+)", command))


def test_the_rehearsals_evaluation_is_the_one_the_learning_results_name() -> None:
    import importlib.util

    import yaml

    flags = _rehearsal_training_flags()
    settings = json.loads((ROOT / CURVE).read_text(encoding="utf-8"))["settings"]
    rehearsal = {
        "tasks": flags["--val-tasks"],
        "steps": flags["--steps"],
        "freq": flags["--test-freq"],
        "prompts": flags["--prompts-per-step"],
        "group": flags["--group-size"],
    }
    assert rehearsal == REHEARSAL_EVAL_AS_WRITTEN
    data = json.loads((ROOT / CURVE).read_text(encoding="utf-8"))
    page = _page("docs/learning-results.md")
    for name, text in REHEARSAL_EVAL_ROWS.items():
        benchmark = {key: value.render(data) for key, value in REHEARSAL_EVAL_FIELDS[name].items()}
        assert _flat(text.format(**benchmark, **rehearsal)) in _flat(page)
    # "the same in both"
    assert (flags["--suite"], int(flags["--steps"]), float(flags["--lr"])) == (
        "deal",
        settings["steps"],
        settings["lr"],
    )
    assert float(flags["--fault-rate"]) in settings["rates"] and flags["--fault-kind"] == settings["fault_kind"]
    assert flags["--fault-at"] == "browser-call" and "--engine" not in flags and "--environment" not in flags
    # greedy, one answer: verl's default validation sampling, which neither the recipe's config nor the local run
    # changes (the benchmark does, with val_kwargs overrides)
    verl = Path(importlib.util.find_spec("verl").submodule_search_locations[0])  # found, not imported: it is slow
    defaults = yaml.safe_load((verl / "trainer" / "config" / "rollout" / "rollout.yaml").read_text())["val_kwargs"]
    assert (defaults["temperature"], defaults["n"], defaults["do_sample"]) == (0, 1, False)
    for path in (
        ROOT / "configs" / "webvoyager_grpo.yaml",
        ROOT / "local" / "run_spec.py",
        ROOT / "local" / "training_run.py",
    ):
        assert "val_kwargs" not in path.read_text(encoding="utf-8"), path
    assert "val_kwargs.do_sample=True" in (ROOT / "bench" / "learning_curve.py").read_text(encoding="utf-8")


def test_every_benchmark_table_the_docs_mark_as_checked_has_quotes() -> None:
    marked = {
        (page, match)
        for page in ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))
        for match in re.findall(r"<!-- figures: (bench/[\w.]+\.json)", _page(page))
    }
    quoted = {(q.page, q.source) for q in QUOTES}

    assert marked, "no page marks its figures"
    assert sorted(marked - quoted) == []


def test_the_main_benchmarks_are_covered() -> None:
    sources = {q.source for q in QUOTES}

    for source in (BIAS, CURVE, ENGINES, CAPACITY, CHAOS):
        assert source in sources
    assert len(QUOTES) >= 80


def test_a_changed_figure_or_json_value_is_caught(tmp_path: Path) -> None:
    data = {"figures": {"rows": [{"arm": "recipe", "s": 0.125}, {"arm": "stock", "s": 2.5}]}}
    (tmp_path / "b.json").write_text(json.dumps(data))
    value = V("figures.rows[arm=recipe].s", "{:.0f}", scale=1000)

    assert value.render(data) == "125"
    assert V("figures.rows[*].s", "{:.2f}", reduce="mean").render(data) == "1.31"
    data["figures"]["rows"][0]["s"] = 0.126
    assert value.render(data) != "125"
    with pytest.raises(KeyError, match="nothing at"):
        lookup(data, "figures.rows[arm=none].s")
