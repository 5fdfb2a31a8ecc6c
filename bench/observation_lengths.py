"""How long a browser observation is, in characters and in tokens: the numbers the recipe's turn budget rests on.

Observations are read with the recipe's own environment client (seed, observe, close) from:

* the fake server's pages (the real server's bundled ``site/``, as ``local/environment_server/server.py`` serves it);
* with ``--real``: the real nemo-gym 0.7.0 server with headless Chromium (``launch_environment.py``) on the test
  site (``local/site``: home, about, results and the 24 shop pages), and on a generated page at the server's
  caps (60 links with long names, several thousand characters of text: the server keeps 50 elements of at most
  80 characters and 2000 characters of text);
* the render contract's worst case, built without a server: 50 elements of 80 characters with the longest tag
  name, 2000 characters of text and both truncation notes.

Token counts need a tokenizer file: ``--tokenizer PATH`` (a ``tokenizer.json``, or a Hugging Face tokenizer folder,
e.g. a Qwen2.5 model's). The tool-turn overhead is measured with the same tokenizer: what verl's hermes chat
template puts around one tool response (end of the assistant turn, the tool turn's header and footer, the next
generation prompt). The recipe's turn budget (``configs/webvoyager_grpo.yaml``) quotes its output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import re
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.environment_server.site_model import BUNDLED_INITIAL_URL
from nemo_gym_browser.settings import EnvironmentConfig
from nemo_gym_browser.testing.benchmarking import header, write_report

EXAMPLES = """\
examples:
  python bench/observation_lengths.py                                   # fake server and the render's worst case
  python bench/observation_lengths.py --real --tokenizer /models/Qwen2.5-7B-Instruct/tokenizer.json

exit codes: 0 measured, 2 usage error (e.g. no such tokenizer file)
"""

RECIPE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_JSON = RECIPE_DIR / "bench" / "observation_lengths.json"
SITE_DIR = RECIPE_DIR / "local" / "site"
# The server's caps (nemo-gym 0.7.0 browser/page.py and app.py): elements shown, characters per element name and
# of page text. The generated page exceeds each.
MAX_ELEMENTS, MAX_NAME_CHARS, MAX_TEXT_CHARS = 50, 80, 2000
LONGEST_TAG = "textarea"
# What verl's hermes template wraps around one tool response, and the generation prompt after it.
TOOL_TURN_PREFIX = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
TOOL_TURN_SUFFIX = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
ACTIONS = (
    '<tool_call>\n{"name": "browser", "arguments": {"action": "observe"}}\n</tool_call>',
    '<tool_call>\n{"name": "browser", "arguments": {"action": "click", "element_id": 37}}\n</tool_call>',
    "The search box is element 4; I will type the product name and submit.\n"
    '<tool_call>\n{"name": "browser", "arguments": {"action": "type", "element_id": 4, "text": '
    '"Logitech MX Master 3S wireless mouse"}}\n</tool_call>',
    "The results page lists the price under the first item: $99.99.\n"
    '<tool_call>\n{"name": "browser", "arguments": {"action": "finish", "answer": "$99.99"}}\n</tool_call>',
)


@dataclass(frozen=True)
class Measured:
    source: str
    page: str
    chars: int
    tokens: int | None


def load_counter(path: str | None) -> Callable[[str], int] | None:
    if path is None:
        return None
    target = Path(path)
    if target.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(target))
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    return lambda text: len(hf.encode(text, add_special_tokens=False))


def filler_words() -> list[str]:
    """English prose (this recipe's README, markup stripped) to fill the generated page."""
    text = re.sub(r"[`*|#\[\]()<>_]", " ", (RECIPE_DIR / "README.md").read_text(encoding="utf-8"))
    return text.split()


def cap_page(words: Sequence[str]) -> str:
    """A page beyond every cap of the server: 60 links with names over 80 characters, 6000+ characters of text."""
    links = []
    for i in range(60):
        name = " ".join(words[i * 17 : i * 17 + 17])
        links.append(f'<li><a href="index.html?item={i}">{html.escape(name)}</a></li>')
    paragraphs = [f"<p>{html.escape(' '.join(words[j : j + 60]))}</p>" for j in range(1200, 2400, 60)]
    return (
        "<!doctype html><html><head><title>Catalogue of everything, page 1 of 40</title></head><body>"
        f"<ul>{''.join(links)}</ul>{''.join(paragraphs)}</body></html>"
    )


def worst_case_render(words: Sequence[str]) -> str:
    """The longest observation the server's render can make, URL and title aside (nemo-gym ``Observation.render``)."""
    filler = " ".join(words)
    lines = ["URL: https://www.example.com/catalogue?page=1", "TITLE: Catalogue of everything", "ELEMENTS:"]
    for i in range(MAX_ELEMENTS):
        lines.append(f"  [{i}] {LONGEST_TAG}: {filler[i * 90 : i * 90 + MAX_NAME_CHARS]}")
    lines.append(f"  ... (truncated at {MAX_ELEMENTS} elements)")
    lines += ["TEXT:", "  " + filler[5000 : 5000 + MAX_TEXT_CHARS], "  ... (truncated)"]
    return "\n".join(lines)


async def observe_pages(server_url: str, start_urls: Sequence[str]) -> list[tuple[str, str]]:
    config = EnvironmentConfig.from_mapping({"server_urls": [server_url], "call_timeout_s": 60, "seed_timeout_s": 60})
    client = EnvironmentClient(config)
    observations = []
    try:
        for url in start_urls:
            async with client.session(
                rollout_id=f"measure-{uuid.uuid4().hex[:8]}", attempt=1, task_id="measure", initial_url=url
            ) as session:
                result = await session.call("browser_observe", {})
                observations.append((url, result.observation))
    finally:
        await client.close()
    return observations


@contextlib.asynccontextmanager
async def real_environment() -> AsyncIterator[tuple[str, str, str]]:
    """The real server, the test site and a folder with the page at the caps: (server URL, site URL, caps URL)."""
    from nemo_gym_browser.launch_environment import LocalEnvironment
    from nemo_gym_browser.local.local_site import LocalSite

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "index.html").write_text(cap_page(filler_words()), encoding="utf-8")
        with LocalSite() as site, LocalSite(folder) as caps:
            environment = await asyncio.to_thread(LocalEnvironment().start)
            try:
                yield environment.url, site.url, caps.url
            finally:
                await asyncio.to_thread(environment.stop)


