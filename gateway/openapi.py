"""The OpenAPI 3.1 document of the HTTP API, served at /openapi.json (and as a page at /docs).

The paths are written here; every body schema is generated from the schema types (`shared.submit` for
what callers send, `shared.views` for what they get back), the same types the gateway checks and answers with.

Kept true by the schemathesis fuzz test (tests/integration/test_openapi_fuzz.py): every operation is
called with generated inputs and every response must match what is declared here.
"""

from __future__ import annotations

import html
import json
from typing import Any

import msgspec

from shared.config import Settings
from shared.idempotency_keys import KEY_PATTERN, MAX_KEY_CHARS
from shared.openai_responses import ResponseRequest
from shared.openai_shapes import ChatRequest, CompletionRequest, EmbeddingRequest
from shared.submit import EmbedSubmit, GenerateSubmit
from shared.views import Accepted, ErrorBody, RequestView

REF = "#/components/schemas/{name}"
ERROR = {"$ref": REF.format(name="ErrorBody")}


def _err(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": ERROR}}}


UNAUTHORIZED = "Missing, invalid or revoked API key, or a scheme other than Bearer (WWW-Authenticate says so)"
COMMON_ERRORS = {
    "400": _err("Malformed body or query"),
    "401": _err(UNAUTHORIZED),
    "404": _err("Unknown model or request (or another tenant's)"),
    "503": _err("Redis unreachable; retry after Retry-After"),
}


BODY_TIMEOUT = {**_err("The body did not arrive within the server's body timeout (connection closed)"),
                "headers": {"Connection": {"schema": {"type": "string", "enum": ["close"]}}}}


def _json(schema: dict[str, Any], desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": schema}}}


def components() -> dict[str, Any]:
    """The schemas, generated from the types the gateway validates with and answers with."""
    _, schemas = msgspec.json.schema_components([GenerateSubmit, EmbedSubmit, RequestView, Accepted, ErrorBody,
                                                 CompletionRequest, ChatRequest, EmbeddingRequest, ResponseRequest],
                                                ref_template=REF)
    return {**schemas, **OPENAI_SCHEMAS}


# The OpenAI-compatible routes (gateway/openai_api.py, docs/openai.md): OpenAI's response shapes. Their
# errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`; one the route never reached
# (a missing API key, a body too large or too slow) is the native `ErrorBody`, which this schema admits too.
_NULLABLE_STR = {"type": ["string", "null"]}
_USAGE = {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"}}}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", None]}


def _completion_schema(obj: str, chat: bool) -> dict[str, Any]:
    answer = ({"message": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": _NULLABLE_STR}}} if chat else {"text": {"type": "string"}})
    choice = {"type": "object", "required": ["index", "finish_reason", *answer],
              "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH, **answer}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": choice}, "usage": _USAGE,
        "batchgate": {"type": "object", "description": "the native request id, status and finish_reason"}}}


OPENAI_SCHEMAS: dict[str, Any] = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"}, "param": _NULLABLE_STR,
            "code": _NULLABLE_STR}}}},
    "Completion": _completion_schema("text_completion", chat=False),
    "ChatCompletion": _completion_schema("chat.completion", chat=True),
    "Response": {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
                 "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete"]}, "model": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"], "properties": {
            "type": {"enum": ["message", "function_call"]}, "id": {"type": "string"}}}},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"], "properties": {
            "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"}}},
        "batchgate": {"type": "object", "description": "the native request id, status and finish_reason"}}},
    "EmbeddingList": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"const": "list"}, "model": {"type": "string"}, "usage": _USAGE,
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                            "properties": {
            "object": {"const": "embedding"}, "index": {"type": "integer"},
            "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}},
                                    {"type": "string", "description": "base64 of little-endian float32"}]}}}}}},
    "OpenAIModel": {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}}},
    "OpenAIFile": {"type": "object", "required": ["id", "object", "bytes", "created_at", "filename", "purpose",
                                                   "status"], "properties": {
        "id": {"type": "string"}, "object": {"const": "file"}, "bytes": {"type": "integer"},
        "created_at": {"type": "integer"}, "filename": {"type": "string"},
        "purpose": {"enum": ["batch", "batch_output"]}, "status": {"const": "processed"},
        "expires_at": {"type": ["integer", "null"]}, "status_details": _NULLABLE_STR}},
    "OpenAIFileList": {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/OpenAIFile"}},
        "has_more": {"type": "boolean"}, "first_id": _NULLABLE_STR, "last_id": _NULLABLE_STR}},
    "OpenAIFileDeleted": {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"const": "file"}, "deleted": {"const": True}}},
}


