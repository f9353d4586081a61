"""A model is served exactly or not at all: a check run once when a generation model loads.

The engine drives a Hugging Face causal LM in ways `generate` never does (rows right-aligned in a
shared preallocated cache, explicit 4D masks and position ids, rows joining mid-batch). Most
architectures accept that; some do not (recurrent or linear-attention layers, caches of their own,
masks built another way) and would raise or, worse, return wrong tokens. So before serving, a
scratch engine runs short sequences of different lengths (padding), a row that joins after others
have decoded (a late joiner over a moved cache), and decode steps; at every step each row's
next-token logits must equal the model's own forward over the whole sequence, within the dtype's
tolerance. Anything else refuses the model with a clear error.

A second check decides whether a long prompt's chunks may ride in the decode step's forward
(`gpu_worker.fused_step`): a scratch engine runs fused steps (rows decoding, a prompt arriving in
chunks) and compares the same way. A model that fails it is still served, its chunks as forwards of
their own.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from gpu_worker.engine import GenerationEngine
from gpu_worker.kv_cache import text_config
from gpu_worker.sequences import GenSpec
from shared.errors import ConfigError

log = structlog.get_logger(__name__)

PROMPTS = ((5, 17, 2, 9, 11), (3, 8, 13, 21, 34, 55, 89, 144, 233, 377, 10, 20, 30))
LATE_PROMPT = (7, 1, 4)
STEPS = 6
# max |delta logit| allowed, relative to the largest reference logit (batched kernels differ a little)
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 5e-2
CHUNKED_PROMPT_LEN, CHECK_CHUNK = 20, 6  # the fused check's prompt, arriving in chunks of this many tokens


def verify_exact(model: Any, name: str) -> bool:
    """Raise `ConfigError` unless the engine reproduces the model's own logits step by step. Returns whether
    chunks of a long prompt may be fused into decode steps (`fused_exact`)."""
    vocab = text_config(model).vocab_size
    prompts = [tuple(t % vocab for t in p) for p in PROMPTS]
    late = tuple(t % vocab for t in LATE_PROMPT)
    try:
        engine = GenerationEngine(model, max_rows=3, max_seq_len=64, keep_logits=True)
        specs = [GenSpec(id=f"check-{i}", prompt_ids=p, max_new_tokens=STEPS + 4) for i, p in enumerate(prompts)]
        engine.prefill(specs)
        _compare(model, engine, name, "prefill")
        for step in range(STEPS):
            if step == 2:
                engine.prefill([GenSpec(id="check-late", prompt_ids=late, max_new_tokens=STEPS)])
                _compare(model, engine, name, "a late joiner's prefill", rows=[len(engine.rows) - 1])
            engine.step()
            _compare(model, engine, name, f"decode step {step + 1}")
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"model {name}: the engine cannot drive this architecture ({type(exc).__name__}: {exc}); "
                          "refusing to serve it") from exc
    return fused_exact(model, name)


def fused_exact(model: Any, name: str) -> bool:
    """Whether fused steps (rows decoding, a prompt arriving in chunks in the same forwards) give the model's own
    logits for every row and for the prompt once it joins."""
    vocab = text_config(model).vocab_size
    try:
        engine = GenerationEngine(model, max_rows=4, max_seq_len=64, keep_logits=True, fused=True)
        engine.prefill([GenSpec(id=f"fused-{i}", prompt_ids=tuple(t % vocab for t in p), max_new_tokens=STEPS + 8)
                        for i, p in enumerate(PROMPTS)])
        engine.step()
        chunked = tuple((7 * k + 3) % vocab for k in range(CHUNKED_PROMPT_LEN))
        engine.prefill_in_chunks(GenSpec(id="fused-chunked", prompt_ids=chunked, max_new_tokens=STEPS))
        for step in range(CHUNKED_PROMPT_LEN // CHECK_CHUNK + 3):
            engine.step(CHECK_CHUNK)
            _compare(model, engine, name, f"fused step {step + 1}")
        if engine.chunked.current is not None or len(engine.rows) != len(PROMPTS) + 1:
            raise ConfigError(f"model {name}: the chunked prompt did not join the batch")
    except Exception as exc:
        log.info("a long prompt's chunks will run as forwards of their own (fused steps are not exact for this "
                 "model)", model=name, reason=f"{type(exc).__name__}: {exc}"[:300])
        return False
    return True


@torch.inference_mode()
def _compare(model: Any, engine: GenerationEngine, name: str, where: str, rows: list[int] | None = None) -> None:
    device = next(model.parameters()).device
    for i in rows if rows is not None else range(len(engine.rows)):
        row = engine.rows[i]
        got = engine.last_logits.get(row.spec.id)
        if got is None:
            raise ConfigError(f"model {name}: no logits for a row after {where}")
        seq = torch.tensor([[*row.spec.prompt_ids, *row.tokens[:-1]]], device=device)
        want = model(input_ids=seq).logits[0, -1].float()
        scale = max(1.0, want.abs().max().item())
        tol = TOLERANCE.get(got.dtype, HALF_TOLERANCE)
        delta = (got.float() - want).abs().max().item()
        if delta > tol * scale:
            raise ConfigError(f"model {name}: the engine's logits differ from the model's own by {delta:.3g} at "
                              f"{where} (tolerance {tol * scale:.3g}); it cannot serve this architecture exactly")
