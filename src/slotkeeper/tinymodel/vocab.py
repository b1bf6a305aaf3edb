"""The synthetic SentencePiece-style vocab (byte tokens, word-prefix pieces, the ChatML control tokens, the qwen3
markers and, when asked, the fill-in-the-middle tokens) and the tokenizer keys and chat template that it writes into a
GGUF file."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFWriter, Keys, TokenType

from slotkeeper.tinymodel.templates import (
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    QWEN3_TEMPLATE,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    Template,
)

_SPACE = "\u2581"  # SentencePiece's visible word-boundary marker

# The marker tokens of the qwen3 template variant. USER_DEFINED: the tokenizer matches them in any text, and output
# renders them as text on every endpoint (CONTROL ones only where the chat format preserves them; see the
# package docstring).
_QWEN3_EXTRA_TOKENS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)
_QWEN3_EXTRA_TOKEN_TYPE = TokenType.USER_DEFINED

# The fill-in-the-middle tokens (Qwen2.5-Coder's names), which llama-server's /infill needs: prefix, suffix, middle,
# then the repository and file separators it puts before each `input_extra` chunk. CONTROL tokens, each named in
# its tokenizer.ggml.fim_*_token_id key.
_FIM_TOKENS = (
    ("<|fim_prefix|>", Keys.Tokenizer.FIM_PRE_ID),
    ("<|fim_suffix|>", Keys.Tokenizer.FIM_SUF_ID),
    ("<|fim_middle|>", Keys.Tokenizer.FIM_MID_ID),
    ("<|repo_name|>", Keys.Tokenizer.FIM_REP_ID),
    ("<|file_sep|>", Keys.Tokenizer.FIM_SEP_ID),
)

# Common words; each becomes "▁word" plus every "▁" prefix of it, so SentencePiece-style bigram merging,
# which only joins pairs already in the vocab, can build the whole word one character at a time.
_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look two "
    "more write go see number no way could people my than first water been call who now find long down "
    "day did get come made may part hello hi user assistant system yes please thanks model test token "
    "slot server"
)
_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
_SINGLE_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\":;-()"


@dataclass(frozen=True)
class _Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    unk_id: int
    im_start_id: int
    im_end_id: int
    # The GGUF key and id of each fill-in-the-middle token (empty without them).
    fim_ids: tuple[tuple[str, int], ...] = ()


def _build_vocab(template: Template = "chatml", fim: bool = False) -> _Vocab:
    """Build the synthetic vocab: specials, 256 byte tokens, normal pieces, the ChatML control tokens, for the
    qwen3 template the think and tool-call markers after them (so the chatml vocab is unchanged), and with `fim` the
    fill-in-the-middle tokens last."""
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    scores: list[float] = [0.0, 0.0, 0.0]
    types: list[int] = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]

    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        scores.append(0.0)
        types.append(int(TokenType.BYTE))

    pieces: list[str] = [_SPACE]
    for word in _WORDS:
        pieces.extend(_SPACE + word[:end] for end in range(1, len(word) + 1))
    pieces.extend(_SINGLE_CHARS)
    seen: set[str] = set()
    rank = 0
    for piece in pieces:
        if piece in seen:
            continue
        seen.add(piece)
        rank += 1
        tokens.append(piece)
        scores.append(-float(rank))
        types.append(int(TokenType.NORMAL))

    im_start_id = len(tokens)
    im_end_id = im_start_id + 1
    for special in (IM_START, IM_END):
        tokens.append(special)
        scores.append(0.0)
        types.append(int(TokenType.CONTROL))

    if template == "qwen3":
        for marker in _QWEN3_EXTRA_TOKENS:
            tokens.append(marker)
            scores.append(0.0)
            types.append(int(_QWEN3_EXTRA_TOKEN_TYPE))

    fim_ids: list[tuple[str, int]] = []
    if fim:
        for text, key in _FIM_TOKENS:
            fim_ids.append((key, len(tokens)))
            tokens.append(text)
            scores.append(0.0)
            types.append(int(TokenType.CONTROL))

    return _Vocab(tokens, scores, types, bos_id=1, unk_id=0, im_start_id=im_start_id, im_end_id=im_end_id,
                  fim_ids=tuple(fim_ids))


def _add_vocab(writer: GGUFWriter, vocab: _Vocab, template: Template = "chatml") -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.im_end_id)
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_eot_token_id(vocab.im_end_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    for key, token_id in vocab.fim_ids:
        writer.add_uint32(key, token_id)
    writer.add_chat_template(QWEN3_TEMPLATE if template == "qwen3" else CHATML_TEMPLATE)