def _oa_err(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": REF.format(name="OpenAIError")}}}}


OPENAI_ERRORS = {
    "400": _oa_err("Invalid or unsupported parameter (`param` names it): native 422s are 400s here"),
    "401": _oa_err(UNAUTHORIZED),
    "404": _oa_err("Unknown model"),
    "408": {**_oa_err("The body did not arrive within the server's body timeout (connection closed)"),
            "headers": {"Connection": {"schema": {"type": "string", "enum": ["close"]}}}},
    "409": _oa_err("Cancelled while waiting, or an Idempotency-Key in use (x-should-retry says whether to retry)"),
    "413": _oa_err("Body too large"), "415": _oa_err("Unsupported content type"),
    "429": _oa_err("Over capacity, rate limit, quota, or deadline infeasible; see Retry-After and retry-after-ms"),
    "500": _oa_err("The model failed on this request (not retried: x-should-retry: false)"),
    "503": _oa_err("Redis unreachable; retry after Retry-After"),
    "504": _oa_err("No output by the deadline, or no result within the gateway's longest wait "
                   "(the request goes on: GET /v1/requests/{id})"),
}


def openai_paths() -> dict[str, Any]:
    timeout_header = {"name": "X-Batchgate-Timeout", "in": "header", "required": False,
                      "schema": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$"},
                      "description": "the request's deadline in seconds from now (the body's timeout_s wins)"}
    idem_header = {"name": "Idempotency-Key", "in": "header", "required": False,
                   "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_CHARS, "pattern": KEY_PATTERN}}
    stream = {"text/event-stream": {"schema": {
        "type": "string", "description": "with stream: true, chunks as `data: {json}` lines, then `data: [DONE]`"}}}

    def post(op: str, summary: str, body: str, answer: str, streams: bool) -> dict[str, Any]:
        content = {"application/json": {"schema": {"$ref": REF.format(name=answer)}}, **(stream if streams else {})}
        return {"post": {
            "operationId": op, "summary": summary, "tags": ["openai"], "parameters": [timeout_header, idem_header],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "$ref": REF.format(name=body)}}}},
            "responses": {"200": {"description": "The result (OpenAI's shape)", "content": content},
                          **OPENAI_ERRORS}}}

    return {
        "/v1/completions": post("openaiCompletions", "OpenAI-compatible completion", "CompletionRequest",
                                "Completion", streams=True),
        "/v1/chat/completions": post("openaiChatCompletions", "OpenAI-compatible chat completion", "ChatRequest",
                                     "ChatCompletion", streams=True),
        "/v1/responses": post("openaiResponses", "OpenAI-compatible response (the Responses API, served as a chat "
                              "completion; stream: typed events)", "ResponseRequest", "Response", streams=True),
        "/v1/embeddings": post("openaiEmbeddings", "OpenAI-compatible embeddings", "EmbeddingRequest",
                               "EmbeddingList", streams=False),
        "/v1/models/{model}": {"get": {
            "operationId": "openaiRetrieveModel", "summary": "A model, in OpenAI's shape", "tags": ["openai"],
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json({"$ref": REF.format(name="OpenAIModel")}, "The model"),
                          **{k: OPENAI_ERRORS[k] for k in ("401", "404", "503")}}}},
    }


