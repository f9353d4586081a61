"""Decoder architectures as users bring them: served exactly (greedy tokens equal `generate`) or refused.

Tiny random-weight models are built from each architecture's own config (seeded), with a sliding
window of 8 wherever the architecture has one, so prompts and outputs run well past it. The engine
serves a mixed batch: different prompt lengths (padding), rows that finish at different steps, late
joiners that prefill while others decode, and a long prompt prefilled in chunks while the others
decode (in the decode steps' own forwards where the load check allows it). Every token must equal
`model.generate` on that prompt alone.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gpu_worker.engine import GenerationEngine
from gpu_worker.exactness import verify_exact
from gpu_worker.sequences import GenSpec
from shared.errors import ConfigError
from tests.torch_device import DEVICE, on_device

VOCAB = 512
WINDOW = 8
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=WINDOW)
# what an architecture names differently, or needs to use its window on every layer it may
EXTRA: dict[str, dict[str, object]] = {
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_positions=512),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "qwen2": dict(use_sliding_window=True, max_window_layers=2),
    "qwen3": dict(use_sliding_window=True, max_window_layers=2),
    "smollm3": dict(use_sliding_window=True),
}
# the architectures users bring most, including those with sliding-window and hybrid local/global layers
SERVED = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gpt2", "gpt_neox", "opt",
          "falcon", "olmo2", "granite", "smollm3", "cohere2"]
# served, but their chunks run as forwards of their own: Gemma 2 attends with `eager` (logit soft-capping) and
# Falcon through an attention path of its own, so the fused step's attention never sees their layers
UNFUSED = {"gemma2", "falcon"}
CHUNK = 7


# A config the sizes below do not shrink (a multimodal wrapper whose text model sits in a sub-config) builds at full
# size: Qwen3.5's 9.0B, Emu3's 8.5B, Gemma 4's 5.1B parameters. Built on the meta device first (no memory), such a
# model is out of scope before a byte is allocated; built for real, it took the machine's memory (a CI run was
# killed by the kernel, 24 GB in) before the per-architecture alarm could stop it.
TINY_MAX_PARAMS = 1_000_000_000


class NotTiny(Exception):
    pass


def tiny(arch: str) -> torch.nn.Module:
    """A seeded tiny model of `arch`: only the sizes its config knows are set (a size it does not use, such as
    a window, would change what `generate`'s own cache keeps). `NotTiny` where these sizes leave it large."""
    defaults = AutoConfig.for_model(arch)
    sizes = {k: v for k, v in SIZES.items() if hasattr(defaults, k) or k in ("vocab_size", "hidden_size")}
    if isinstance(type(defaults).__dict__.get("head_dim"), property):
        sizes.pop("head_dim", None)
    cfg = AutoConfig.for_model(arch, **sizes, **EXTRA.get(arch, {}), eos_token_id=None, bos_token_id=None,
                               pad_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        except Exception:  # a model that cannot be built without memory: its own build below says what it is
            params = 0
    if params > TINY_MAX_PARAMS:
        raise NotTiny(f"{params / 1e9:.1f}B parameters at these sizes")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval().to(DEVICE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


@on_device
def reference(model: torch.nn.Module, spec: GenSpec) -> list[int]:
    out = model.generate(torch.tensor([spec.prompt_ids]), max_new_tokens=spec.max_new_tokens,
                         min_new_tokens=spec.max_new_tokens, do_sample=False)
    return out[0, len(spec.prompt_ids):].tolist()


def mixed(seed: int = 3) -> tuple[list[GenSpec], dict[int, list[GenSpec]]]:
    """Prompts of 3-30 tokens and outputs of 5-25 (both past the window), joining at steps 0, 2 and 7."""
    rng = random.Random(seed)
    reqs = [GenSpec(id=f"r{i}", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(rng.choice((3, 9, 17, 30)))),
                    max_new_tokens=rng.choice((5, 12, 25))) for i in range(6)]
    return reqs, {0: reqs[:3], 2: reqs[3:4], 7: reqs[4:]}


def long_prompt(seed: int = 5, length: int = 40) -> GenSpec:
    rng = random.Random(seed)
    return GenSpec(id="chunked", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(length)), max_new_tokens=12)


def serve(engine: GenerationEngine, arrivals: dict[int, list[GenSpec]],
          chunked: dict[int, GenSpec] | None = None) -> dict[str, list[int]]:
    """Prefill `arrivals` at their steps, start `chunked` prompts at theirs (CHUNK tokens a step), decode."""
    out: dict[str, list[int]] = {}
    chunked = chunked or {}
    step = 0
    while step <= max([*arrivals, *chunked]) or engine.running:
        if step in chunked:
            engine.prefill_in_chunks(chunked[step])
        for r in [*engine.prefill(arrivals.get(step, [])), *engine.step(CHUNK)]:
            out[r.id] = r.token_ids
        step += 1
    return out


@pytest.mark.parametrize("arch", SERVED)
def test_served_exactly(arch: str) -> None:
    model = tiny(arch)
    fused = verify_exact(model, arch)  # what a worker checks at load: it must pass for these
    assert fused is (arch not in UNFUSED)
    reqs, arrivals = mixed()
    engine = GenerationEngine(model, max_rows=8, max_seq_len=64, fused=fused)
    got = serve(engine, arrivals, {3: long_prompt()})  # 40 tokens in chunks of 7 beside decoding rows
    for spec in [*reqs, long_prompt()]:
        assert got[spec.id] == reference(model, spec), f"{arch} {spec.id}: {len(spec.prompt_ids)}-token prompt"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3_text", "cohere2"])
def test_served_exactly_on_the_fused_paths_cuda_takes(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a fused step does differently on CUDA, forced here on this device: a chunk's keys repeated per query head
    before its attention (no CUDA kernel does masked grouped-query attention), and the chunk cut so the packed
    sequence is a multiple of an alignment (CUDA picks its matrix kernels per shape). The same tokens, full,
    windowed and hybrid layers alike."""
    from gpu_worker import fused_step

    repeated: list[int] = []
    real_repeat = torch.Tensor.repeat_interleave

    def counting(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        repeated.append(1)
        return real_repeat(self, *args, **kwargs)

    monkeypatch.setattr(fused_step, "gqa_kernel_takes_mask", lambda device: False)
    monkeypatch.setattr(fused_step, "pack_align", lambda device: 4)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", counting)
    model = tiny(arch)
    assert verify_exact(model, arch)  # the load check passes on these paths too: chunks stay fused
    reqs, arrivals = mixed()
    engine = GenerationEngine(model, max_rows=8, max_seq_len=64, fused=True)
    packed: list[int] = []  # a fused step's rows + chunk tokens, for every chunk but a prompt's last
    last: list[tuple[int, int]] = []  # (tokens left, tokens taken) of a step whose budget covered the rest
    real_step = fused_step.fused_step

    def recording(e: GenerationEngine, budget: int) -> list[object]:
        rows, left = len(e.rows), len(e.chunked.current.spec.prompt_ids) - e.chunked.current.done
        out = real_step(e, budget)
        if left <= budget:
            last.append((left, e.chunked.last[0]))
        else:
            packed.append(rows + e.chunked.last[0])
        return out

    monkeypatch.setattr(fused_step, "fused_step", recording)
    repeated.clear()
    got = serve(engine, arrivals, {3: long_prompt()})
    assert repeated  # the chunk's attention really took this path
    assert packed and all(n % 4 == 0 for n in packed), packed  # every chunk CHUNK=7 or fewer, cut to align
    assert last and all(left == taken for left, taken in last), last  # the rest, when it fits, whole: one step
    for spec in [*reqs, long_prompt()]:
        assert got[spec.id] == reference(model, spec), f"{arch} {spec.id}: {len(spec.prompt_ids)}-token prompt"


def test_windowed_layers_really_are_windowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window matters on these sequences: served with full attention on every layer (every key kept),
    Mistral's tokens differ (so the equality above is not trivially true)."""
    from gpu_worker import attention

    model = tiny("mistral")
    full = attention.AttentionLayout({attention.FULL: attention.Pattern()}, by_type=False)
    monkeypatch.setattr(attention.AttentionLayout, "of", classmethod(lambda cls, m: full))
    reqs, arrivals = mixed()
    engine = GenerationEngine(model, max_rows=8, max_seq_len=64)
    assert engine.rings.per_layer == [0] * 4
    got = serve(engine, arrivals)
    assert any(got[s.id] != reference(model, s) for s in reqs)


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "qwen2", "cohere2"])
def test_windowed_layers_keep_only_their_window(arch: str) -> None:
    """A sliding-window layer's cache holds its window's columns per row, not the sequence's; full layers keep
    every column; the engine's memory is sized by that. One column fewer than the window gives wrong tokens
    (so the equality of `test_served_exactly` depends on every column the ring keeps)."""
    from gpu_worker import window_kv
    from gpu_worker.kv_cache import SlotKVCache

    model = tiny(arch)
    engine = GenerationEngine(model, max_rows=8, max_seq_len=64)
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * 4
    want = [WINDOW if t == "sliding_attention" else 0 for t in types]
    assert engine.rings.per_layer == want and any(want)
    assert [k.shape[2] for k in engine.cache.keys] == [w or 128 for w in want]
    full = SlotKVCache.bytes_per_row(model, 64)
    assert SlotKVCache.bytes_per_row(model, 64, want) == full * sum(w or 128 for w in want) // (128 * len(want))

    real = window_kv.Rings.of.__func__

    def one_short(cls: type, *args: object) -> window_kv.Rings:
        rings = real(cls, *args)
        return window_kv.Rings({t: w - 1 for t, w in rings.by_type.items()}, [max(0, w - 1) for w in rings.per_layer],
                               rings.single)

    reqs, arrivals = mixed()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(window_kv.Rings, "of", classmethod(one_short))
        short = GenerationEngine(model, max_rows=8, max_seq_len=64)
        got = serve(short, arrivals)
    assert any(got[s.id] != reference(model, s) for s in reqs)


