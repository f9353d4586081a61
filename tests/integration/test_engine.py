"""The continuous-batching engine on small seeded models: equality with `generate`, joins, leaves."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker.engine import EngineFull, GenerationEngine, GenSpec, group_by_length
from gpu_worker.sampling import SamplingParams
from shared.states import FinishReason
from tests.torch_device import DEVICE, on_device

VOCAB = 512


def tiny(arch: str = "llama"):
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)
    kv = {"num_key_value_heads": 2} if arch in ("llama", "mistral", "qwen2", "qwen3", "gemma") else {}
    if arch == "gpt2":
        common = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, eos_token_id=None,
                      bos_token_id=None, pad_token_id=None)
    if arch in ("qwen3", "gemma"):
        kv["head_dim"] = 16
    cfg = AutoConfig.for_model(arch, **common, **kv)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval().to(DEVICE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


@pytest.fixture(scope="module")
def model():
    return tiny()


@on_device
def reference(model, spec: GenSpec) -> list[int]:
    out = model.generate(torch.tensor([spec.prompt_ids]), max_new_tokens=spec.max_new_tokens,
                         min_new_tokens=spec.max_new_tokens, do_sample=False)
    return out[0, len(spec.prompt_ids):].tolist()


def specs(n: int, seed: int = 1, prompts=(3, 9, 17, 40), outputs=(2, 5, 9, 20)) -> list[GenSpec]:
    rng = random.Random(seed)
    return [GenSpec(id=f"r{i}", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(rng.choice(prompts))),
                    max_new_tokens=rng.choice(outputs)) for i in range(n)]


def run(engine: GenerationEngine, arrivals: dict[int, list[GenSpec]]) -> dict[str, object]:
    """Feed `arrivals[step]` before each step; run until everything finished."""
    results = {}
    step = 0
    last = max(arrivals)
    while step <= last or engine.running:
        for r in engine.prefill(arrivals.get(step, [])):
            results[r.id] = r
        for r in engine.step():
            results[r.id] = r
        step += 1
    return results


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_greedy_equals_generate_with_joins_at_different_steps(arch):
    model = model_ = tiny(arch)
    reqs = specs(12, seed=3)
    arrivals = {0: reqs[:4], 1: reqs[4:6], 4: reqs[6:9], 9: reqs[9:]}
    results = run(GenerationEngine(model_, max_rows=16, max_seq_len=64), arrivals)
    for spec in reqs:
        assert results[spec.id].token_ids == reference(model, spec), spec.id
        assert results[spec.id].finish_reason is FinishReason.LENGTH


def test_logits_match_batch_size_one_closely(model):
    """Token equality can hide position bugs on a random model; compare the first-step logits too."""
    reqs = specs(6, seed=5)
    engine = GenerationEngine(model, max_rows=8, max_seq_len=64)
    engine.prefill(reqs)
    check_first_step_logits(model, engine)


@on_device
def check_first_step_logits(model: torch.nn.Module, engine: GenerationEngine) -> None:
    ids = torch.tensor([[r.tokens[-1]] for r in engine.rows])
    lo = min(r.start for r in engine.rows)
    starts = torch.tensor([r.start for r in engine.rows])
    cols = torch.arange(lo, engine.end + 1)
    window = engine.cache.window(slice(0, len(engine.rows)), engine.end, engine.end + 1, lo)
    with torch.inference_mode():
        got = model(input_ids=ids, attention_mask=(cols[None] >= starts[:, None])[:, None, None],
                    position_ids=(engine.end - starts)[:, None], **{engine.cache_arg: window}).logits[:, -1]
        for i, row in enumerate(engine.rows):
            full = torch.tensor([[*row.spec.prompt_ids, row.tokens[-1]]])
            want = model(input_ids=full).logits[0, -1]
            assert torch.max(torch.abs(got[i] - want)).item() < 1e-4


def test_compaction_and_growth_keep_outputs_exact(model):
    """Small max_seq_len forces the cache to shift left and grow while rows keep joining."""
    reqs = specs(16, seed=7, prompts=(3, 12, 30), outputs=(8, 20, 30))
    arrivals = {i * 3: [r] for i, r in enumerate(reqs)}
    engine = GenerationEngine(model, max_rows=4 + 12, max_seq_len=64)
    results = run(engine, arrivals)
    for spec in reqs:
        assert results[spec.id].token_ids == reference(model, spec), spec.id


def test_cancel_mid_generation(model):
    reqs = specs(3, seed=2, outputs=(30,))
    engine = GenerationEngine(model, max_rows=4, max_seq_len=128)
    engine.prefill(reqs)
    for _ in range(5):
        engine.step()
    (gone,) = engine.remove({"r1"}, FinishReason.CANCELLED)
    assert gone.finish_reason is FinishReason.CANCELLED and len(gone.token_ids) == 6
    assert engine.running_ids() == ["r0", "r2"] or sorted(engine.running_ids()) == ["r0", "r2"]
    rest = run(engine, {0: []})
    for spec in (reqs[0], reqs[2]):
        assert rest[spec.id].token_ids == reference(model, spec)


def test_deadline_mid_generation_keeps_partial_output(model):
    """The scheduler decides a row is out of time (tests/unit/test_scheduler.py); the engine removes it
    with the tokens it has and the rest of the batch carries on."""
    now = [1000.0]
    engine = GenerationEngine(model, max_rows=4, max_seq_len=128, clock=lambda: now[0])
    spec = GenSpec(id="late", prompt_ids=(1, 2, 3), max_new_tokens=50)
    other = GenSpec(id="ok", prompt_ids=(4, 5), max_new_tokens=10)
    engine.prefill([spec, other])
    for _ in range(3):
        engine.step()
    now[0] = 1006.0
    (late,) = engine.remove({"late"}, FinishReason.DEADLINE)
    assert late.id == "late" and late.finish_reason is FinishReason.DEADLINE
    assert late.token_ids == reference(model, spec)[:4]
    assert engine.running_ids() == ["ok"]


def test_stop_string(model):
    spec = specs(1, seed=4, outputs=(20,))[0]
    ref = reference(model, spec)
    text = lambda ids: "".join(chr(0x4E00 + i) for i in ids)  # noqa: E731 - one character per token
    stop = text(ref[6:8])
    engine = GenerationEngine(model, max_rows=2, max_seq_len=64, decode_tail=text)
    results = run(engine, {0: [GenSpec(id=spec.id, prompt_ids=spec.prompt_ids, max_new_tokens=20, stop=(stop,))]})
    got = results[spec.id]
    assert got.finish_reason is FinishReason.STOP and got.token_ids == ref[:8]


def test_eos_stops_a_row(model):
    spec = specs(1, seed=4, outputs=(20,))[0]
    ref = reference(model, spec)
    eos = ref[5]
    first = ref.index(eos)
    engine = GenerationEngine(model, max_rows=2, max_seq_len=64)
    results = run(engine, {0: [GenSpec(id="e", prompt_ids=spec.prompt_ids, max_new_tokens=20,
                                       eos_ids=frozenset({eos}))]})
    assert results["e"].finish_reason is FinishReason.EOS and results["e"].token_ids == ref[: first + 1]


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    def sample(seed, mates):
        engine = GenerationEngine(model, max_rows=8, max_seq_len=64)
        spec = GenSpec(id="s", prompt_ids=(5, 6, 7), max_new_tokens=15,
                       sampling=SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed))
        return run(engine, {0: [spec, *mates]})["s"].token_ids

    a = sample(42, [])
    assert a == sample(42, [])
    assert a == sample(42, specs(3, seed=9))  # batch-mates do not change its draws
    assert a != sample(43, [])


def test_joining_request_gets_its_first_token_before_the_others_finish(model):
    ticks = itertools.count()
    engine = GenerationEngine(model, max_rows=8, max_seq_len=128, clock=lambda: float(next(ticks)))
    long_rows = specs(3, seed=1, outputs=(60,))
    engine.prefill(long_rows)
    for _ in range(10):
        engine.step()
    joined = engine.prefill([GenSpec(id="new", prompt_ids=(1, 2, 3), max_new_tokens=5)])
    assert joined == [] and "new" in engine.running_ids()
    first_token_at = next(r.first_token_at for r in engine.rows if r.spec.id == "new")
    results = run(engine, {0: []})
    assert first_token_at < min(results[s.id].admitted_at + results[s.id].ttft_s + results[s.id].decode_s
                                for s in long_rows)
    assert len(results["new"].token_ids) == 5


def test_capacity_is_enforced(model):
    engine = GenerationEngine(model, max_rows=2, max_seq_len=32)
    with pytest.raises(EngineFull):
        engine.prefill(specs(3))
    with pytest.raises(EngineFull):
        engine.prefill([GenSpec(id="big", prompt_ids=tuple(range(30)), max_new_tokens=5)])
    assert engine.running == 0


def test_group_by_length_bounds_padding():
    lengths = [256, 16, 250, 32, 64, 60, 17]
    groups = group_by_length(lengths, 0.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        width = max(lengths[i] for i in g)
        assert width * len(g) - sum(lengths[i] for i in g) <= 0.25 * width * len(g)
    alone = [False, False, True, False, False, True, False]  # rows whose every position's logits are kept
    grouped = group_by_length(lengths, 0.25, alone)
    assert sorted(i for g in grouped for i in g) == list(range(len(lengths)))
    assert [2] in grouped and [5] in grouped and len(grouped) == len(groups) + 2  # 250 and 60 were with others
    assert [g for g in grouped if g not in ([2], [5])] == [[0], [4, 3], [6, 1]]


def test_a_long_prompt_joining_short_rows_reads_only_finite_cache(model):
    """Regression: short rows, one step, then a long prompt shifts them right; every column any row
    attends to (masked or not) must hold finite values, or a masked NaN poisons the attention sum."""
    short = specs(3, seed=11, prompts=(4, 8), outputs=(6,))
    long = GenSpec(id="long", prompt_ids=tuple(range(3, 103)), max_new_tokens=6)
    engine = GenerationEngine(model, max_rows=8, max_seq_len=128)
    results = {r.id: r for r in engine.prefill(short)}
    results.update({r.id: r for r in engine.step()})
    results.update({r.id: r for r in engine.prefill([long])})
    lo = min(r.start for r in engine.rows)
    for layer in range(len(engine.cache.keys)):
        assert torch.isfinite(engine.cache.keys[layer][: engine.running, :, lo: engine.end]).all()
        assert torch.isfinite(engine.cache.values[layer][: engine.running, :, lo: engine.end]).all()
    results.update(run(engine, {0: []}))
    for spec in [*short, long]:
        assert results[spec.id].token_ids == reference(model, spec), spec.id


def test_eager_attention_gets_an_additive_mask():
    """Eager attention adds the mask to the scores: the engine must hand it 0 / -inf, not booleans."""
    model = tiny()
    model.config._attn_implementation = "eager"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    reqs = specs(6, seed=12)
    results = run(GenerationEngine(model, max_rows=8, max_seq_len=64), {0: reqs[:3], 2: reqs[3:]})
    for spec in reqs:
        assert results[spec.id].token_ids == reference(model, spec), spec.id


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_a_prompt_prefilled_in_chunks_equals_generate_and_running_rows_keep_decoding(arch):
    from tests.integration.test_architectures import tiny as tiny_arch

    model = tiny_arch(arch)  # mistral and gemma2 with a window of 8: chunks cross it
    rng = random.Random(7)
    running = [GenSpec(id=f"s{i}", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(n)), max_new_tokens=30)
               for i, n in enumerate((3, 9, 17))]
    long = GenSpec(id="long", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(100)), max_new_tokens=12)
    engine = GenerationEngine(model, max_rows=6, max_seq_len=160)
    results = {r.id: r for r in engine.prefill(running)}
    engine.prefill_in_chunks(long)
    assert engine.chunked.active and engine.free_rows == 2
    chunk_steps = 0
    while engine.chunked.active:
        before = {r.spec.id: len(r.tokens) for r in engine.rows}
        for r in engine.step(chunk_tokens=16):
            results[r.id] = r
        chunk_steps += 1
        assert all(len(r.tokens) == before[r.spec.id] + 1 for r in engine.rows if r.spec.id in before)
    assert chunk_steps == 7  # 100 tokens in chunks of 16, one per step, every running row decoding meanwhile
    results.update({r.id: r for r in run(engine, {0: []}).values()})
    for spec in [*running, long]:
        assert results[spec.id].token_ids == reference(model, spec), spec.id


def test_a_chunked_prefill_can_be_cancelled_midway(model):
    engine = GenerationEngine(model, max_rows=4, max_seq_len=160)
    long = GenSpec(id="long", prompt_ids=tuple(range(1, 101)), max_new_tokens=5)
    engine.prefill_in_chunks(long)
    engine.step(chunk_tokens=16)
    (gone,) = engine.remove({"long"}, FinishReason.CANCELLED)
    assert gone.token_ids == [] and gone.finish_reason is FinishReason.CANCELLED
    assert not engine.chunked.active and engine.free_rows == 4 and engine.running == 0


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_parked_rows_sit_out_steps_and_resume_exactly(arch):
    """Rows held back keep their tokens and cache while others decode, join, compact and chunk a long prompt; back
    in the batch they continue as if they had never left (greedy tokens equal `generate`, windows crossed)."""
    from tests.integration.test_architectures import tiny as tiny_arch

    model = tiny_arch(arch)  # mistral and gemma2 with a window of 8
    rng = random.Random(11)
    batch = [GenSpec(id=f"b{i}", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(n)), max_new_tokens=28)
             for i, n in enumerate((5, 9, 12, 15))]
    fg = [GenSpec(id=f"f{i}", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(n)), max_new_tokens=m)
          for i, (n, m) in enumerate(((4, 40), (10, 34), (7, 9)))]
    long = GenSpec(id="long", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(36)), max_new_tokens=6)
    engine = GenerationEngine(model, max_rows=9, max_seq_len=44)  # a cache 88 wide: it compacts
    results = {r.id: r for r in engine.prefill(batch)}
    for _ in range(6):
        engine.step()
    held = {"b0", "b2", "b3"}
    engine.hold_back(held)
    assert sorted(engine.parked.ids()) == sorted(held) and engine.running == 4 and engine.free_rows == 5
    assert sorted(engine.running_ids()) == sorted(s.id for s in batch)
    results.update({r.id: r for r in engine.prefill(fg[:2])})
    engine.prefill_in_chunks(long)
    steps = 0
    while any(r.spec.id.startswith("f") for r in engine.rows) or engine.chunked.active:
        tokens = {rid: len(engine.parked.rows[rid].row.tokens) for rid in held}
        if steps == 3:
            results.update({r.id: r for r in engine.prefill(fg[2:])})
        results.update({r.id: r for r in engine.step(chunk_tokens=16)})
        assert {rid: len(engine.parked.rows[rid].row.tokens) for rid in held} == tokens  # nothing advanced
        steps += 1
        if steps == 25:  # two come back beside the decoding rows; one stays out a while longer
            held = {"b3"}
            engine.hold_back(held)
    engine.hold_back(set())
    results.update(run(engine, {0: []}))
    for spec in [*batch, *fg, long]:
        assert results[spec.id].token_ids == reference(model, spec), spec.id


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_rows_parked_together_come_back_by_moving_the_few_that_ran(arch):
    """The CPU pattern: all batch rows but one sit out beside an interactive row and come back together when it
    finishes. Parking swaps rows instead of copying caches aside; bringing them back moves the two rows that ran
    back to where the parked ones stopped (the batch's end goes back to theirs), not every parked row forward."""
    from tests.integration.test_architectures import tiny as tiny_arch

    model = tiny_arch(arch)
    rng = random.Random(5)
    batch = [GenSpec(id=f"b{i}", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(n)), max_new_tokens=30)
             for i, n in enumerate((6, 11, 3, 14, 9))]
    fg = GenSpec(id="fg", prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(5)), max_new_tokens=6)
    engine = GenerationEngine(model, max_rows=8, max_seq_len=60)
    results = {r.id: r for r in engine.prefill(batch)}
    for _ in range(4):
        engine.step()
    held = {"b1", "b2", "b3", "b4"}  # b0, in the first row, keeps running: it swaps places with one of them
    engine.hold_back(held)
    assert engine.cache.base == 4 and [r.spec.id for r in engine.rows] == ["b0"]
    parked_end = engine.end
    results.update({r.id: r for r in engine.prefill([fg])})
    while "fg" not in results:
        results.update({r.id: r for r in engine.step()})
    assert engine.end > parked_end
    engine.hold_back(set())
    assert engine.end == parked_end and engine.cache.base == 0  # the running row moved, the parked ones did not
    assert sorted(r.spec.id for r in engine.rows) == sorted(s.id for s in batch)
    results.update(run(engine, {0: []}))
    for spec in [*batch, fg]:
        assert results[spec.id].token_ids == reference(model, spec), spec.id


