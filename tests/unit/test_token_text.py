"""A token's text alone (`gpu_worker.token_text`), as log probabilities name it: from the tokenizer's pieces, so a
SentencePiece token keeps its leading space and a token holding part of a character keeps its bytes."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from gpu_worker.token_text import TokenText, decoder_kind


class Fast:
    """What `TokenText` reads of a transformers fast tokenizer, over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer, special: tuple[int, ...] = ()) -> None:
        self.backend_tokenizer = tok
        self.all_special_ids = list(special)

    def convert_ids_to_tokens(self, i: int) -> str | None:
        return self.backend_tokenizer.id_to_token(i)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def sentencepiece() -> Any:
    """A Llama 2 style tokenizer: `▁` for spaces, byte fallback, the first token's space stripped on decode."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    pieces = ["▁", "H", "e", "l", "o", "w", "r", "d", "▁H", "▁He", "▁Hel", "▁Hell", "▁Hello", "▁w", "▁wo", "▁wor",
              "▁worl", "▁world"]
    vocab |= {p: 259 + i for i, p in enumerate(pieces)}
    merges = [("▁", "H"), ("▁H", "e"), ("▁He", "l"), ("▁Hel", "l"), ("▁Hell", "o"), ("▁", "w"), ("▁w", "o"),
              ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Fast(tok, special=(1, 2))


def byte_level() -> Any:
    tok = Tokenizer(models.BPE({chr(c): i for i, c in enumerate(range(33, 127))} | {"Ġ": 94, "Ã": 95, "©": 96,
                                                                                     "Ġh": 97}, [("Ġ", "h")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Fast(tok)


def test_sentencepiece_tokens_keep_their_leading_space_and_their_bytes():
    fast = sentencepiece()
    text = TokenText(fast)
    assert text.kind == "sentencepiece"
    hello, world = fast.backend_tokenizer.encode("Hello world").ids
    assert fast.decode([world]) == "world"  # decoded alone, the space is gone
    assert text(hello) == (" Hello", None) and text(world) == (" world", None)
    e_acute = fast.backend_tokenizer.encode("é").ids  # no piece: two byte tokens
    assert [text(i) for i in e_acute[-2:]] == [("\ufffd", [0xC3]), ("\ufffd", [0xA9])]
    assert text(2) == ("", None)  # a special token spells nothing, as in the output's text


def test_byte_level_tokens_map_each_character_to_a_byte():
    fast = byte_level()
    text = TokenText(fast)
    assert text.kind == "byte_level"
    assert text(97) == (" h", None) and text(0) == ("!", None)
    assert text(95) == ("\ufffd", [0xC3])  # `Ã` stands for byte 0xC3: half of a character


def test_other_tokenizers_decode_the_token_alone():
    fast = byte_level()
    fast.backend_tokenizer.decoder = decoders.WordPiece()
    assert decoder_kind(fast) == "other" and TokenText(fast)(0) == ("!", None)
    assert decoder_kind(object()) == "other"