def test_an_architecture_the_engine_cannot_drive_is_refused_at_load() -> None:
    """BLOOM keeps its cache in a layout of its own (alibi, fused heads): refused with a clear error, not served."""
    model = tiny("bloom")
    with pytest.raises(ConfigError, match="bloom"):
        verify_exact(model, "bloom")


ARCH_BUDGET_S = 30  # building a tiny model and generating with it; longer means it is not tiny at these sizes
# the architectures that must be served are known to be tiny here: their budget only bounds a hang, so a CI
# machine loaded by the suites running beside this one (gemma once took past 30 s there) cannot fail them
SERVED_BUDGET_S = 240


@pytest.mark.slow
@pytest.mark.beside  # minutes of CPU and no Redis: `make test` runs it in the pass beside the default one
@pytest.mark.timeout(2400, method="thread")  # per-architecture alarms below bound each one
def test_every_causal_lm_is_served_exactly_or_refused() -> None:
    """Every causal LM architecture of the installed transformers that `generate` runs on CPU at tiny sizes:
    the engine either serves it token for token like `generate` (having passed the load check) or refuses
    it at load with a clear error. Never wrong tokens, never a crash after the load check passed."""
    import signal

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class OverBudget(BaseException):  # not an Exception: nothing on the way may take it for the model's error
        pass

    def alarm(*_: object) -> None:
        raise OverBudget

    previous = signal.signal(signal.SIGALRM, alarm)
    outcome: dict[str, str] = {}
    try:
        for arch in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            signal.alarm(SERVED_BUDGET_S if arch in SERVED else ARCH_BUDGET_S)
            try:
                outcome[arch] = _sweep_one(arch)
            except OverBudget:
                outcome[arch] = "out of scope: not tiny within the budget"
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    wrong = {a: o for a, o in outcome.items() if o.startswith(("WRONG", "CRASH"))}
    served = sorted(a for a, o in outcome.items() if o == "served")
    refused = sorted(a for a, o in outcome.items() if o.startswith("refused"))
    print(f"\n{len(served)} served exactly, {len(refused)} refused at load, "
          f"{len(outcome) - len(served) - len(refused)} out of scope (tiny config or generate fails)")
    assert not wrong, wrong
    assert set(SERVED) <= set(served), {a: outcome.get(a, "not in the mapping") for a in SERVED if a not in served}
    assert len(served) + len(refused) >= 40  # the sweep really ran over the architectures


