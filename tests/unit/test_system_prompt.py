"""System-prompt keys: stable from turn 1 to turn N, blind to key order and cache_control, different when what the
model reads before the conversation differs."""

from __future__ import annotations

from typing import Any

from slotkeeper.cache.chain import common_messages, message_chain
from slotkeeper.cache.systemprompt import system_prompt_of
from slotkeeper.dialects import anthropic

PATH_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read", "parameters": PATH_SCHEMA}}]
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}


def digest(body: dict[str, Any]) -> str:
    part = system_prompt_of(body)
    assert part is not None
    return part.digest


def test_turn_n_of_an_openai_conversation_hashes_like_turn_1() -> None:
    turn1 = {"messages": [SYSTEM, {"role": "user", "content": "hi"}], "tools": TOOLS}
    turn3 = {"messages": [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "and now?"}], "tools": TOOLS, "temperature": 0.2}
    assert digest(turn1) == digest(turn3)


def test_claude_code_reminder_blocks_belong_to_the_system_part_in_every_turn() -> None:
    first_user = [{"type": "text", "text": "<system-reminder>project rules</system-reminder>"},
                  {"type": "text", "text": "<system-reminder>today is Monday</system-reminder>"},
                  {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]
    turn1 = {"model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "You are Claude Code."}],
             "tools": tools, "messages": [{"role": "user", "content": first_user}]}
    turn2 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": "done"},
                                   {"role": "user", "content": "thanks"}]}
    body1 = anthropic.chat_body(anthropic.parse_messages_request(turn1), turn1)
    body2 = anthropic.chat_body(anthropic.parse_messages_request(turn2), turn2)
    part1, part2 = system_prompt_of(body1), system_prompt_of(body2)
    assert part1 is not None and part2 is not None
    assert part1.digest == part2.digest
    assert len(part1.instructions) == 2
    other_rules = {**turn1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>other rules</system-reminder>"}, first_user[2]]}]}
    body3 = anthropic.chat_body(anthropic.parse_messages_request(other_rules), other_rules)
    assert digest(body3) != part1.digest


def test_key_order_and_cache_control_do_not_change_the_key() -> None:
    a = {"messages": [{"role": "system", "content": [{"type": "text", "text": "rules"}]}], "tools": TOOLS}
    b = {"tools": [{"function": dict(reversed(list(TOOLS[0]["function"].items()))), "type": "function"}],
         "messages": [{"content": [{"text": "rules", "type": "text", "cache_control": {"type": "ephemeral"}}],
                       "role": "system"}]}
    assert digest(a) == digest(b)


def test_a_different_system_prompt_or_tool_set_is_another_key() -> None:
    base = {"messages": [SYSTEM, {"role": "user", "content": "hi"}], "tools": TOOLS}
    assert digest(base) != digest({**base, "tools": []})
    assert digest(base) != digest({**base, "messages": [{"role": "system", "content": "other"}]})


def test_requests_without_system_messages_or_tools_have_no_system_part() -> None:
    assert system_prompt_of({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert system_prompt_of({"prompt": "raw completion"}) is None
    tools_only = system_prompt_of({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    assert tools_only is not None and tools_only.n_messages == 0


def test_a_text_and_image_message_has_no_instruction_blocks() -> None:
    body = {"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    part = system_prompt_of(body)
    assert part is not None and part.instructions == ()


def test_the_warm_up_evaluates_only_the_system_part() -> None:
    body = {"messages": [SYSTEM, {"role": "user", "content": "hi"}], "tools": TOOLS}
    part = system_prompt_of(body)
    assert part is not None
    warm = part.warmup_body(3)
    assert warm["max_tokens"] == 0 and warm["id_slot"] == 3 and warm["cache_prompt"] is True
    assert warm["messages"] == [SYSTEM, {"role": "user", "content": ""}] and warm["tools"] == TOOLS
    assert part.warmup_body(0, progress=True)["return_progress"] is True
    # The warm-up's chain shares the system message with the conversation's.
    assert common_messages(part.chain(), message_chain(body["messages"], body["tools"])) == 1


def test_the_warm_up_prompt_is_what_every_conversation_on_the_system_part_starts_with() -> None:
    from slotkeeper.cache.systemprompt import common_prefix_text, warmup_prompt_body

    part = system_prompt_of({"messages": [SYSTEM, {"role": "user", "content": "hi"}], "tools": TOOLS})
    assert part is not None
    a, b = part.template_body("a"), part.template_body("b")
    assert a["messages"] == [SYSTEM, {"role": "user", "content": "a"}] and a["tools"] == TOOLS
    assert b["messages"][-1] == {"role": "user", "content": "b"}
    rendered = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
    assert common_prefix_text(rendered + "a<|im_end|>\n", rendered + "b<|im_end|>\n") == rendered
    assert common_prefix_text("abc", "xyz") == ""
    body = warmup_prompt_body(rendered, 2)
    assert body == {"prompt": rendered, "n_predict": 0, "id_slot": 2, "cache_prompt": True, "stream": False}
    assert warmup_prompt_body(rendered, 0, progress=True)["return_progress"] is True


def test_instruction_blocks_stay_in_the_warm_up_prompt() -> None:
    blocks = [{"type": "text", "text": "<system-reminder>r</system-reminder>"}, {"type": "text", "text": "ask"}]
    part = system_prompt_of({"messages": [SYSTEM, {"role": "user", "content": blocks}]})
    assert part is not None
    assert part.template_body("a")["messages"][-1]["content"] == [blocks[0], {"type": "text", "text": "a"}]
