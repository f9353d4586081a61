"""The control tokens a model writes its tool calls with, kept in the text of a request that offers tools.

Decoding drops special tokens (EOS, chat markers), as callers expect. But some families mark their calls with
special tokens: Mistral's `[TOOL_CALLS]` before each call and, from its v11 tokenizers, `[ARGS]` between the name
and the arguments; Hermes 2 Pro's `<tool_call>` tags (Qwen's are text); Llama 3's `<|python_tag|>`. Dropped,
`[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}` would reach the gateway as `get_weather{"city": "Paris"}`, which no
parser can tell from text. So for a request that offers tools to a model whose file names such a format
(`shared.tool_call_formats.kept_tokens`), those tokens are spelled out and every other special token is still dropped
(vLLM instead keeps every special token for such requests). A request without tools decodes as before.
"""

from __future__ import annotations

from typing import Any


def special_ids(tokenizer: Any, names: tuple[str, ...]) -> dict[int, str]:
    """{id: text} of those of `names` that `tokenizer` drops as special tokens (the others are text already):
    the added tokens marked special, or named among its special tokens."""
    named = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}  # {id: AddedToken}
    return {i: str(t) for i, t in added.items() if str(t) in names and (getattr(t, "special", False) or i in named)}


def decode_keeping(tokenizer: Any, ids: list[int], kept: dict[int, str]) -> str:
    """`ids` as text, special tokens dropped except those in `kept`, spelled out where they stand; the stretches
    between them decoded each on its own (a SentencePiece decoder drops a stretch's leading space, as it does the
    text's)."""
    out: list[str] = []
    start = 0
    for i, token_id in enumerate(ids):
        if token_id in kept:
            out.append(tokenizer.decode(ids[start:i], skip_special_tokens=True))
            out.append(kept[token_id])
            start = i + 1
    out.append(tokenizer.decode(ids[start:], skip_special_tokens=True))
    return "".join(out)
