"""GGUF files served from their blocks (issue 42): llmserve as `make run` starts it beside llama.cpp's
`llama-server` on the same file.

Files: the default model (its shipped Q4_1 file) and random-weight files of Llama-3.2-1B's and Llama-3-8B's shapes
in Q4_K_M and Q8_0. The random files are made once under --files (default /work/gguf-files, or $LLMSERVE_GGUF_FILES):
an F16 file written with the `gguf` package's writer one tensor at a time (the 8B file, 16 GB, is never whole in
memory), with the default model's tokenizer padded to the shape's vocabulary, then `llama-quantize`d; the F16 file is
deleted afterwards unless --keep-f16.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILES_ENV = "LLMSERVE_GGUF_FILES"
DEFAULT_FILES = Path("/work/gguf-files")
QUANTIZE_ENV = "LLAMA_QUANTIZE"
WEIGHT_STD = 0.02  # random weights' spread: a transformer's initialisation, so that quantization sees usual values


@dataclass(slots=True, frozen=True)
class Shape:
    """A Llama shape to write a random-weight GGUF in (the published dims of the model it is named after)."""

    name: str
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_theta: float
    tied: bool


SHAPES = {
    "llama-3.2-1b": Shape("llama-3.2-1b", 16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, True),
    "llama-3-8b": Shape("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0, False),
}


def files_root(flag: str | None = None) -> Path:
    """Where the random files live: `flag`, else $LLMSERVE_GGUF_FILES, else /work/gguf-files."""
    return Path(flag or os.environ.get(FILES_ENV) or DEFAULT_FILES)


def random_gguf(shape: Shape, tokenizer_source: Path, out: Path, seed: int = 0) -> Path:
    """An F16 GGUF of `shape` with random weights at `out`, written tensor by tensor; the tokenizer is the one of
    `tokenizer_source` (a GGUF), its token list padded with control tokens up to the shape's vocabulary."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    source = GGUFReader(tokenizer_source)
    writer = GGUFWriter(out.with_suffix(".partial"), "llama")
    writer.add_name(f"random {shape.name}")
    writer.add_file_type(1)  # mostly F16
    writer.add_uint32("llama.block_count", shape.layers)
    writer.add_uint32("llama.context_length", shape.context)
    writer.add_uint32("llama.embedding_length", shape.width)
    writer.add_uint32("llama.feed_forward_length", shape.ffn)
    writer.add_uint32("llama.attention.head_count", shape.heads)
    writer.add_uint32("llama.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32("llama.rope.dimension_count", shape.width // shape.heads)
    writer.add_float32("llama.rope.freq_base", shape.rope_theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("llama.vocab_size", shape.vocab)
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|pad_{i}|>" for i in range(shape.vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [3] * (shape.vocab - len(value))  # control tokens: never produced by text
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub)

    head_dim = shape.width // shape.heads
    tensors: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (shape.vocab, shape.width), True)]
    for i in range(shape.layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (shape.width,), False),
            (f"blk.{i}.attn_q.weight", (shape.heads * head_dim, shape.width), True),
            (f"blk.{i}.attn_k.weight", (shape.kv_heads * head_dim, shape.width), True),
            (f"blk.{i}.attn_v.weight", (shape.kv_heads * head_dim, shape.width), True),
            (f"blk.{i}.attn_output.weight", (shape.width, shape.heads * head_dim), True),
            (f"blk.{i}.ffn_norm.weight", (shape.width,), False),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, shape.width), True),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, shape.width), True),
            (f"blk.{i}.ffn_down.weight", (shape.width, shape.ffn), True),
        ]
    tensors.append(("output_norm.weight", (shape.width,), False))
    if not shape.tied:
        tensors.append(("output.weight", (shape.vocab, shape.width), True))
    for name, dims, half in tensors:
        dtype = np.dtype(np.float16 if half else np.float32)
        count = int(np.prod(dims))
        kind = GGMLQuantizationType.F16 if half else GGMLQuantizationType.F32
        writer.add_tensor_info(name, dims, dtype, count * dtype.itemsize, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, dims, half in tensors:
        if half:
            data = (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
        else:
            data = np.ones(dims, dtype=np.float32)  # RMSNorm weights
        writer.write_tensor_data(data)
        del data
    writer.close()
    out.with_suffix(".partial").rename(out)
    return out


def quantize(binary: Path, f16: Path, out: Path, kind: str) -> Path:
    """`llama-quantize f16 out kind` (into a partial file renamed when whole)."""
    partial = out.with_suffix(".partial")
    subprocess.run([str(binary), str(f16), str(partial), kind], check=True, stdout=subprocess.DEVNULL)
    partial.rename(out)
    return out


def ensure_files(
    root: Path, shape: Shape, kinds: list[str], quantizer: Path, tokenizer_source: Path, keep_f16: bool = False
) -> dict[str, Path]:
    """Each of `kinds` (llama-quantize's names: Q4_K_M, Q8_0) of `shape` under `root`, made where missing."""
    root.mkdir(parents=True, exist_ok=True)
    wanted = {kind: root / f"{shape.name}-shape-{kind}.gguf" for kind in kinds}
    missing = [kind for kind, path in wanted.items() if not path.is_file()]
    if missing:
        f16 = root / f"{shape.name}-shape-F16.gguf"
        made = not f16.is_file()
        if made:
            print(f"writing {f16} (random weights)", flush=True)
            random_gguf(shape, tokenizer_source, f16)
        for kind in missing:
            print(f"quantizing {f16.name} to {kind}", flush=True)
            quantize(quantizer, f16, wanted[kind], kind)
        if made and not keep_f16:
            f16.unlink()
    return wanted


if __name__ == "__main__":
    import sys

    from llmserve.gguf import default_gguf_path

    q = Path(os.environ[QUANTIZE_ENV])
    for name in sys.argv[1:]:
        print(ensure_files(files_root(), SHAPES[name], ["Q4_K_M", "Q8_0"], q, default_gguf_path(), keep_f16=True))
