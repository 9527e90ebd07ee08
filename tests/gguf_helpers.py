"""Small GGUF files for the tests, written with the `gguf` package as llama.cpp's converter writes them.

`write_llama_gguf` takes a transformers Llama model (random weights from a tiny config), quantizes each linear to
the type asked (gguf.quants), permutes q/k rows as llama.cpp's converter does (so that the loader must undo it),
and copies the default model's tokenizer fields when asked (then the vocabulary must be the default model's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

Q = GGMLQuantizationType
LINEARS = {  # Hugging Face name in a layer -> llama.cpp's
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: each head's two halves interleaved, rows only."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def round_trip(w: torch.Tensor, kind: GGMLQuantizationType) -> torch.Tensor:
    """`w` quantized to `kind` and back (gguf.quants), float32: the weights a file of that type holds."""
    data = quants.quantize(w.float().numpy(), kind)
    return torch.from_numpy(quants.dequantize(data, kind).astype(np.float32)).reshape(w.shape)


def write_llama_gguf(
    path: Path,
    model: Any,
    kinds: dict[str, GGMLQuantizationType] | None = None,
    default: GGMLQuantizationType = Q.Q8_0,
    tokenizer_from: Path | None = None,
    extra: dict[str, tuple[GGMLQuantizationType, np.ndarray]] | None = None,
    arch: str = "llama",
) -> Path:
    """Write `model` (a transformers LlamaForCausalLM) as llama.cpp would: linears and the embedding in `default`
    or `kinds[llama.cpp tensor name]`, norms F32, q/k permuted; `output.weight` only when untied. `extra`: raw
    tensors (name -> (type, uint8 [rows, bytes of a row])) added as they are."""
    kinds = kinds or {}
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    writer.add_uint32(f"{arch}.rope.dimension_count", config.hidden_size // heads)
    writer.add_float32(f"{arch}.rope.freq_base", float(config.rope_parameters["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    if tokenizer_from is not None:
        for key, field in GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                vtype = field.types[0]
                writer.add_key_value(
                    key, field.contents(), vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None
                )
    state = {k: v.detach().float() for k, v in model.state_dict().items()}

    def add(name: str, w: torch.Tensor, kind: GGMLQuantizationType) -> None:
        array = w.numpy()
        if kind == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        else:
            writer.add_tensor(name, quants.quantize(array, kind), raw_dtype=kind)

    add("token_embd.weight", state["model.embed_tokens.weight"], kinds.get("token_embd.weight", default))
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", state[prefix + "input_layernorm.weight"], Q.F32)
        add(f"blk.{i}.ffn_norm.weight", state[prefix + "post_attention_layernorm.weight"], Q.F32)
        for hf, cpp in LINEARS.items():
            w = state[prefix + hf + ".weight"]
            if cpp in ("attn_q", "attn_k"):
                w = torch.from_numpy(permute(w.numpy(), heads if cpp == "attn_q" else kv_heads))
            name = f"blk.{i}.{cpp}.weight"
            add(name, w, kinds.get(name, default))
    add("output_norm.weight", state["model.norm.weight"], Q.F32)
    if not config.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"], kinds.get("output.weight", default))
    for name, (kind, raw) in (extra or {}).items():
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_loaded(path: Path, config: Any, name: str = "tiny-gguf", activations: str = "float32") -> Any:
    """A LoadedModel over the GGUF at `path` written from a model of `config` (no tokenizer), as
    models.load_gguf_blocks makes one from a real file, its kernels taking `activations` (the server's default:
    float32)."""
    from llmserve.engine.types.model import LoadedModel, ModelShape
    from llmserve.models.gguf_file import GGUFFile
    from llmserve.models.gguf_model import build_model

    file = GGUFFile.open(path)
    model = build_model(file, config)
    eos = (int(config.eos_token_id),)
    shape = ModelShape.of(config)
    return LoadedModel(model, None, name, torch.float32, torch.device("cpu"), shape, eos, "gguf", file, activations)
