"""Every `finish_reason` a result can carry (embeddings' `done` included) is in the OpenAPI document and
in the README's API section."""

from __future__ import annotations

from pathlib import Path

from gateway.openapi import document
from shared.config import Settings
from shared.states import FinishReason

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_finish_reason_is_in_the_openapi_document_and_the_readme():
    schema = document(Settings.from_environ({}))["components"]["schemas"]["FinishReason"]
    assert set(schema["enum"]) == {r.value for r in FinishReason}
    text = README.read_text()
    api = text[text.index("## HTTP API"):text.index("## How a request flows")]
    for reason in FinishReason:
        assert f"`{reason.value}`" in api, f"finish_reason {reason.value!r} is not documented in the README"
