"""What one forward of the engine costs on this machine: a decode step by running rows, a prefill by
prompt length and rows (the engine benchmark's model, the worker's engine, no Redis, no gateway).

These costs bound what any scheduling can do for a short request: its latency is its prefill plus
one token interval per new token, and a token interval is at least one decode step of the batch it
runs in. Median of --reps timings per point.

    python scripts/step_costs.py --json docs/bench/step_costs.json [--profile] [--threads-check] [--logprobs]
        [--structured]

`--threads-check` times a 1-row decode step on a helper thread (where the worker's engines run):
on one torch thread, on all cores, and on all cores while a second thread holds an OpenMP pool of
its own (the case `gpu_worker.cpu_threads.CpuShare` exists to avoid).

`--logprobs` times what log probabilities add (`params.logprobs`, `params.prompt_logprobs`): an 8-row decode step
with none, with each token's alone and with 20 alternatives each, the variants' steps taking turns; a 256-token
prefill with and without its prompt scored (5 alternatives).

`--structured` times what structured output adds (`params.response_format`): an 8-row decode step with no row
constrained and with every row inside a JSON Schema's string (most of the vocabulary allowed: the mask's usual
case), the variants' steps taking turns; and compiling a schema against the model's tokenizer (once a request).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker import models
from gpu_worker.engine import GenerationEngine, GenSpec
from shared.config import BUILTIN_MODELS
from shared.states import FinishReason

DECODE_ROWS = (1, 2, 4, 8, 16, 24, 32)
PREFILLS = ((16, 1), (32, 1), (64, 1), (64, 4), (256, 1), (256, 2), (256, 4))
CONTEXT = 256  # tokens already cached per row when decode steps are timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "batchgate" / "models"))
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops of 1-row decode steps")
    ap.add_argument("--logprobs", action="store_true", help="only time what log probabilities add")
    ap.add_argument("--structured", action="store_true", help="only time what structured output adds")
    ap.add_argument("--threads-check", action="store_true",
                    help="also time a 1-row step on helper threads: 1 thread, all cores, beside a second pool")
    args = ap.parse_args()
    cores = torch.get_num_threads()
    if args.threads_check:  # before the main thread grows an OpenMP pool of its own
        torch.set_num_threads(1)
    loaded = models.load(BUILTIN_MODELS["bench-llama"], Path(args.cache_dir))
    model = loaded.model
    rng = random.Random(0)

    def spec(i: int, prompt: int) -> GenSpec:
        return GenSpec(id=str(i), prompt_ids=tuple(rng.randrange(3, 8192) for _ in range(prompt)),
                       max_new_tokens=200)

    def engine(rows: int) -> GenerationEngine:
        return GenerationEngine(model, max_rows=rows, max_seq_len=512)

    if args.logprobs:
        write(args.json, {"logprobs": logprobs_cost(model, args.reps)})
        return
    if args.structured:
        write(args.json, {"structured": structured_cost(loaded, args.reps)})
        return
    report: dict[str, dict[str, float]] = {"decode_step_ms": {}, "prefill_ms": {}}
    if args.threads_check:
        report["helper_thread_step_ms"] = threads_check(engine(1), spec, args.reps, cores)
        torch.set_num_threads(cores)
    print(f"torch threads: {torch.get_num_threads()}")
    forward_costs(report, engine, spec, args.reps)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        eng = engine(1)
        eng.prefill([spec(0, 16)])
        eng.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    write(args.json, report)


def write(path: str | None, report: dict[str, dict[str, float]]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2))


def forward_costs(report: dict[str, dict[str, float]], engine: Callable[[int], GenerationEngine],
                  spec: Callable[[int, int], GenSpec], reps: int) -> None:
    """Decode steps by rows and prefills by prompt and rows, into `report` (medians of `reps`)."""
    print(f"{'decode step':<24}{'ms':>8}")
    for rows in DECODE_ROWS:
        eng = engine(rows)
        eng.prefill([spec(i, CONTEXT) for i in range(rows)])
        eng.step()  # first-call paths
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t0) * 1000)
        report["decode_step_ms"][str(rows)] = ms = statistics.median(times)
        print(f"{f'{rows} rows, {CONTEXT} cached':<24}{ms:>8.1f}", flush=True)
    print(f"{'prefill':<24}{'ms':>8}")
    for prompt, rows in PREFILLS:
        times = []
        for _ in range(reps + 1):
            eng = engine(rows)
            t0 = time.perf_counter()
            eng.prefill([spec(i, prompt) for i in range(rows)])
            times.append((time.perf_counter() - t0) * 1000)
        report["prefill_ms"][f"{rows}x{prompt}"] = ms = statistics.median(times[1:])
        print(f"{f'{rows} x {prompt} tokens':<24}{ms:>8.1f}", flush=True)


def taking_turns(engines: dict[str, GenerationEngine], rounds: int) -> dict[str, list[float]]:
    """Each engine's decode step times (ms), the variants stepping in turn each round, so noise hits them alike."""
    steps: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            eng.step()
            steps[name].append((time.perf_counter() - t0) * 1000)
    return steps


