"""Tests for llmserve.models.pooling_config: sentence-transformers' files (as the packaged model ships them, and as
sentence-transformers itself saves a pipeline) read into PoolingConfig; a classifier's head and labels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmserve.engine.types.pooling import ClassifierConfig, DenseModule, PoolingConfig, PoolingMode
from llmserve.models.packaged import extract, find_packaged
from llmserve.models.pooling_config import classifier_from_config, read_classifier_config, read_pooling_config

ST_POOLING = "sentence_transformers.models.Pooling"


def _folder(tmp_path: Path, modules: list[dict[str, Any]], files: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return tmp_path


def _modules(*kinds: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"idx": i, "name": str(i), "path": path, "type": kind} for i, (kind, path) in enumerate(kinds)]


TRANSFORMER = ("sentence_transformers.models.Transformer", "")
POOLING = (ST_POOLING, "1_Pooling")
NORMALIZE = ("sentence_transformers.models.Normalize", "2_Normalize")


def test_the_packaged_minilm() -> None:
    model = find_packaged("all-minilm-l6-v2")
    assert model is not None
    config = read_pooling_config(extract(model))
    assert config == PoolingConfig(PoolingMode.MEAN, normalize=True, hidden_size=384, max_seq_length=256)
    assert config.embedding_size == 384
    assert read_classifier_config(extract(model)) is None


def test_a_pipeline_saved_by_sentence_transformers(tmp_path: Path) -> None:
    """sentence-transformers' own writer: CLS pooling, a Dense projection with tanh, Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    model = find_packaged("all-minilm-l6-v2")
    assert model is not None
    modules = [
        Transformer(str(extract(model)), max_seq_length=128),
        Pooling(384, pooling_mode="cls"),
        Dense(384, 96),
        Dense(96, 64, bias=False, activation_function=None),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    config = read_pooling_config(tmp_path / "st")
    assert config is not None
    assert (config.mode, config.normalize, config.hidden_size, config.max_seq_length) == (
        PoolingMode.CLS,
        True,
        384,
        128,
    )
    assert [(d.in_features, d.out_features, d.bias, d.activation) for d in config.dense] == [
        (384, 96, True, "tanh"),
        (96, 64, False, "identity"),
    ]
    assert all((d.folder / "config.json").is_file() for d in config.dense)
    assert config.embedding_size == 64


@pytest.mark.parametrize(
    ("pooling", "mode"),
    [
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, PoolingMode.CLS),
        ({"pooling_mode_mean_tokens": True}, PoolingMode.MEAN),
        ({"pooling_mode_lasttoken": True}, PoolingMode.LAST),
        ({"pooling_mode_max_tokens": True}, PoolingMode.MAX),
        ({}, PoolingMode.MEAN),  # sentence-transformers' default
        ({"pooling_mode": "lasttoken"}, PoolingMode.LAST),
        ({"pooling_mode": ["cls"]}, PoolingMode.CLS),
    ],
)
def test_pooling_modes_old_and_new(tmp_path: Path, pooling: dict[str, Any], mode: PoolingMode) -> None:
    folder = _folder(
        tmp_path,
        _modules(TRANSFORMER, POOLING),
        {"1_Pooling/config.json": {"word_embedding_dimension": 8, **pooling}},
    )
    assert read_pooling_config(folder) == PoolingConfig(mode, normalize=False, hidden_size=8)


@pytest.mark.parametrize(
    ("modules", "files", "message"),
    [
        (
            [TRANSFORMER, POOLING],
            {"1_Pooling/config.json": {"embedding_dimension": 8, "pooling_mode": ["cls", "mean"]}},
            "concatenated",
        ),
        (
            [TRANSFORMER, POOLING],
            {"1_Pooling/config.json": {"embedding_dimension": 8, "pooling_mode": "weightedmean"}},
            "not served",
        ),
        ([TRANSFORMER, POOLING], {"1_Pooling/config.json": {"pooling_mode": "mean"}}, "embedding_dimension"),
        ([TRANSFORMER, POOLING], {}, "missing"),
        ([TRANSFORMER], {}, "no Pooling"),
        (
            [TRANSFORMER, POOLING, ("sentence_transformers.models.LSTM", "2_LSTM")],
            {"1_Pooling/config.json": {"embedding_dimension": 8}},
            "LSTM",
        ),
        (
            [TRANSFORMER, POOLING, NORMALIZE, ("sentence_transformers.models.Dense", "3_Dense")],
            {"1_Pooling/config.json": {"embedding_dimension": 8}},
            "after Normalize",
        ),
        (
            [TRANSFORMER, POOLING, ("sentence_transformers.models.Dense", "2_Dense")],
            {
                "1_Pooling/config.json": {"embedding_dimension": 8},
                "2_Dense/config.json": {"in_features": 8, "out_features": 4, "activation_function": "my.Swish"},
            },
            "activation",
        ),
        (
            [TRANSFORMER, POOLING, ("sentence_transformers.models.Dense", "2_Dense")],
            {
                "1_Pooling/config.json": {"embedding_dimension": 8},
                "2_Dense/config.json": {"in_features": 6, "out_features": 4},
            },
            "in_features 6",
        ),
    ],
)
def test_pipelines_not_served_are_refused(
    tmp_path: Path, modules: list[tuple[str, str]], files: dict[str, Any], message: str
) -> None:
    folder = _folder(tmp_path, _modules(*modules), files)
    with pytest.raises(ValueError, match=message):
        read_pooling_config(folder)


