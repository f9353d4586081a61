"""Log probabilities in OpenAI's shapes, from the native output's entries (`output.logprobs`, a stream delta's
`logprobs`: `{token_id, token, logprob, top_logprobs: [{token_id, token, logprob}]}` per output token).

- chat completions: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
  "refusal": null}`, `bytes` the token's UTF-8;
- completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, each token's
  alternatives with the token itself among them (as vLLM answers), `text_offset` each token's place in the text
  (from `chars`, the characters before the first: a stream's chunks go on from the text already sent).

An entry whose `logprob` is null is a prompt's first token (completions' `echo`: its `token_logprobs` and
`top_logprobs` are null, as OpenAI's); chat's shape has no place for one, and leaves it out.

With vLLM's `return_tokens_as_token_ids` (`as_ids`), each token (and alternative) is named `token_id:N`, its id,
with that name's bytes, so that a token whose text is not whole (part of a character) is known exactly; a
completion's `text_offset` still counts the text's characters.
"""

from __future__ import annotations

from typing import Any, Literal


def _bytes(entry: dict[str, Any]) -> list[int]:
    """The token's UTF-8: the entry's own `bytes` where its text cannot hold them (part of a character)."""
    return list(entry["bytes"]) if entry.get("bytes") is not None else list(str(entry["token"]).encode("utf-8"))


def _as_id(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry named by its token id (vLLM's `token_id:N`), its alternatives alike."""
    named = {**entry, "token": f"token_id:{entry['token_id']}", "bytes": None}
    if entry.get("top_logprobs") is not None:
        named["top_logprobs"] = [_as_id(t) for t in entry["top_logprobs"]]
    return named


def chat_logprobs(entries: list[Any] | None, as_ids: bool = False) -> dict[str, Any]:
    if as_ids:
        entries = [_as_id(e) for e in entries or ()]
    content = [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e),
                "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t)}
                                 for t in e["top_logprobs"]]}
               for e in entries or () if e["logprob"] is not None]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[Any] | None, chars: int = 0, as_ids: bool = False) -> dict[str, Any]:
    known = list(entries or ())
    offsets, at = [], chars
    for e in known:
        offsets.append(at)
        at += len(e["token"])
    if as_ids:
        known = [_as_id(e) for e in known]
    return {"tokens": [e["token"] for e in known], "token_logprobs": [e["logprob"] for e in known],
            "top_logprobs": [None if e["logprob"] is None else
                             {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                             for e in known],
            "text_offset": offsets}


def openai_logprobs(kind: Literal["chat", "completion"], entries: list[Any] | None,
                    chars: int = 0, as_ids: bool = False) -> dict[str, Any]:
    return chat_logprobs(entries, as_ids) if kind == "chat" else completion_logprobs(entries, chars, as_ids)
