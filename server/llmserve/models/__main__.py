"""`python -m llmserve.models`: load a model as a CPU server would, making its caches once (`make model`, the
Dockerfile)."""

from __future__ import annotations

from pathlib import Path

from llmserve.models.loader import load_model


def main(argv: list[str] | None = None) -> int:
    """`python -m llmserve.models [SPEC] [--dtype D]`: load the model a CPU server would with `--dtype D`, making its
    caches once: a GGUF's tokenizer and config (auto, gguf: seconds), or its float conversion (float32, bfloat16).

    `make model` and the Dockerfile run it, so that a start finds the cache the default serves from.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m llmserve.models", description=main.__doc__)
    parser.add_argument("spec", nargs="?", default=None, help="model spec as for --model; default: the default model")
    parser.add_argument("--cache-dir", default=None, help="conversion cache; default: $LLMSERVE_CACHE_DIR or ~/.cache")
    parser.add_argument("--dtype", default="auto", help="as the server's --dtype (default: auto)")
    args = parser.parse_args(argv)
    cache = Path(args.cache_dir) if args.cache_dir else None
    loaded = load_model(args.spec, device="cpu", dtype=args.dtype, cache_root=cache)
    print(f"model ready: {loaded.name} ({loaded.weights or loaded.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