def test_no_modules_json_is_no_pipeline(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path) is None


def test_dense_defaults(tmp_path: Path) -> None:
    folder = _folder(
        tmp_path,
        _modules(TRANSFORMER, POOLING, ("sentence_transformers.base.modules.Dense", "2_Dense"), NORMALIZE),
        {
            "1_Pooling/config.json": {"embedding_dimension": 8},
            "2_Dense/config.json": {"in_features": 8, "out_features": 4},
            "sentence_bert_config.json": {"max_seq_length": 32, "do_lower_case": True},
        },
    )
    config = read_pooling_config(folder)
    assert config == PoolingConfig(
        PoolingMode.MEAN,
        normalize=True,
        hidden_size=8,
        dense=(DenseModule(folder / "2_Dense", 8, 4, True, "identity"),),
        max_seq_length=32,
        do_lower_case=True,
    )


@pytest.mark.parametrize(("name", "mode"), [("cls", "cls"), ("MEAN", "mean"), ("last", "last"), ("lasttoken", "last")])
def test_pooling_flag_names(name: str, mode: str) -> None:
    assert PoolingMode.parse(name) is PoolingMode(mode)


def test_an_unknown_pooling_flag_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown pooling 'first'"):
        PoolingMode.parse("first")


def test_classifiers_from_transformers_configs(tmp_path: Path) -> None:
    from transformers import BertConfig, LlamaConfig

    bert = BertConfig(
        num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"}, architectures=["BertForSequenceClassification"]
    )
    bert.save_pretrained(tmp_path)
    assert read_classifier_config(tmp_path) == ClassifierConfig(
        "BertForSequenceClassification", ("neg", "neu", "pos"), PoolingMode.CLS
    )
    llama = LlamaConfig(num_labels=2, architectures=["LlamaForSequenceClassification"])
    assert classifier_from_config(llama.to_dict()) == ClassifierConfig(
        "LlamaForSequenceClassification", ("LABEL_0", "LABEL_1"), PoolingMode.LAST
    )
    assert classifier_from_config({"architectures": ["LlamaForCausalLM"]}) is None
    with pytest.raises(ValueError, match="without classes"):
        classifier_from_config({"architectures": ["BertForSequenceClassification"], "num_labels": 0})


def test_instruction_prompts_are_read_in_order_and_checked(tmp_path: Path) -> None:
    pooling = {"1_Pooling/config.json": {"embedding_dimension": 8}}
    prompts = {"query": "query: ", "passage": "passage: "}
    files = {**pooling, "config_sentence_transformers.json": {"prompts": prompts, "default_prompt_name": "query"}}
    config = read_pooling_config(_folder(tmp_path / "a", _modules(TRANSFORMER, POOLING), files))
    assert config is not None
    assert (config.prompts, config.default_prompt_name) == ((("query", "query: "), ("passage", "passage: ")), "query")
    plain = read_pooling_config(_folder(tmp_path / "b", _modules(TRANSFORMER, POOLING), pooling))
    assert plain is not None and (plain.prompts, plain.default_prompt_name) == ((), "")
    for name, content, message in [
        ("c", {"prompts": prompts, "default_prompt_name": "document"}, "not one of its prompts"),
        ("d", {"prompts": {"query": 1}}, "map names to strings"),
    ]:
        bad = {**pooling, "config_sentence_transformers.json": content}
        with pytest.raises(ValueError, match=message):
            read_pooling_config(_folder(tmp_path / name, _modules(TRANSFORMER, POOLING), bad))
    without_prompt = {
        "1_Pooling/config.json": {"embedding_dimension": 8, "include_prompt": False},
        "config_sentence_transformers.json": {"prompts": prompts},
    }
    with pytest.raises(ValueError, match="include_prompt"):
        read_pooling_config(_folder(tmp_path / "e", _modules(TRANSFORMER, POOLING), without_prompt))
