"""The MiniWoB++ solver reads observations the way the policy does: the calls it makes from observation text alone,
replayed from an episode's answers so far, and what it does when a page is not what it expects.

The observations below are the real server's for the seeds named (``tests/test_miniwob_integration.py`` and
``python -m nemo_gym_browser.local.miniwob.evaluate`` play the solver on Chromium).
"""

from __future__ import annotations

from nemo_gym_browser.local.chat_tokenizer import TOOL_RESPONSE_END, TOOL_RESPONSE_START
from nemo_gym_browser.local.miniwob import solver


def observation(task: str, title: str, elements: list[str], text: str) -> str:
    """An observation as the 0.7.0 server renders it (an input without a value attribute has an empty name)."""
    lines = [f"URL: http://127.0.0.1:8766/miniwob/{task}.html?seed=1", f"TITLE: {title}", "ELEMENTS:"]
    lines += [f"  [{index}] {element}" for index, element in enumerate(elements)]
    return "\n".join([*lines, "TEXT:", f"  {text}"])


CHECKBOXES = observation(
    "click-checkboxes-large",
    "Click Checkboxes Task",
    ["input: "] * 8 + ["button: Submit"],
    "Select kQHh8j, SaIGD, wjy8, 4tF, oB, 2uMiJWr and click Submit. SaIGD kQHh8j oB 2uMiJWr mUW h2lI wjy8 4tF Submit",
)
GUESS = observation(
    "guess-number",
    "Resize Textarea Task",
    ["input: ", "button: Submit"],
    "Guess the number between 0-9 and press Submit. Use the feedback below to find the right number. {feedback} Submit",
)


def play(first: str, answers: list[str]) -> list[dict]:
    """The solver's calls over an episode whose pages answer with ``answers`` in turn (the first call observes)."""
    observations, calls = [], []
    for answer in [first, *answers]:
        calls.append(solver.next_call(observations))
        observations.append(answer)
    calls.append(solver.next_call(observations))
    return calls


def test_the_first_call_observes_and_a_task_without_a_plan_or_an_unexpected_page_ends_with_finish():
    assert solver.next_call([]) == {"action": "observe"}
    drag = CHECKBOXES.replace("click-checkboxes-large", "drag-box")
    assert solver.next_call([drag]) == solver.finish()
    missing_submit = CHECKBOXES.replace("  [8] button: Submit\n", "")
    assert play(missing_submit, [missing_submit] * 6)[-1] == solver.finish()
    assert solver.next_call(["Error: observe failed: the page crashed"]) == solver.finish()


def test_checkboxes_listed_without_names_are_matched_to_the_labels_that_follow_in_the_same_order():
    calls = play(CHECKBOXES, [CHECKBOXES] * 6)
    # labels in page order: SaIGD kQHh8j oB 2uMiJWr mUW h2lI wjy8 4tF; all but mUW and h2lI are asked for
    assert calls[1:] == [
        *({"action": "click", "element_id": element} for element in (0, 1, 2, 3, 6, 7)),
        {"action": "click", "element_id": 8},
    ]


def test_a_plan_is_replayed_over_the_answers_so_far_and_follows_the_pages_feedback():
    guesses = play(
        GUESS.format(feedback="Waiting for your guess..."),
        [
            GUESS.format(feedback="Waiting for your guess..."),
            GUESS.format(feedback="The number is higher than 4."),
            GUESS.format(feedback="The number is higher than 4."),
            GUESS.format(feedback="The number is lower than 7."),
            GUESS.format(feedback="The number is lower than 7."),
            GUESS.format(feedback="Correct! Episode over. MiniWoB reward: 1.00."),
        ],
    )
    typed = [call["text"] for call in guesses if call["action"] == "type"]
    assert typed == ["4", "7", "5"]
    assert guesses[-1] == solver.finish()


def test_the_script_reads_every_tool_answer_of_the_conversation_and_writes_one_browser_call():
    answers = [CHECKBOXES, CHECKBOXES]
    conversation = "".join(f"{TOOL_RESPONSE_START}\n{answer}\n{TOOL_RESPONSE_END}" for answer in answers)
    assert solver.tool_answers(conversation) == answers

    class View:
        text = "<|im_start|>user\nTask: ...<|im_end|>" + conversation

    assert solver.script(View()) == solver.render_call({"action": "click", "element_id": 1})
    assert solver.render_call({"action": "observe"}).startswith("<tool_call>\n")