def logprobs_cost(model: torch.nn.Module, reps: int, rows: int = 8) -> dict[str, float]:
    """Medians (ms) of decode steps at `rows` rows, variants taking turns step by step, and of prefills."""
    from gpu_worker.sampling import SamplingParams

    rng = random.Random(1)
    prompts = [tuple(rng.randrange(3, 8192) for _ in range(CONTEXT)) for _ in range(rows)]
    variants = {"none": None, "chosen_only": 0, "top_20": 20}
    engines = {}
    for name, k in variants.items():
        eng = GenerationEngine(model, max_rows=rows, max_seq_len=512)
        eng.prefill([GenSpec(id=str(i), prompt_ids=p, max_new_tokens=250, sampling=SamplingParams(logprobs=k))
                     for i, p in enumerate(prompts)])
        eng.step()
        engines[name] = eng
    steps = taking_turns(engines, 20 * reps)
    out = {f"decode_{rows}_rows_{name}_ms": statistics.median(v) for name, v in steps.items()}
    prefills: dict[str, list[float]] = {"plain": [], "scored": []}
    for _ in range(reps + 1):
        for name, k in (("plain", None), ("scored", 5)):
            eng = GenerationEngine(model, max_rows=1, max_seq_len=512)
            t0 = time.perf_counter()
            eng.prefill([GenSpec(id="p", prompt_ids=prompts[0], max_new_tokens=4,
                                 sampling=SamplingParams(prompt_logprobs=k))])
            prefills[name].append((time.perf_counter() - t0) * 1000)
    out |= {f"prefill_{CONTEXT}_{name}_ms": statistics.median(v[1:]) for name, v in prefills.items()}
    for key, ms in out.items():
        print(f"{key:<36}{ms:>8.1f}")
    base = out[f"decode_{rows}_rows_none_ms"]
    print(f"decode step with top-20 log probabilities: {out[f'decode_{rows}_rows_top_20_ms'] / base:.2f}x; prefill "
          f"with its prompt scored: {out[f'prefill_{CONTEXT}_scored_ms'] / out[f'prefill_{CONTEXT}_plain_ms']:.2f}x")
    return out


# a schema whose string keeps every row constrained (and most of the vocabulary allowed) for the whole timing
LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}
TYPICAL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                            "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,4}$"},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                                            "address": {"type": "object", "properties": {
                                                "street": {"type": "string"}, "zip": {"type": "string"}}}},
           "required": ["name", "age", "email"], "additionalProperties": False}


def structured_cost(loaded: models.LoadedModel, reps: int, rows: int = 8) -> dict[str, float]:
    """Medians (ms) of decode steps at `rows` rows with no row and every row constrained, taking turns step by
    step; and of compiling a typical schema (the first compile also reads the tokenizer: timed apart)."""
    from gpu_worker.constraints import Grammars
    from gpu_worker.generate_runner import GenerateRunner
    from shared.structured_output import JsonSchema

    runner = GenerateRunner(loaded, "bench", max_rows=1, max_seq_len=64)  # its Grammars, as a worker builds them
    t0 = time.perf_counter()
    runner.grammars.compile(JsonSchema(TYPICAL))
    first = (time.perf_counter() - t0) * 1000
    compiles = []
    for _ in range(20 * reps):
        t0 = time.perf_counter()
        runner.grammars.compile(JsonSchema(TYPICAL))
        compiles.append((time.perf_counter() - t0) * 1000)
    compiled = runner.grammars.compile(JsonSchema(LONG_STRING))
    assert not isinstance(compiled, str), compiled
    rng = random.Random(2)
    prompts = [tuple(rng.randrange(3, 8192) for _ in range(CONTEXT)) for _ in range(rows)]
    engines = {}
    for name in ("none", "json"):
        eng = GenerationEngine(loaded.model, max_rows=rows, max_seq_len=512)
        eng.prefill([GenSpec(id=str(i), prompt_ids=p, max_new_tokens=250,
                             constraint=Grammars.start(compiled, ()) if name == "json" else None)
                     for i, p in enumerate(prompts)])
        eng.step()
        engines[name] = eng
    steps = taking_turns(engines, 20 * reps)
    assert all(len(eng.rows) == rows for eng in engines.values()), "a row left during the timing"
    out = {f"decode_{rows}_rows_{name}_ms": statistics.median(v) for name, v in steps.items()}
    out |= {"compile_first_ms": first, "compile_typical_schema_ms": statistics.median(compiles)}
    for key, ms in out.items():
        print(f"{key:<36}{ms:>8.2f}")
    ratio = out[f"decode_{rows}_rows_json_ms"] / out[f"decode_{rows}_rows_none_ms"]
    print(f"decode step with every row constrained: {ratio:.2f}x")
    return out


def threads_check(eng: GenerationEngine, spec: Callable[[int, int], GenSpec], reps: int,
                  cores: int) -> dict[str, float]:
    """A 1-row decode step timed on a fresh helper thread in three settings (median of 20 x reps)."""
    out: dict[str, float] = {}

    def timed(name: str, threads: int) -> None:
        torch.set_num_threads(threads)
        eng.prefill([spec(0, 16)])
        times = []
        for _ in range(20 * reps):
            if not eng.rows:
                eng.prefill([spec(0, 16)])
            t0 = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t0) * 1000)
        eng.remove(eng.running_ids(), FinishReason.CANCELLED)
        out[name] = statistics.median(times[5:])

    def on_thread(name: str, threads: int) -> None:
        t = threading.Thread(target=timed, args=(name, threads))
        t.start()
        t.join()

    on_thread("one_thread", 1)
    on_thread(f"{cores}_threads", cores)
    # a second thread grows a pool and stays alive (as a second engine would): libgomp now has more
    # pool threads than cores, stops spinning, and every parallel region waits on a wake-up
    hold, grown = threading.Event(), threading.Event()

    def other_pool() -> None:
        torch.set_num_threads(cores)
        torch.exp(torch.randn(1_000_000))
        grown.set()
        hold.wait()

    holder = threading.Thread(target=other_pool)
    holder.start()
    grown.wait()
    on_thread(f"{cores}_threads_beside_a_second_pool", cores)
    hold.set()
    holder.join()
    print(f"{'1-row step, helper thread':<40}{'ms':>8}")
    for name, ms in out.items():
        print(f"{name:<40}{ms:>8.1f}")
    return out


if __name__ == "__main__":
    main()