async def measure(real: bool) -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = []
    async with InProcessEnvironmentServer() as fake:
        for page in (BUNDLED_INITIAL_URL, "site/about.html", "site/form.html"):
            found += [("fake server", url, text) for url, text in await observe_pages(fake.url, [page])]
    if real:
        async with real_environment() as (server, site, caps):
            pages = ["index.html", "about.html", "results.html?q=garden"]
            pages += [f"shop/{p.name}" for p in sorted((SITE_DIR / "shop").glob("*.html"))]
            observed = await observe_pages(server, [f"{site}/{p}" for p in pages] + [f"{caps}/index.html"])
            found += [("real server", url.split("/", 3)[-1] if "caps" not in url else url, t) for url, t in observed]
            found[-1] = ("real server", "page at the caps", found[-1][2])
    found.append(("render contract", "worst case", worst_case_render(filler_words())))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--real", action="store_true", help="also observe pages through the real server (.venv-gym)")
    parser.add_argument("--tokenizer", help="tokenizer.json or a Hugging Face tokenizer folder, for token counts")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        print(f"error: no tokenizer at {args.tokenizer}", file=sys.stderr)
        return 2
    count = load_counter(args.tokenizer)

    print(header("Browser observation lengths") + "\n")
    rows = asyncio.run(measure(args.real))
    measured = [Measured(src, page, len(text), count(text) if count else None) for src, page, text in rows]
    print(f"{'source':<16} {'page':<28} {'chars':>6} {'tokens':>7} {'chars/token':>12}")
    for m in measured:
        tokens = f"{m.tokens:>7}" if m.tokens is not None else f"{'-':>7}"
        ratio = f"{m.chars / m.tokens:>12.2f}" if m.tokens else f"{'-':>12}"
        print(f"{m.source:<16} {m.page[:28]:<28} {m.chars:>6} {tokens} {ratio}")
    by_source: dict[str, list[Measured]] = {}
    for m in measured:
        by_source.setdefault(m.source, []).append(m)
    print()
    for source, items in by_source.items():
        chars = [m.chars for m in items]
        line = f"{source}: {len(items)} pages, {min(chars)}-{max(chars)} characters"
        if count:
            ratios = [m.chars / m.tokens for m in items if m.tokens]
            line += f", {min(m.tokens or 0 for m in items)}-{max(m.tokens or 0 for m in items)} tokens"
            line += f", {min(ratios):.2f}-{max(ratios):.2f} characters per token"
        print(line)
    figures: dict[str, object] = {"pages": measured}
    if count:
        overhead = count(TOOL_TURN_PREFIX) + count(TOOL_TURN_SUFFIX)
        actions = [count(a) for a in ACTIONS]
        print(f"tool turn around one observation: {overhead} tokens")
        print("assistant turns (one tool call, with or without a sentence): " + ", ".join(map(str, actions)))
        figures |= {"tool_turn_tokens": overhead, "assistant_turn_tokens": actions}
    write_report(args.json, vars(args), figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
