"""The official `ollama` Python client (0.6.3) against slotkeeper on a real llama-server: every call it makes parses
into its own pydantic models, and errors arrive as its ResponseError."""

from __future__ import annotations

import uuid
from datetime import datetime

import ollama
import pytest

from tests.support import Slotkeeper, turn_log, wait_until, words

pytestmark = pytest.mark.backend

MODEL = "tiny"
GREEDY = {"num_predict": 4, "temperature": 0}


def client_for(keeper: Slotkeeper, session: str | None = None) -> ollama.Client:
    headers = {"X-Session-Id": session or f"client-{uuid.uuid4().hex[:10]}"}
    return ollama.Client(host=keeper.url, headers=headers, timeout=120)


def test_list(keeper: Slotkeeper) -> None:
    [model] = client_for(keeper).list().models
    assert model.model == "tiny:latest"
    assert isinstance(model.modified_at, datetime) and model.size and model.size > 0
    assert model.details is not None and model.details.format == "gguf"


@pytest.mark.parametrize("name", ["tiny", "tiny:latest"])
def test_show(keeper: Slotkeeper, name: str) -> None:
    shown = client_for(keeper).show(name)
    assert shown.modelinfo is not None and shown.modelinfo["llama.context_length"] == 8192
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.parameters is not None and "num_ctx 8192" in shown.parameters
    assert isinstance(shown.template, str) and isinstance(shown.modified_at, datetime)


def test_ps(keeper: Slotkeeper) -> None:
    [running] = client_for(keeper).ps().models
    assert running.model == "tiny:latest" and running.context_length == 8192
    assert isinstance(running.expires_at, datetime)


def test_chat(keeper: Slotkeeper) -> None:
    answer = client_for(keeper).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options=GREEDY)
    assert answer.done and answer.done_reason == "length"
    assert answer.message.role == "assistant" and isinstance(answer.message.content, str)
    assert answer.eval_count == 4 and answer.prompt_eval_count and answer.prompt_eval_count > 0
    assert answer.total_duration and answer.eval_duration is not None


def test_chat_stream(keeper: Slotkeeper) -> None:
    parts = list(client_for(keeper).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 4
    assert all(p.model == MODEL for p in parts)


def test_generate(keeper: Slotkeeper) -> None:
    answer = client_for(keeper).generate(model=MODEL, prompt="Once", system="Tell a story", options=GREEDY)
    assert answer.done and answer.eval_count == 4 and isinstance(answer.response, str)


def test_generate_stream(keeper: Slotkeeper) -> None:
    parts = list(client_for(keeper).generate(model=MODEL, prompt="Once", options=GREEDY, stream=True))
    assert parts[-1].done and parts[-1].eval_count == 4
    assert not any(p.done for p in parts[:-1])


def test_generate_raw(keeper: Slotkeeper) -> None:
    answer = client_for(keeper).generate(model=MODEL, prompt="abc", raw=True, options=GREEDY)
    assert answer.done and answer.context is None


def test_chat_with_tools_and_a_tool_result(keeper: Slotkeeper) -> None:
    def get_weather(city: str) -> str:
        """Weather for a city.

        Args:
          city: the city
        """
        return "sunny"

    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    answer = client_for(keeper).chat(model=MODEL, messages=messages, tools=[get_weather], options=GREEDY)
    assert answer.done


def test_think_false(keeper: Slotkeeper) -> None:
    answer = client_for(keeper).chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], think=False,
                                     options=GREEDY)
    assert answer.message.thinking is None


def test_load_and_unload(keeper: Slotkeeper) -> None:
    client = client_for(keeper)
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"
    assert client.generate(model=MODEL, prompt="", keep_alive=0).done_reason == "unload"


def test_pull(keeper: Slotkeeper) -> None:
    assert client_for(keeper).pull("tiny:latest").status == "success"
    assert [p.status for p in client_for(keeper).pull(MODEL, stream=True)][-1] == "success"


@pytest.mark.parametrize("call", ["chat", "generate", "show", "pull"])
def test_unknown_model_raises_response_error_404(keeper: Slotkeeper, call: str) -> None:
    client = client_for(keeper)
    with pytest.raises(ollama.ResponseError) as info:
        if call == "chat":
            client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
        elif call == "generate":
            client.generate(model="nope", prompt="hi")
        elif call == "show":
            client.show("nope")
        else:
            client.pull("nope")
    assert info.value.status_code == 404 and "nope" in info.value.error


def test_unknown_model_while_streaming_raises_too(keeper: Slotkeeper) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        list(client_for(keeper).chat(model="nope", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert info.value.status_code == 404 and info.value.error == "model 'nope' not found"


@pytest.mark.parametrize("call", ["delete", "copy", "push", "embed", "embeddings"])
def test_unsupported_calls_raise_response_error(keeper: Slotkeeper, call: str) -> None:
    client = client_for(keeper)
    with pytest.raises(ollama.ResponseError) as info:
        if call == "delete":
            client.delete(MODEL)
        elif call == "copy":
            client.copy(MODEL, "other")
        elif call == "push":
            client.push(MODEL)
        elif call == "embed":
            client.embed(model=MODEL, input="hello")
        else:
            client.embeddings(model=MODEL, prompt="hello")
    assert info.value.status_code == 501


def test_context_overflow_raises_response_error_400(keeper: Slotkeeper) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client_for(keeper).chat(model=MODEL, messages=[{"role": "user", "content": words(20000, 1)}])
    assert info.value.status_code == 400 and "context" in info.value.error


def test_session_header_reuses_the_cache_across_turns(keeper: Slotkeeper) -> None:
    session = f"client-reuse-{uuid.uuid4().hex[:8]}"
    client = client_for(keeper, session)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": words(400, 2)}]
    first = client.chat(model=MODEL, messages=messages, options=GREEDY)
    messages += [{"role": "assistant", "content": first.message.content or ""},
                 {"role": "user", "content": words(30, 3)}]
    second = client.chat(model=MODEL, messages=messages, options=GREEDY)
    assert first.prompt_eval_count is not None and second.prompt_eval_count is not None
    assert second.prompt_eval_count > first.prompt_eval_count  # the whole prompt, cached part included
    assert wait_until(lambda: len(turn_log(keeper, session)) == 2)
    turn2 = turn_log(keeper, session)[1]
    assert turn2["cache"] == "hot"
    assert int(turn2["cache_n"]) >= first.prompt_eval_count - 1
