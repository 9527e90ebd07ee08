"""What a model folder says about pooling: sentence-transformers' files read into a typed `PoolingConfig`, and a
sequence classifier's head and labels read from config.json into a `ClassifierConfig`. Torch-free: plain JSON.

sentence-transformers describes an embedding model as a pipeline in modules.json: a Transformer (the model in the
folder itself), a Pooling module (1_Pooling/config.json), optional Dense projections, an optional Normalize.
Everything the server cannot reproduce exactly (several pooling modes concatenated, weighted-mean pooling, an
unknown module or activation) is refused with ValueError naming the file, never silently served differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmserve.engine.types.pooling import DENSE_ACTIVATIONS, ClassifierConfig, DenseModule, PoolingConfig, PoolingMode

MODULES_FILE = "modules.json"
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"
PROMPTS_CONFIG = "config_sentence_transformers.json"

# The legacy config's flags (sentence-transformers < 5), in the order of its concatenation.
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# transformers writes model_max_length = int(1e30) for a tokenizer without a limit.
_NO_LIMIT = 1 << 40
# Architectures whose classifier pools the first token (BERT's pooler over [CLS]); other
# *ForSequenceClassification heads (Llama, Qwen, Mistral...) score the last token.
_FIRST_TOKEN_CLASSIFIERS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "electra", "camembert"})


def read_pooling_config(folder: str | Path) -> PoolingConfig | None:
    """The sentence-transformers pipeline of `folder`, or None when it has no modules.json.

    ValueError, naming the file, for a pipeline the server cannot reproduce exactly.
    """
    folder = Path(folder)
    modules_file = folder / MODULES_FILE
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    pooling: tuple[PoolingMode, int, bool] | None = None
    transformer = folder
    dense: list[DenseModule] = []
    normalize = False
    for entry in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        path = folder / str(entry.get("path", ""))
        where = f"{modules_file} ({kind} at {entry.get('path', '')!r})"
        if normalize:
            raise ValueError(f"{where}: a module after Normalize is not served")
        if kind == "Transformer":
            if pooling is not None:
                raise ValueError(f"{where}: a Transformer after Pooling is not served")
            transformer = path
        elif kind == "Pooling":
            if pooling is not None:
                raise ValueError(f"{where}: a second Pooling module is not served")
            pooling = _read_pooling(path / "config.json")
        elif kind == "Dense":
            if pooling is None:
                raise ValueError(f"{where}: a Dense module before Pooling is not served")
            dense.append(_read_dense(path))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{where}: module {entry.get('type')!r} is not served")
    if pooling is None:
        raise ValueError(f"{modules_file}: no Pooling module")
    mode, hidden, include_prompt = pooling
    prompts, default_prompt_name = _read_prompts(folder / PROMPTS_CONFIG)
    if prompts and not include_prompt:
        raise ValueError(f"{modules_file}: pooling without the prompt's tokens (include_prompt false) is not served")
    width = hidden
    for layer in dense:
        if layer.in_features != width:
            raise ValueError(f"{layer.folder}: in_features {layer.in_features}, but the vector before it has {width}")
        width = layer.out_features
    st_config = _read_optional_json(transformer / SENTENCE_BERT_CONFIG)
    return PoolingConfig(
        mode=mode,
        normalize=normalize,
        hidden_size=hidden,
        dense=tuple(dense),
        max_seq_length=_max_seq_length(transformer, st_config),
        do_lower_case=bool(st_config.get("do_lower_case", False)),
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        include_prompt=include_prompt,
    )


def _read_prompts(config_file: Path) -> tuple[tuple[tuple[str, str], ...], str]:
    """config_sentence_transformers.json's instruction prompts, (name, text) in the file's order, and its
    default_prompt_name ("" for none); none when the file is absent. ValueError naming the file for a prompt that is
    not a string or a default that names no prompt (sentence-transformers refuses that one too)."""
    config = _read_optional_json(config_file)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{config_file}: prompts must map names to strings")
    default = config.get("default_prompt_name") or ""
    if default and default not in prompts:
        raise ValueError(f"{config_file}: default_prompt_name {default!r} is not one of its prompts")
    return tuple((str(name), text) for name, text in prompts.items()), str(default)


def _max_seq_length(transformer: Path, st_config: dict[str, Any]) -> int | None:
    """sentence-transformers' input limit: sentence_bert_config.json's max_seq_length (releases before 6), else
    the tokenizer's model_max_length (where 6 saves it), unless that is transformers' "no limit" sentinel."""
    limit = st_config.get("max_seq_length")
    if limit is None:
        limit = _read_optional_json(transformer / "tokenizer_config.json").get("model_max_length")
    if limit is None or int(limit) >= _NO_LIMIT:
        return None
    return int(limit)


def read_classifier_config(folder: str | Path) -> ClassifierConfig | None:
    """The sequence-classification head `folder`'s config.json declares, or None when its architecture is not
    a `*ForSequenceClassification`. Labels come from id2label by class index ("LABEL_i" where it has none)."""
    config_file = Path(folder) / "config.json"
    config = _read_json(config_file)
    return classifier_from_config(config, str(config_file))


def classifier_from_config(config: dict[str, Any], where: str = "config") -> ClassifierConfig | None:
    """As read_classifier_config, from config.json's parsed contents."""
    architectures = config.get("architectures") or []
    architecture = next((a for a in architectures if str(a).endswith("ForSequenceClassification")), None)
    if architecture is None:
        return None
    # JSON's keys are strings, a PretrainedConfig's dict has integers.
    by_index = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    count = int(config.get("num_labels", len(by_index) or 2))
    if count < 1:
        raise ValueError(f"{where}: a classifier without classes")
    labels = [by_index.get(index, f"LABEL_{index}") for index in range(count)]
    model_type = str(config.get("model_type", ""))
    pooling = PoolingMode.CLS if model_type in _FIRST_TOKEN_CLASSIFIERS else PoolingMode.LAST
    return ClassifierConfig(str(architecture), tuple(labels), pooling)