def test_rows_parked_at_different_steps_come_back_together(model):
    """Rows that stopped at different columns: each is moved forward in its own cache row."""
    reqs = specs(5, seed=9, outputs=(24,))
    engine = GenerationEngine(model, max_rows=6, max_seq_len=80)
    results = {r.id: r for r in engine.prefill(reqs)}
    engine.step()
    engine.hold_back({"r1"})
    engine.step()
    engine.step()
    engine.hold_back({"r1", "r3", "r4"})
    engine.step()
    assert engine.cache.base == 3 and sorted(engine.parked.ids()) == ["r1", "r3", "r4"]
    engine.hold_back({"r3"})  # r1 and r4 back, from different columns; r3 stays out
    assert engine.cache.base == 1 and engine.parked.rows["r3"].slot == 0
    engine.step()
    engine.hold_back(set())
    results.update(run(engine, {0: []}))
    for spec in reqs:
        assert results[spec.id].token_ids == reference(model, spec), spec.id


def test_a_parked_row_can_be_removed(model):
    reqs = specs(3, seed=4, outputs=(30,))
    engine = GenerationEngine(model, max_rows=4, max_seq_len=128)
    engine.prefill(reqs)
    engine.step()
    engine.hold_back({"r1"})
    engine.step()
    (gone,) = engine.remove({"r1"}, FinishReason.CANCELLED)
    assert gone.id == "r1" and len(gone.token_ids) == 2 and gone.finish_reason is FinishReason.CANCELLED
    assert len(engine.parked) == 0 and engine.running == 2
    rest = run(engine, {0: []})
    for spec in (reqs[0], reqs[2]):
        assert rest[spec.id].token_ids == reference(model, spec)


def test_a_model_on_cuda_never_runs_attention_on_cudnn():
    """cuDNN's attention builds a graph for every new shape: ~45 ms on an H100 for each fused step (a chunk's keys
    grow every step), measured against a 6 ms decode step. A model loaded on CUDA turns it off for the process; on
    other devices torch chooses as usual."""
    from gpu_worker.models import attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        attention_kernels(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
        attention_kernels(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_loading_a_model_sets_the_attention_kernels_for_its_device(model_cache, monkeypatch):
    from gpu_worker import models
    from shared.config import BUILTIN_MODELS

    seen = []
    monkeypatch.setattr(models, "attention_kernels", seen.append)
    loaded = models.load(BUILTIN_MODELS["tiny-llama"], model_cache)
    assert seen == [loaded.device]
