"""The Anthropic dialect: /v1/messages translated to and from the backend's /v1/chat/completions.

Pure: request models and functions read parsed values and return new ones; the stream encoder is a state machine
over already-parsed upstream events. No I/O, no clock, no randomness (ids are handed in). A reader's path:
requests.py (what clients send) -> translate.py (the backend's body) -> answers.py (a whole message) or stream.py
(the SSE events).
"""

from slotkeeper.dialects.anthropic.answers import Usage, error_body, stop_reason, to_message, tool_input, usage_from
from slotkeeper.dialects.anthropic.claudecode import is_side_request, session_from_user_id, without_attribution
from slotkeeper.dialects.anthropic.requests import (
    Base64Source,
    ContentBlock,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    Metadata,
    PlainTextSource,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingConfig,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    UrlSource,
    describe_validation_error,
    parse_count_tokens_request,
    parse_messages_request,
)
from slotkeeper.dialects.anthropic.stream import MessageStreamEncoder, error_event, sse, upstream_error
from slotkeeper.dialects.anthropic.translate import (
    PASSTHROUGH_FIELDS,
    chat_body,
    chat_messages,
    chat_tools,
    count_tokens_body,
    metadata_user_id,
    system_texts,
)

__all__ = [
    "PASSTHROUGH_FIELDS",
    "Base64Source",
    "ContentBlock",
    "CountTokensRequest",
    "DocumentBlock",
    "ImageBlock",
    "InputMessage",
    "MessageStreamEncoder",
    "MessagesRequest",
    "Metadata",
    "PlainTextSource",
    "RedactedThinkingBlock",
    "TextBlock",
    "ThinkingBlock",
    "ThinkingConfig",
    "Tool",
    "ToolChoice",
    "ToolResultBlock",
    "ToolUseBlock",
    "UrlSource",
    "Usage",
    "chat_body",
    "chat_messages",
    "chat_tools",
    "count_tokens_body",
    "describe_validation_error",
    "error_body",
    "error_event",
    "is_side_request",
    "metadata_user_id",
    "parse_count_tokens_request",
    "parse_messages_request",
    "session_from_user_id",
    "sse",
    "stop_reason",
    "system_texts",
    "to_message",
    "tool_input",
    "upstream_error",
    "usage_from",
    "without_attribution",
]