def _read_pooling(config_file: Path) -> tuple[PoolingMode, int, bool]:
    config = _read_json(config_file)
    hidden = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if hidden is None:
        raise ValueError(f"{config_file}: no embedding_dimension")
    names = config.get("pooling_mode")
    if names is None:
        names = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
    if isinstance(names, str):
        names = [names]
    if len(names) != 1:
        raise ValueError(f"{config_file}: several pooling modes concatenated ({', '.join(names)}) are not served")
    try:
        mode = PoolingMode.parse(str(names[0]))
    except ValueError:
        raise ValueError(
            f"{config_file}: pooling mode {names[0]!r} is not served (cls, mean, lasttoken, max)"
        ) from None
    return mode, int(hidden), bool(config.get("include_prompt", True))


def _read_dense(folder: Path) -> DenseModule:
    config_file = folder / "config.json"
    config = _read_json(config_file)
    if config.get("use_residual", False):
        raise ValueError(f"{config_file}: a residual Dense module is not served")
    if config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        raise ValueError(f"{config_file}: a Dense module over token embeddings is not served")
    path = str(config.get("activation_function") or "torch.nn.modules.linear.Identity")
    activation = path.rsplit(".", 1)[-1].lower()
    if not path.startswith("torch.") or activation not in DENSE_ACTIVATIONS:
        raise ValueError(f"{config_file}: activation {path!r} is not served ({', '.join(sorted(DENSE_ACTIVATIONS))})")
    try:
        in_features, out_features = int(config["in_features"]), int(config["out_features"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{config_file}: needs integer in_features and out_features") from None
    return DenseModule(folder, in_features, out_features, bool(config.get("bias", True)), activation)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    config = _read_json(path)
    return config if isinstance(config, dict) else {}
