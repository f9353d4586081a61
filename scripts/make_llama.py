"""Write a seeded random-weight Llama of a real model's shape, with the built-in tokenizer, to a directory:
the engine benchmarks on a real-size model without a download (`bench_engine.py --model-dir DIR`).
Weights are random ("dummy weights", as serving benchmarks use), so the tokens mean nothing; the shapes,
and so the costs, are the real model's. The vocabulary is the built-in tokenizer's 8,192 tokens.

    python scripts/make_llama.py --preset 1b /tmp/llama-1b      # Llama 3.2 1B's layers: ~1.0B parameters
    python scripts/bench_engine.py --long-prefill --model-dir /tmp/llama-1b --json long-prefill-1b.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpu_worker.models import LlamaShape, write_llama

# hidden, intermediate, layers, heads, KV heads of public Llama checkpoints (their config.json)
PRESETS = {
    "1b": LlamaShape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, seed=0),  # Llama 3.2 1B
    "3b": LlamaShape(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, seed=0),  # Llama 3.2 3B
    "8b": LlamaShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, seed=0),  # Llama 3.1 8B
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the directory to write (must not exist)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                    help="of the saved weights (a GPU worker loads bfloat16 either way)")
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists")
    shape = PRESETS[args.preset]
    print(f"writing a random-weight Llama ({args.preset}: {shape}) to {args.out}", flush=True)
    write_llama(shape, args.out, args.dtype)
    print("done", flush=True)


if __name__ == "__main__":
    main()
