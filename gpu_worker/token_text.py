"""A token's text alone, as log probabilities name it (OpenAI's `token`, `bytes`), from the tokenizer's own pieces.

`decode([id])` is not it: a SentencePiece tokenizer (Llama 2, Mistral, Gemma) strips the leading space of a
sequence's first token, so every word-initial token would lose its space, and a token holding part of a
multi-byte character decodes to U+FFFD with its bytes lost. The piece (`convert_ids_to_tokens`) keeps both:
- byte-level BPE (GPT-2, Llama 3, Qwen; decoder `ByteLevel`): each character of the piece stands for one byte
  (GPT-2's `bytes_to_unicode` table);
- SentencePiece (a `Metaspace` decoder, or `Replace("▁", " ")` with `ByteFallback`): `▁` is a space, `<0xNN>` a
  byte;
- any other tokenizer: `decode([id])`.
Special tokens (EOS, chat markers) spell nothing, as in the output's text. The text is the bytes decoded as UTF-8;
where they are not whole characters, the bytes come too (the text then holds U+FFFD).
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_table() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the character that stands for each byte in a byte-level piece."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def decoder_kind(tokenizer: Any) -> str:
    """`byte_level`, `sentencepiece` or `other`, from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    except (AttributeError, ValueError):
        return "other"
    parts = (decoder or {}).get("decoders") or [decoder or {}]
    types = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in types:
        return "byte_level"
    spaces = any(p.get("type") == "Replace" and (p.get("pattern") or {}).get("String") == "▁"
                 for p in parts if isinstance(p, dict))
    return "sentencepiece" if "Metaspace" in types or (spaces and "ByteFallback" in types) else "other"


class TokenText:
    """id -> (text, bytes where the text cannot hold them, else None); cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = decoder_kind(tokenizer)
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self.table = _byte_table() if self.kind == "byte_level" else {}
        self.cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        hit = self.cache.get(token_id)
        if hit is None:
            hit = self.cache[token_id] = self._text(token_id)
        return hit

    def _raw(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if self.kind == "byte_level" and all(c in self.table for c in piece):
            return bytes(self.table[c] for c in piece)
        if self.kind == "sentencepiece":
            if m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            return piece.replace("▁", " ").encode("utf-8")
        return None

    def _text(self, token_id: int) -> tuple[str, list[int] | None]:
        if token_id in self.special:
            return "", None
        raw = self._raw(token_id)
        if raw is None:
            return self.tokenizer.decode([token_id], skip_special_tokens=True), None
        try:
            return raw.decode("utf-8"), None
        except UnicodeDecodeError:
            return raw.decode("utf-8", "replace"), list(raw)
