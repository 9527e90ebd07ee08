"""Tests for llmserve.models.loader: loading models from local folders, GGUFs and random shapes, without any hub.

The GGUF conversion is tested in test_gguf.py, the shape read from a config in tests/engine/types/test_model.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, LlamaConfig, PreTrainedTokenizerFast

from llmserve import cpu_features
from llmserve.engine.types.pooling import PoolingMode
from llmserve.models.loader import from_config, load_model, random_model, resolve_dtype


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|end|>": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|end|>")


@pytest.fixture(scope="module")
def smollm():
    return load_model(None, device="cpu", dtype="float32")


@pytest.mark.real_model
def test_default_model_loads_with_its_chat_template_and_eos(smollm) -> None:
    assert smollm.name == "SmolLM2-135M-Instruct"
    assert smollm.dtype == torch.float32 and smollm.device == torch.device("cpu")
    assert smollm.context_length == 8192 and smollm.vocab_size == 49152
    assert not smollm.model.training
    assert not any(p.requires_grad for p in smollm.model.parameters())
    assert smollm.model.config._attn_implementation == "sdpa"
    tok = smollm.tokenizer
    assert tok is not None
    assert smollm.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.real_model
def test_default_model_answers_greedily(smollm) -> None:
    tok = smollm.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    out = smollm.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids) :])


# --- local folders, random weights, specs -----------------------------------------------------------------


def test_local_folder_loads(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    built = from_config(tiny_llama(), seed=3)
    built.model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    loaded = load_model(folder, device="cpu", dtype="float64")
    assert loaded.name == "tiny-llama"
    assert loaded.dtype == torch.float64 and next(loaded.model.parameters()).dtype == torch.float64
    assert loaded.context_length == 256 and loaded.vocab_size == 64
    assert loaded.eos_token_ids == (3, 2)  # the tokenizer's first, then the generation config's
    assert loaded.tokenizer is not None
    for name, value in built.model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], value.double())


def test_local_folder_without_tokenizer_and_gpt2_positions(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=128, eos_token_id=5)
    from_config(config).model.save_pretrained(folder)
    loaded = load_model(str(folder), device="cpu")
    assert loaded.tokenizer is None
    assert loaded.context_length == 128
    assert loaded.eos_token_ids == (5,)


@pytest.mark.parametrize(
    "spec", ["/no/such/model", "random:no-such-shape", "huggingface/SmolLM2-135M", "not_a_gguf.txt", "empty_dir"]
)
def test_bad_spec_raises(spec: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not_a_gguf.txt").write_text("hi")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError):
        load_model(spec, device="cpu")


def test_dtype_and_device_resolution() -> None:
    amx = cpu_features.at_least(cpu_features.cpu_level(), "avx512_core_amx")
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if amx else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cuda")) == torch.float16
    with pytest.raises(ValueError, match="--dtype float16 on the CPU needs a float16 path"):  # none on any level
        resolve_dtype("float16", torch.device("cpu"))
    # int8: a bfloat16 model whose linears the CPU backend quantizes; CPU only (and AVX512-VNNI or AMX).
    with pytest.raises(ValueError, match="int8 runs on the CPU only"):
        resolve_dtype("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        resolve_dtype("int4", torch.device("cpu"))
    with pytest.raises(ValueError):
        load_model("random:smollm2-135m", device="cpu", dtype="fp8")


def test_auto_is_float32_on_an_amx_cpu_where_adapters_are_served(monkeypatch) -> None:
    """With AMX, auto is bfloat16, which the fused CPU forward serves no adapters in: with LoRA it is float32. A
    dtype asked for by name stays as asked (the backend then refuses bfloat16 with adapters, naming the flag)."""
    monkeypatch.setattr(cpu_features, "cpu_level", lambda environ=None: "avx512_core_amx")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("auto", cpu, lora=True) == torch.float32
    assert resolve_dtype("auto", cuda, lora=True) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu, lora=True) == torch.bfloat16


def test_from_config_is_seeded_and_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a = from_config(tiny_llama(), seed=7).model.state_dict()
    b = from_config(tiny_llama(), seed=7).model.state_dict()
    c = from_config(tiny_llama(), seed=8).model.state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_random_llama_1b_has_a_1b_shape() -> None:
    loaded = random_model("llama-1b", dtype="bfloat16", device="meta")
    n_params = sum(p.numel() for p in loaded.model.parameters())
    assert 1.2e9 < n_params < 1.3e9
    assert loaded.name == "random:llama-1b" and loaded.tokenizer is None
    assert loaded.vocab_size == 128256 and loaded.eos_token_ids == (128001,)


@pytest.mark.real_model
def test_random_smollm2_has_the_real_models_shapes(smollm) -> None:
    loaded = load_model("random:smollm2-135m", device="cpu", dtype="float32")
    assert loaded.name == "random:smollm2-135m" and loaded.tokenizer is None
    real = {k: v.shape for k, v in smollm.model.state_dict().items()}
    fake = {k: v.shape for k, v in loaded.model.state_dict().items()}
    assert fake == real
    assert (loaded.context_length, loaded.vocab_size, loaded.eos_token_ids) == (
        smollm.context_length,
        smollm.vocab_size,
        smollm.eos_token_ids,
    )
    for key in ("rope_parameters", "tie_word_embeddings", "head_dim", "bos_token_id", "pad_token_id"):
        assert getattr(loaded.model.config, key) == getattr(smollm.model.config, key), key
    # The GGUF stores 1e-5 as a float32.
    assert loaded.model.config.rms_norm_eps == pytest.approx(smollm.model.config.rms_norm_eps, rel=1e-6)


def _classifier_folder(tmp_path: Path, kind: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny *ForSequenceClassification checkpoint of `kind` ("llama", "qwen2", "bert") with three named classes."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    labels = {"id2label": {0: "a", 1: "b", 2: "c"}, "label2id": {"a": 0, "b": 1, "c": 2}}
    model: Any
    if kind == "bert":
        bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, **labels)
        model = BertForSequenceClassification(bert)
    else:
        dims = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        dims.update(num_key_value_heads=2, max_position_embeddings=256)
        config = Qwen2Config(**dims, **labels) if kind == "qwen2" else LlamaConfig(**dims, **labels)
        decoder = Qwen2ForSequenceClassification if kind == "qwen2" else LlamaForSequenceClassification
        model = decoder(config)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model.state_dict()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_decoder_classifier_loads_as_a_classifier_over_its_last_token(tmp_path: Path, kind: str) -> None:
    folder, state = _classifier_folder(tmp_path, kind)
    loaded = load_model(folder, device="cpu", dtype="float32")
    assert (loaded.generates, loaded.encoder) == (False, False)
    assert loaded.classifier is not None and loaded.classifier.labels == ("a", "b", "c")
    assert loaded.pooling is not None
    assert (loaded.pooling.mode, loaded.pooling.normalize) == (PoolingMode.LAST, False)
    torch.testing.assert_close(loaded.head.weight, state["score.weight"])
    model = loaded.model  # the causal-LM class over the base; its LM head, never computed, holds no memory of its own
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    card = loaded.card()
    assert (card.generates, card.classifier) == (False, loaded.classifier)
    with pytest.raises(ValueError, match="--pooling does not apply to a classifier"):
        load_model(folder, device="cpu", dtype="float32", pooling="mean")


def test_a_bert_classifier_loads_as_an_encoder_with_its_pooler_and_classifier(tmp_path: Path) -> None:
    folder, state = _classifier_folder(tmp_path, "bert")
    loaded = load_model(folder, device="cpu")
    assert (loaded.generates, loaded.encoder, loaded.dtype) == (False, True, torch.float32)
    assert loaded.classifier is not None and loaded.classifier.labels == ("a", "b", "c")
    assert loaded.pooling is not None and loaded.pooling.mode is PoolingMode.CLS
    torch.testing.assert_close(loaded.head.pooler_weight, state["bert.pooler.dense.weight"])
    torch.testing.assert_close(loaded.head.bias, state["classifier.bias"])


def test_a_classifier_head_the_server_does_not_compute_is_refused_naming_it(tmp_path: Path) -> None:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, pad_token_id=0)
    RobertaForSequenceClassification(config).save_pretrained(tmp_path / "roberta")
    tiny_tokenizer().save_pretrained(tmp_path / "roberta")
    with pytest.raises(ValueError, match="RobertaForSequenceClassification is not served"):
        load_model(tmp_path / "roberta", device="cpu")