def batches_paths() -> dict[str, Any]:
    """The Batch API (gateway/batch_api.py, docs/batches.md): OpenAI's shapes and errors."""
    batch_id = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
    statuses = ["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                "cancelled"]
    batch = {"type": "object", "description": "OpenAI's Batch object", "required": ["id", "object", "status"],
             "properties": {"id": {"type": "string"}, "object": {"const": "batch"},
                            "status": {"type": "string", "enum": statuses}, "request_counts": {"type": "object"}}}
    create = {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
              "additionalProperties": False, "properties": {
                  "input_file_id": {"type": "string"},
                  "endpoint": {"type": "string", "description": "/v1/completions, /v1/chat/completions, "
                                                                "/v1/embeddings or /v1/models/{model}/requests"},
                  "completion_window": {"type": "string", "pattern": "^[0-9]{1,6}[smhd]$", "examples": ["24h"]},
                  "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
                  "callback_url": {"type": "string", "format": "uri",
                                   "description": "batchgate's own: a signed webhook with the batch when it ends"}}}
    found = {k: OPENAI_ERRORS[k] for k in ("401", "404", "503")}
    return {
        "/v1/batches": {
            "post": {"operationId": "openaiCreateBatch", "summary": "Create a batch from an uploaded file",
                     "tags": ["openai"],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": create}}},
                     "responses": {"200": _json(batch, "The batch (validating)"),
                                   "400": _oa_err("An invalid field (named in `param`)"),
                                   **{k: OPENAI_ERRORS[k] for k in ("401", "404", "408", "413", "415", "503")}}},
            "get": {"operationId": "openaiListBatches", "summary": "The caller's batches, newest first",
                    "tags": ["openai"], "parameters": [
                        {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": 100}}],
                    "responses": {"200": _json({"type": "object", "required": ["data"]}, "A page of batches"),
                                  **{k: OPENAI_ERRORS[k] for k in ("400", "401", "503")}}},
        },
        "/v1/batches/{batch_id}": {"get": {
            "operationId": "openaiRetrieveBatch", "summary": "A batch", "tags": ["openai"], "parameters": [batch_id],
            "responses": {"200": _json(batch, "The batch"), **found}}},
        "/v1/batches/{batch_id}/cancel": {"post": {
            "operationId": "openaiCancelBatch", "summary": "Stop feeding; finalize what finished", "tags": ["openai"],
            "parameters": [batch_id],
            "responses": {"200": _json(batch, "The batch (cancelling)"),
                          "409": _oa_err("The batch already ended"), **found}}},
    }


def files_paths() -> dict[str, Any]:
    """The Files API (gateway/files_api.py, docs/batches.md): OpenAI's shapes and errors."""
    file_id = {"name": "file_id", "in": "path", "required": True,
               "schema": {"type": "string", "pattern": "^file-[a-z2-7]{26}$"}}
    file = {"$ref": REF.format(name="OpenAIFile")}
    found = {k: OPENAI_ERRORS[k] for k in ("401", "404", "503")}
    upload = {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "JSON Lines: one JSON object per line (UTF-8), no empty line"},
        "purpose": {"type": "string", "enum": ["batch"]}}}
    return {
        "/v1/files": {
            "post": {"operationId": "openaiCreateFile", "summary": "Upload a batch input file (streamed)",
                     "tags": ["openai"],
                     "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": upload}}},
                     "responses": {"200": _json(file, "The stored file"),
                                   "400": _oa_err("Not multipart, a missing or unsupported field, or a line "
                                                  "that is not a JSON object (the message names it)"),
                                   **{k: OPENAI_ERRORS[k] for k in ("401", "408", "415", "503")},
                                   "413": _oa_err("The file is larger than BATCHGATE_MAX_FILE_BYTES")}},
            "get": {"operationId": "openaiListFiles", "summary": "The caller's files, newest first by default",
                    "tags": ["openai"], "parameters": [
                        {"name": "after", "in": "query", "required": False,
                         "schema": {"type": "string", "pattern": "^file-[a-z2-7]{26}$"}},
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                        {"name": "order", "in": "query", "required": False,
                         "schema": {"type": "string", "enum": ["asc", "desc"]}},
                        {"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}}],
                    "responses": {"200": _json({"$ref": REF.format(name="OpenAIFileList")}, "A page of files"),
                                  **{k: OPENAI_ERRORS[k] for k in ("400", "401", "503")}}},
        },
        "/v1/files/{file_id}": {
            "get": {"operationId": "openaiRetrieveFile", "summary": "A file", "tags": ["openai"],
                    "parameters": [file_id], "responses": {"200": _json(file, "The file"), **found}},
            "delete": {"operationId": "openaiDeleteFile", "summary": "Delete a file", "tags": ["openai"],
                       "parameters": [file_id],
                       "responses": {"200": _json({"$ref": REF.format(name="OpenAIFileDeleted")}, "Deleted"),
                                     **found}},
        },
        "/v1/files/{file_id}/content": {"get": {
            "operationId": "openaiFileContent", "summary": "A file's bytes (streamed)", "tags": ["openai"],
            "parameters": [file_id],
            "responses": {"200": {"description": "The file as uploaded (or as batchgate wrote it)",
                                  "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                      "format": "binary"}}}},
                          **found}}},
    }


def document(settings: Settings) -> dict[str, Any]:
    models = [m.name for m in settings.models]
    submit_body = {"description": "generate models: GenerateSubmit; embed models: EmbedSubmit",
                   "anyOf": [{"$ref": REF.format(name="GenerateSubmit")}, {"$ref": REF.format(name="EmbedSubmit")}]}
    request_view = {"$ref": REF.format(name="RequestView")}
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "enum": models}}
    id_param = {"name": "request_id", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": "^req_[a-z2-7]{26}$"}}
    wait_param = {"name": "wait", "in": "query", "required": False,
                  "schema": {"type": "number", "minimum": 0},
                  "description": "seconds to wait for the result (capped by the server)"}
    idem_header = {"name": "Idempotency-Key", "in": "header", "required": False,
                   "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_CHARS, "pattern": KEY_PATTERN}}
    security = [{"bearer": []}, {"apiKey": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "batchgate", "version": "1",
                 "description": "Serverless-friendly batching gateway for model inference."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}},
            "schemas": components(),
        },
        "security": security,
        "paths": {
            "/v1/models/{model}/requests": {"post": {
                "operationId": "submit", "summary": "Submit a request",
                "parameters": [model_param, wait_param, idem_header],
                "requestBody": {"required": True, "content": {"application/json": {"schema": submit_body}}},
                "responses": {
                    "200": {"description": "Finished within the wait (or an idempotent replay); with `stream: "
                                           "true` and `Accept: text/event-stream`, the request's events",
                            "content": {"application/json": {"schema": request_view},
                                        "text/event-stream": {"schema": {"type": "string"}}}},
                    "202": _json({"anyOf": [{"$ref": REF.format(name="Accepted")}, request_view]}, "Accepted"),
                    **COMMON_ERRORS, "408": BODY_TIMEOUT,
                    "409": _err("Idempotency-Key reused with a different body, or in progress"),
                    "413": _err("Body too large"), "415": _err("Unsupported content type"),
                    "422": _err("Invalid fields (with `field`): also text that is not valid Unicode, a prompt or "
                                "text over the model's tokens, a token id outside its vocabulary, a timeout "
                                "shorter than any request can meet"),
                    "429": _err("Over capacity, rate limit, quota, or deadline infeasible; see Retry-After"),
                }}},
            "/v1/models/{model}/requests:batch": {"post": {
                "operationId": "submitBatch", "summary": "Submit many inputs at once; one result per item",
                "parameters": [model_param],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["requests"], "additionalProperties": False, "properties": {
                        "requests": {"type": "array", "minItems": 1, "maxItems": settings.max_batch_items,
                                     "items": {"type": "object"}}}}}}},
                "responses": {
                    "200": _json({"type": "object", "required": ["results"], "properties": {
                        "results": {"type": "array", "items": {"type": "object", "required": ["index", "status"]}},
                        "accepted": {"type": "integer"}, "replayed": {"type": "integer"},
                        "refused": {"type": "integer"}}}, "Per-item outcomes"),
                    **COMMON_ERRORS, "408": BODY_TIMEOUT, "413": _err("Body too large"),
                    "415": _err("Unsupported content type"), "422": _err("Not a list of submit bodies"),
                }}},
            "/v1/requests/{request_id}": {
                "get": {"operationId": "getRequest", "summary": "Status and result (long-poll with wait)",
                        "parameters": [id_param, wait_param],
                        "responses": {"200": _json(request_view, "The request"), **COMMON_ERRORS,
                                      "410": _err("The result expired")}},
                "delete": {"operationId": "cancelRequest", "summary": "Cancel",
                           "parameters": [id_param],
                           "responses": {"200": _json(request_view, "Cancelled"), **COMMON_ERRORS,
                                         "409": _err("Already finished (cancelled included)"),
                                         "410": _err("The result expired")}},
            },
            "/v1/requests/{request_id}/events": {"get": {
                "operationId": "requestEvents",
                "summary": "Server-Sent Events: status changes, token deltas, then `done` with the result",
                "parameters": [id_param, {"name": "Last-Event-ID", "in": "header", "required": False,
                                          "schema": {"type": "string", "pattern": "^([0-9]{1,9})?$"},
                                          "description": "resume after this event (output tokens already had)"}],
                "responses": {"200": {"description": "`status` {id, status}, `delta` {index, text, token_ids}, "
                                                     "`done` (the request, as GET answers it); each event's id "
                                                     "is the output tokens sent up to it",
                                      "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                              **COMMON_ERRORS, "400": _err("Last-Event-ID is not one this API sent"),
                              "410": _err("The result expired")}}},
            "/v1/requests/{request_id}/callback:replay": {"post": {
                "operationId": "replayCallback", "summary": "Send a dead-lettered webhook again",
                "parameters": [id_param],
                "responses": {"202": _json({"type": "object"}, "Scheduled"), **COMMON_ERRORS,
                              "409": _err("Nothing to replay"), "410": _err("The result expired")}}},
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "Models, lanes, backlog, service rate, estimated wait",
                "responses": {"200": _json({"type": "object", "required": ["models"], "properties": {
                    "models": {"type": "array"}, "object": {"const": "list"},
                    "data": {"type": "array", "items": {"$ref": REF.format(name="OpenAIModel")},
                             "description": "the same models as OpenAI lists them"}}}, "Models"),
                              **COMMON_ERRORS}}},
            **openai_paths(),
            **files_paths(),
            **batches_paths(),
            "/healthz": {"get": {"operationId": "healthz", "security": [],
                                 "responses": {"200": _json({"type": "object"}, "Alive")}}},
            "/readyz": {"get": {"operationId": "readyz", "security": [],
                                "responses": {"200": _json({"type": "object"}, "Redis reachable"),
                                              "503": _err("Redis unreachable")}}},
        },
    }


def docs_page(doc: dict[str, Any]) -> str:
    """A self-contained page (no CDN): every operation, its parameters and responses."""
    rows = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = ", ".join(op["responses"])
            params = ", ".join(p["name"] for p in op.get("parameters", []))
            rows.append(f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(op.get('summary', op['operationId']))}</td><td>{html.escape(params)}</td>"
                        f"<td>{codes}</td></tr>")
    spec = html.escape(json.dumps(doc, indent=2))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>batchgate API</title><style>"
            "body{font-family:sans-serif;margin:2em}td,th{border-bottom:1px solid #ddd;padding:.3em .6em;"
            "text-align:left}pre{background:#f6f6f6;padding:1em;overflow:auto}</style></head><body>"
            "<h1>batchgate HTTP API v1</h1><p>Machine-readable: <a href='/openapi.json'>/openapi.json</a>. "
            "Authenticate with <code>Authorization: Bearer &lt;key&gt;</code> or <code>X-API-Key</code>.</p>"
            "<table><tr><th>method</th><th>path</th><th>what</th><th>parameters</th><th>responses</th></tr>"
            + "".join(rows) + f"</table><h2>Document</h2><pre>{spec}</pre></body></html>")
