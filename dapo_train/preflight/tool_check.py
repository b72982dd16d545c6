"""Preflight's rehearsal of a tool call at the run's own tokenizer and chat template (rollout.tools).

The rehearsal model has random weights and almost never writes a call, so the tool path is rehearsed
directly: an assistant turn that calls a tool, as the chat template renders one, goes through the code
the rollout engine runs (ToolTurns.answer: parse the call, run the tool, render the tool turn, tokenize
it). The prompt's tokens, the turn's and the tool turn's must then be exactly the tokens of the whole
conversation rendered by the template and tokenized at once: otherwise the transcripts the policy
trains on would differ from the conversations its chat template (and the model serving it) produces.
"""

from __future__ import annotations

from typing import Any

from dapo_train.errors import ConfigError
from dapo_train.tools.turns import ToolTurns

QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]
CONTENT = "I use the calculator."
ARGUMENTS = {"calculator": {"expression": "17 * 23"}}  # a tool not listed here is called without arguments


def rehearse_tool_call(tokenizer: Any, turns: ToolTurns) -> str:
    """One call of the first tool (the calculator when named) through ToolTurns -> the report's line;
    ConfigError when the rollout's tokens are not the template's conversation tokenized at once."""
    tool = turns.tools.get("calculator") or next(iter(turns.tools.values()))
    arguments = ARGUMENTS.get(tool.name, {})
    assistant = {"role": "assistant", "content": CONTENT,
                 "tool_calls": [{"type": "function", "function": {"name": tool.name, "arguments": arguments}}]}

    def render(messages: list[dict], generation: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=turns.schemas, tokenize=False,
                                             add_generation_prompt=generation)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt, with_turn = render(QUESTION, True), render([*QUESTION, assistant], False)
    eos = tokenizer.eos_token or ""
    end = with_turn.find(eos, len(prompt)) if eos and with_turn.startswith(prompt) else -1
    if end < 0:
        raise ConfigError("rollout.tools", "preflight's tool-call rehearsal: the chat template's assistant turn does "
                                           f"not continue its generation prompt and end with {eos!r}")
    turn_ids = ids(with_turn[len(prompt) : end + len(eos)])  # what the policy writes, its stop token last
    answer = turns.answer(turn_ids, 0)
    if answer is None or answer.over_limit or len(answer.calls) != 1:
        found = "none" if answer is None else "over rollout.max_tool_calls" if answer.over_limit else len(answer.calls)
        raise ConfigError("rollout.tools", "preflight's tool-call rehearsal: the rollout did not read the one call "
                                           f"in the template's rendering of an assistant turn (found: {found})")
    (call,) = answer.calls
    whole = render([*QUESTION, assistant, {"role": "tool", "name": call.name, "content": call.result}], True)
    transcript, expected = ids(prompt) + turn_ids + answer.forced_ids, ids(whole)
    if transcript != expected:
        at = next((i for i, (a, b) in enumerate(zip(transcript, expected)) if a != b), min(map(len, (transcript,
                                                                                                   expected))))
        shown = [tokenizer.decode(seq[at : at + 3]) if at < len(seq) else "(the end)" for seq in (transcript, expected)]
        raise ConfigError("rollout.tools", "preflight's tool-call rehearsal: the rollout's tokens (prompt, turn, tool "
                                           "turn tokenized alone) differ from the whole conversation tokenized at "
                                           f"once at token {at}: {shown[0]!r} against {shown[1]!r}")
    return (f"{call.name} called with {arguments} through the rollout's tool turns: -> {call.result!r}"
            f"{' (an error text)' if call.error else ''}; prompt {len(ids(prompt))} + turn {len(turn_ids)} + tool "
            f"turn {len(answer.forced_ids)} tokens = the whole conversation as the chat template renders it, "
            "tokenized at once")