def _sweep_one(arch: str) -> str:
    try:
        model = tiny(arch)
        reqs, arrivals = mixed()
        vocab = model.config.get_text_config().vocab_size
        reqs = [GenSpec(id=s.id, prompt_ids=tuple(t % vocab for t in s.prompt_ids), max_new_tokens=s.max_new_tokens)
                for s in [*reqs, long_prompt()]]
        arrivals = {0: reqs[:3], 2: reqs[3:4], 7: reqs[4:6]}
        want = {s.id: reference(model, s) for s in reqs}
    except Exception as exc:  # transformers itself cannot build or run it at these sizes
        return f"out of scope: {type(exc).__name__}"
    try:
        fused = verify_exact(model, arch)
        engine = GenerationEngine(model, max_rows=8, max_seq_len=64, fused=fused)
    except ConfigError as exc:
        return f"refused: {exc}"
    try:
        got = serve(engine, arrivals, {3: reqs[6]})
    except Exception as exc:
        return f"CRASH after the load check passed: {type(exc).__name__}: {exc}"
    bad = [s.id for s in reqs if got[s.id] != want[s.id]]
    if bad and all(got[i] == _greedy_by_full_forward(model, s) for s in reqs if (i := s.id) in bad):
        # generate itself disagrees with the model's own forward (e.g. its cache drops keys the model's
        # attention still uses): the engine matches the model, so it is served exactly
        return "served"
    return f"WRONG tokens for {bad}" if bad else "served"


@on_device
@torch.inference_mode()
def _greedy_by_full_forward(model: torch.nn.Module, spec: GenSpec) -> list[int]:
    """Greedy tokens recomputing the whole sequence each step (no cache): the model's own function."""
    seq = list(spec.prompt_ids)
    for _ in range(spec.max_new_tokens):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(spec.prompt_ids):]
