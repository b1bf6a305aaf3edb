"""A Responses body as the chat body it stands for (openai.responses_chat_view): the same history hashes to the same
chain, a further turn extends it, an edit changes it from the edited item on, and `instructions` with the tools are
the system part, the same one a chat request with that system prompt has."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.cache.chain import Link, common_messages, message_chain
from slotkeeper.cache.systemprompt import SystemPrompt, system_prompt_of
from slotkeeper.dialects import openai

CODEX = json.loads((Path(__file__).parent.parent / "fixtures" / "clients" / "codex.json").read_text())
BODIES: list[dict[str, Any]] = [r["body"] for r in CODEX["requests"]]
INSTRUCTIONS = "You are a coding agent. Keep changes small."
SHELL = {"type": "function", "name": "shell", "description": "Run a command.",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


CALL = {"type": "function_call", "name": "shell", "arguments": '{"command": "ls"}', "call_id": "call_1"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc"}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "**Listing**"}],
             "content": [{"type": "reasoning_text", "text": "List the files first."}], "encrypted_content": ""}
HISTORY = [user("what is here?"), REASONING, CALL, OUTPUT, assistant("a README and src/"), user("and in src?")]


def body(items: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "instructions": INSTRUCTIONS, "input": items, "tools": [SHELL], "stream": True, **extra}


def chain(responses_body: dict[str, Any]) -> list[Link]:
    view = openai.responses_chat_view(responses_body)
    return message_chain(view["messages"], view.get("tools"))


def system_part(responses_body: dict[str, Any]) -> SystemPrompt:
    part = system_prompt_of(openai.responses_chat_view(responses_body))
    assert part is not None
    return part


def test_the_same_history_hashes_to_the_same_chain() -> None:
    resent = copy.deepcopy(body(HISTORY))
    # What never reaches the prompt: item ids and statuses the API handed out, key order, sampling fields.
    resent["input"][4] = {"status": "completed", "id": "msg_9", **assistant("a README and src/")}
    resent["input"][0] = dict(reversed(list(resent["input"][0].items())))
    resent["temperature"] = 0.3
    assert [link.digest for link in chain(resent)] == [link.digest for link in chain(body(HISTORY))]


def test_each_item_is_its_own_chain_position_after_the_instructions() -> None:
    assert len(chain(body(HISTORY))) == 1 + len(HISTORY)
    assert len(chain({"input": HISTORY})) == len(HISTORY)  # no instructions: no system message either


@pytest.mark.parametrize("turn", range(1, len(BODIES)))
def test_a_further_codex_turn_extends_the_chain(turn: int) -> None:
    before, after = chain(BODIES[turn - 1]), chain(BODIES[turn])
    assert len(after) > len(before)
    assert common_messages(before, after) == len(before)


def test_a_new_turn_on_a_hand_made_history_extends_it() -> None:
    before = chain(body(HISTORY))
    after = chain(body([*HISTORY, REASONING, CALL, OUTPUT]))
    assert common_messages(before, after) == len(before) and len(after) == len(before) + 3


@pytest.mark.parametrize(("index", "edited"), [
    (0, user("what is there?")),
    (1, {**REASONING, "content": [{"type": "reasoning_text", "text": "Think again."}]}),
    (2, {**CALL, "arguments": '{"command": "ls -a"}'}),
    (3, {**OUTPUT, "output": "README.md"}),
    (4, assistant("only a README")),
], ids=["user", "reasoning", "call", "output", "assistant"])
def test_an_edited_item_changes_the_chain_from_that_item_on(index: int, edited: dict[str, Any]) -> None:
    items = copy.deepcopy(HISTORY)
    items[index] = edited
    original, changed = chain(body(HISTORY)), chain(body(items))
    assert common_messages(original, changed) == 1 + index  # the instructions and the items before the edit
    assert all(a.digest != b.digest for a, b in zip(original[1 + index:], changed[1 + index:], strict=True))


def test_other_instructions_or_tools_change_every_position() -> None:
    assert common_messages(chain(body(HISTORY)), chain({**body(HISTORY), "instructions": "Other."})) == 0
    assert common_messages(chain(body(HISTORY)), chain({**body(HISTORY), "tools": []})) == 0


def test_instructions_and_tools_are_the_system_part_in_every_turn() -> None:
    part = system_part(body(HISTORY[:1]))
    assert part.messages == ({"role": "system", "content": INSTRUCTIONS},)
    assert part.tools == ({"type": "function", "function": {k: v for k, v in SHELL.items() if k != "type"}},)
    assert system_part(body(HISTORY)).digest == part.digest
    assert len({system_part(b).digest for b in BODIES}) == 1
    assert system_part(BODIES[0]).messages[0]["content"] == BODIES[0]["instructions"]


def test_a_chat_request_with_the_same_system_prompt_shares_the_system_part() -> None:
    """A chat client and a Responses client on one system prompt and tools share one system snapshot."""
    chat_tools = [{"type": "function", "function": {"name": "shell", "description": "Run a command.",
                                                    "parameters": SHELL["parameters"]}}]
    chat = {"messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "hi"}],
            "tools": chat_tools}
    assert system_prompt_of(chat).digest == system_part(body([user("hi")])).digest  # type: ignore[union-attr]


def test_developer_items_in_front_belong_to_the_system_part() -> None:
    developer = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandboxed"}]}
    part = system_part(body([developer, *HISTORY]))
    assert part.messages == ({"role": "system", "content": INSTRUCTIONS},
                             {"role": "developer", "content": [{"type": "text", "text": "sandboxed"}]})


def test_without_instructions_and_tools_there_is_no_system_part() -> None:
    assert system_prompt_of(openai.responses_chat_view({"input": HISTORY})) is None


def test_a_string_input_is_one_user_message() -> None:
    assert openai.responses_chat_view({"instructions": "Be brief.", "input": "Hello"}) == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]}


def test_items_in_chat_form() -> None:
    """Messages by role with chat text parts (a string content is one part, as llama-server reads it), a function
    call as an assistant tool call, its output as a tool message, other items as they are less id and status."""
    image = {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}
    messages = openai.responses_messages({"input": [
        {"role": "user", "content": "plain"}, *HISTORY[:5], image, {"type": "web_search_call", "id": "ws_1"}, 7]})
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "plain"}]},
        {"role": "user", "content": [{"type": "text", "text": "what is here?"}]},
        {"type": "reasoning", "summary": REASONING["summary"], "content": REASONING["content"],
         "encrypted_content": ""},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nsrc"},
        {"role": "assistant", "content": [{"type": "text", "text": "a README and src/"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"type": "web_search_call"},
        {"item": 7},
    ]


def test_a_null_instructions_is_an_empty_system_message_as_the_backend_renders_it() -> None:
    assert openai.responses_messages({"instructions": None, "input": "hi"})[0] == {"role": "system", "content": ""}


@pytest.mark.parametrize(("tools", "expected"), [
    (None, None),
    ("junk", None),
    ([], []),
    ([{"type": "web_search"}, {"type": "custom", "name": "apply_patch"}, "junk"], []),
    ([{"type": "function", "name": "f", "strict": False}],
     [{"type": "function", "function": {"name": "f", "strict": False}}]),
    ([{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}],
     [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
], ids=["none", "not-a-list", "empty", "built-in-tools-dropped", "fields-as-given", "functions-kept"])
def test_tools_in_chat_form(tools: Any, expected: Any) -> None:
    assert openai.responses_tools(tools) == expected


def test_the_view_never_changes_the_body() -> None:
    original = body(HISTORY)
    kept = copy.deepcopy(original)
    openai.responses_chat_view(original)
    assert original == kept
