"""The engine benchmark's long-prefill mode (`bench_engine.py --long-prefill`): rows decoding while a
2,048-token prompt arrives; how long a running row waits between two of its tokens meanwhile.

The worker's own compute loop (scheduler, runner, engine; no Redis) serves `--rows` short requests
with long outputs; once they have decoded a while, one 2,048-token prompt arrives. Every decode step
advances every running row by one token, so the gaps between step ends are the rows' inter-token
latencies: `decode_step_ms` is their median before the long prompt arrives, and
`max_itl_ms_during_long_prefill` the longest from its arrival to its first token. As a control for the
machine's own hiccups, `max_itl_ms_without_prefill` is the longest of CONTROL_STEPS bare decode steps
just before the arrival (about as many steps as a fused prefill spans). Run three ways,
side by side: chunks fused into the decode steps (the default, where the load check allows it), chunks
as forwards of their own, and chunked prefill off (`prefill_chunk_tokens: 0`, the whole prompt in one
forward), so the ratios are measured on the same machine in the same minute.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import statistics
import time
from typing import Any

LONG_PROMPT = 2048
WARM_STEPS = 40  # decode steps before the long prompt arrives (the fits warm up meanwhile)
CONTROL_STEPS = 300  # ... then these, whose longest gap is the control
ROW_TOKENS = 2048  # what each row generates at most; the run ends at the long prompt's first token


def run(loaded: Any, *, chunk_tokens: int, fused: bool, rows: int = 8, seed: int = 0) -> dict[str, Any]:
    import random

    from gpu_worker.assembly import build_scheduler
    from gpu_worker.commands import Add, Drain
    from gpu_worker.generate_runner import GenerateRunner
    from gpu_worker.model_loop import ModelLoop
    from shared.lanes import LaneSpec
    from shared.messages import InferenceRequest
    from shared.states import Priority

    # the rows decode far longer than any variant's prefill takes, so every gap measured is one a row waited
    # one lane with no share cap: the rows and the long prompt are all long work here
    spec = dataclasses.replace(loaded.spec, max_input_tokens=LONG_PROMPT, max_new_tokens=ROW_TOKENS,
                               max_running=rows + 2, prefill_chunk_tokens=chunk_tokens,
                               lanes=(LaneSpec("all", None, window_ms=5.0),))
    runner = GenerateRunner(dataclasses.replace(loaded, spec=spec), "bench", max_rows=rows + 2,
                            max_seq_len=spec.max_seq_len, fused=fused)
    steps: list[tuple[float, bool]] = []  # (end of a decode step, the long prompt has joined the decoding rows)
    chunks: list[int] = []  # the prompt tokens each step could prefill (0: a bare decode step), beside `steps`
    inner = runner.step

    def timed_step(chunk: int = 0) -> list[Any]:
        out = inner(chunk)
        steps.append((time.perf_counter(), any(r.spec.id == "long" for r in runner.engine.rows)))
        chunks.append(chunk)
        return out

    runner.step = timed_step  # type: ignore[method-assign]
    done: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
    loop = ModelLoop(spec.name, runner, build_scheduler(spec, runner), mark_running=lambda rs: [True] * len(rs),
                     emit=done.put, worker="bench")
    rng = random.Random(seed)
    vocab = loaded.model.config.vocab_size
    now_ms = int(time.time() * 1000)

    def request(rid: str, prompt: int, new: int) -> InferenceRequest:
        return InferenceRequest(id=rid, tenant="bench", model=spec.name, task=spec.task,
                                input={"input_ids": [rng.randrange(3, vocab) for _ in range(prompt)]},
                                params={"max_new_tokens": new, "ignore_eos": True}, lane=spec.lanes[-1].name,
                                priority=Priority.INTERACTIVE, created_ms=now_ms, deadline_ms=now_ms + 3_600_000,
                                est_tokens=prompt + new)

    # the loop runs on this thread, the one that loaded the model: a second thread would grow a second OpenMP
    # pool and throttle both (see gpu_worker.cpu_threads), which the worker never does
    loop.submit(Add([request(f"s{i}", 16, ROW_TOKENS) for i in range(rows)], time.time()))
    while len(steps) < WARM_STEPS + CONTROL_STEPS:
        loop._iterate(block=False)
    arrived = time.perf_counter()
    loop.submit(Add([request("long", LONG_PROMPT, 8)], time.time()))
    while not (steps and steps[-1][1]):  # until the long prompt has joined the decoding rows
        loop._iterate(block=False)
    loop.submit(Drain(time.time()))  # the rows are handed back: the gaps that matter are behind us
    while not loop.stopped:
        loop._iterate(block=False)
    while not done.empty():
        done.get()
    before = [b - a for (a, _), (b, _) in itertools.pairwise(steps) if b < arrived]
    first_token = next(t for t, joined in steps if joined)
    # every gap a row waited from the arrival to the long prompt's first token, with the prompt tokens the step
    # that ended it could prefill (0: a bare decode step): where the longest comes from (a chunk, or noise)
    trace = [(round((b - a) * 1000, 2), chunks[i + 1]) for i, ((a, _), (b, _)) in enumerate(itertools.pairwise(steps))
             if b > arrived and a < first_token]
    during = [ms for ms, _ in trace]
    fused_ms = [ms for ms, tokens in trace if tokens]  # fused: the steps carrying a chunk
    return {"decode_step_ms": statistics.median(before[5:]) * 1000,
            "max_itl_ms_during_long_prefill": max(during) if during else float("nan"),
            "max_itl_ms_without_prefill": max(before[-CONTROL_STEPS:]) * 1000,
            "long_ttft_ms": (first_token - arrived) * 1000, "chunk_tokens_setting": float(chunk_tokens),
            "fused": float(fused), "steps_during_prefill": float(len(trace)),
            "fused_step_median_ms": statistics.median(fused_ms) if fused_ms else float("nan"),
            "trace": trace}
