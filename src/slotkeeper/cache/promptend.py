"""The prompt-end step: bring a slot back to exactly its last prompt before it is saved.

On a llama.cpp build that does not keep context checkpoints in slot files, a restored recurrent or hybrid state can
only be extended, never rolled back. A slot holds its last prompt plus what was generated, and the next turn sends
back another answer (a reasoning model's client drops the thinking), so a save of that slot is useless after a
restore. Sending the last request again without generating makes the backend roll the live slot back to its
checkpoint just before the prompt's end (it keeps those in RAM) and evaluate the last few tokens: the slot then holds
exactly the prompt, which the next turn extends whatever the client did with the answer. Measured costs are in
docs/architectures.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The request that last ran in a slot: the backend path and its JSON body.
Replay = tuple[str, Mapping[str, Any]]

# Fields that ask for output or change how it is sent; the step wants none.
_OUTPUT_FIELDS = frozenset({
    "stream", "stream_options", "logprobs", "top_logprobs", "n_probs", "max_completion_tokens", "n_predict",
    "max_tokens", "n", "return_progress", "post_sampling_probs", "timings_per_token", "response_fields",
})


def replay_body(path: str, body: Mapping[str, Any], slot_id: int) -> dict[str, Any]:
    """`body` again, for slot `slot_id`, evaluating the prompt into the cache and generating nothing."""
    out = {k: v for k, v in body.items() if k not in _OUTPUT_FIELDS}
    out["id_slot"] = slot_id
    out["cache_prompt"] = True
    out["stream"] = False
    if path.rstrip("/").endswith(("/completion", "/completions", "/infill")) and "messages" not in body:
        out["n_predict"] = 0
    else:
        out["max_tokens"] = 0
    return out
