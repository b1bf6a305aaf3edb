"""A slot's state cut back to its system part, and a request's tokens: the two things the pool asks the backend to
render with its own chat template.

- The system part's text is what every conversation on it starts with: the backend renders the system part followed
  by a user message twice, with two different texts, and the common prefix of the two renderings ends where the
  user message's own text begins. Evaluated into a slot that holds a conversation on that system part (a
  `/completion` of that text that generates nothing), the backend keeps what the slot shares with it and drops the
  rest: a dense model's cache is cut for the cost of one token, a recurrent or hybrid model's rolls back to its
  checkpoint at the start of the first user message. The slot then holds exactly the system part, which is saved as
  a state of its own. A pre-warm (an operator's) evaluates the same text into an empty slot.
- A request's tokens are its rendering (`/apply-template`) tokenized as llama-server tokenizes a chat prompt
  (`/tokenize` with special tokens added and parsed): the ground truth the planner compares saved states with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from slotkeeper.cache.systemprompt import SystemPrompt, common_prefix_text, warmup_prompt_body
from slotkeeper.cache.tokens import Tokens, as_tokens
from slotkeeper.errors import SlotkeeperError
from slotkeeper.upstream.client import UpstreamClient

log = logging.getLogger("slotkeeper.pool")

# Fields of a chat body that change its rendering (the rest are sampling and output fields).
_TEMPLATE_FIELDS = ("messages", "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                    "reasoning_format", "enable_thinking", "chat_template")


async def system_prefix(client: UpstreamClient, system: SystemPrompt) -> str | None:
    """The rendered text every conversation on `system` starts with, from the backend's own chat template; None
    when the backend cannot render it (no /apply-template)."""
    try:
        first, second = await asyncio.gather(client.post_json("/apply-template", system.template_body("a")),
                                             client.post_json("/apply-template", system.template_body("b")))
    except SlotkeeperError as exc:
        log.debug("no /apply-template on the backend (%s)", exc.message)
        return None
    texts = [r.get("prompt") if isinstance(r, dict) else None for r in (first, second)]
    if not isinstance(texts[0], str) or not isinstance(texts[1], str):
        return None
    return common_prefix_text(texts[0], texts[1]) or None


async def cut_to(client: UpstreamClient, slot_id: int, prefix: str) -> int:
    """Evaluate `prefix` into the slot without generating: the slot keeps what it shares with it and drops the
    rest. Returns the tokens the slot holds then. Raises the backend's error."""
    data = await client.post_json("/completion", warmup_prompt_body(prefix, slot_id))
    timings = data.get("timings") if isinstance(data, dict) else None
    if not isinstance(timings, dict):
        raise SlotkeeperError("the backend answered the cut without timings")
    return int(timings.get("cache_n") or 0) + int(timings.get("prompt_n") or 0)


async def request_tokens(client: UpstreamClient, chat: Mapping[str, Any]) -> Tokens | None:
    """The tokens of a chat request's prompt as the backend renders and tokenizes it, or None when it cannot say
    (a failure is no reason to fail the request: the planner then decides by the message chains)."""
    body = {k: chat[k] for k in _TEMPLATE_FIELDS if k in chat}
    try:
        rendered = await client.post_json("/apply-template", body)
        prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
        if not isinstance(prompt, str):
            return None
        tokenized = await client.post_json("/tokenize", {"content": prompt, "add_special": True,
                                                          "parse_special": True})
    except SlotkeeperError as exc:
        log.debug("the backend could not render or tokenize the request (%s): deciding by the chains", exc.message)
        return None
    tokens = tokenized.get("tokens") if isinstance(tokenized, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return None
    return as_tokens(tokens)
