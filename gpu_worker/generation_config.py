"""What a model's `generation_config` asks of generation, against what the engine applies.

Applied (by `gpu_worker.generate_runner`): its EOS ids, and its `repetition_penalty` where a request sets none.
Not applied, and named in a warning when the worker loads the model so that the difference from `generate()` is
never silent: the settings below that change which token `generate` picks, and its sampling defaults
(`do_sample` with `temperature`, `top_k`, `top_p`, `min_p`): a request samples as its own parameters say, as TGI
does (vLLM takes them as defaults).
"""

from __future__ import annotations

from typing import Any

import structlog

log = structlog.get_logger(__name__)

# `generation_config` settings that change which token `generate` picks and that the engine does not apply (its
# repetition_penalty, eos ids and, per request, sampling it does); "truthy" means set to more than nothing
IGNORED_GENERATION_SETTINGS = ("no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                               "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
                               "forced_eos_token_id", "sequence_bias", "exponential_decay_length_penalty",
                               "encoder_repetition_penalty", "encoder_no_repeat_ngram_size", "typical_p",
                               "epsilon_cutoff", "eta_cutoff")

SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "min_p")


def unapplied_sampling_defaults(config: Any) -> dict[str, Any]:
    """A `generation_config` that samples by default (`do_sample`): that, and the sampling values its file sets.
    Requests sample by their own parameters only (named at load, so the difference from `generate()` and from
    servers that take these as defaults is not silent)."""
    if not getattr(config, "do_sample", False):
        return {}
    given = config.to_diff_dict() if hasattr(config, "to_diff_dict") else {}
    return {"do_sample": True, **{name: given[name] for name in SAMPLING_SETTINGS if name in given}}


def ignored_generation_settings(config: Any) -> dict[str, Any]:
    """What a model's `generation_config` sets that the engine does not apply (logged at load)."""
    token_ids = ("forced_bos_token_id", "forced_eos_token_id")  # token 0 is a token
    out = {name: value for name in IGNORED_GENERATION_SETTINGS if (value := getattr(config, name, None)) is not None
           and (name in token_ids or value not in (0, 1.0, [], ()))}
    if (getattr(config, "num_beams", None) or 1) > 1:
        out["num_beams"] = config.num_beams
    return out


def warn_unapplied(model: str, config: Any) -> None:
    """Name, at load, what the model's `generation_config` asks for that requests will not get."""
    if ignored := ignored_generation_settings(config):
        log.warning("the model's generation_config asks for what the engine does not apply: its output will "
                    "differ from generate()'s with them", model=model, settings=ignored)
    if sampling := unapplied_sampling_defaults(config):
        log.warning("the model's generation_config samples by default; requests sample as their own parameters "
                    "say (native: greedy unless `temperature` is given; OpenAI routes: temperature 1): give "
                    "these per request to sample as the model's authors recommend", model=model, settings=sampling)
