"""Reading adapters in the PEFT format: what PEFT saved comes back with PEFT's own scaling, and every adapter that
does not fit the served model, or is not there, or is damaged, is refused with a message naming the file and what
does not fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.engine.lora.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterNotFound,
    AdapterRefused,
    projection_shapes,
    read_adapter,
)
from llmserve.engine.types.model import LoadedModel
from llmserve.models.loader import from_config
from tests.engine.lora.peft_adapters import ALL_TARGETS, make_adapter
from tests.testing import tiny_config


def test_what_peft_saved_reads_back_with_peft_scaling(tiny: LoadedModel, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    config = dict(
        r=4,
        lora_alpha=8,
        target_modules=ALL_TARGETS,
        init_lora_weights=False,
        rank_pattern={"down_proj": 2},
        alpha_pattern={"layers.1.self_attn.q_proj": 3},
    )
    made = make_adapter(tiny.model, tmp_path / "a", seed=1, merge=False, **config)
    adapter = read_adapter(made.folder, tiny.shape, max_rank=4)
    assert len(adapter.modules) == 2 * 7 and adapter.rank == 4 and adapter.target_modules == set(ALL_TARGETS)
    # PEFT's own layers, built again from the same seed, carry the factors and the scaling PEFT applies.
    import copy

    with torch.random.fork_rng():
        torch.manual_seed(1)
        peft_model = get_peft_model(copy.deepcopy(tiny.model), LoraConfig(**config))
    for (layer, name), module in adapter.modules.items():
        parent = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        lora_layer = getattr(getattr(peft_model.base_model.model.model.layers[layer], parent), name)
        assert torch.equal(module.a, lora_layer.lora_A["default"].weight)
        assert torch.equal(module.b, lora_layer.lora_B["default"].weight)
        assert module.scale == lora_layer.scaling["default"]
    assert adapter.modules[1, "q_proj"].scale == 3 / 4  # alpha_pattern
    assert adapter.modules[0, "down_proj"].scale == 8 / 2 and adapter.modules[0, "down_proj"].rank == 2
    assert adapter.nbytes == sum(m.a.nbytes + m.b.nbytes for m in adapter.modules.values())


def test_rslora_scales_by_the_square_root_of_the_rank(tiny: LoadedModel, tmp_path: Path) -> None:
    made = make_adapter(tiny.model, tmp_path / "a", seed=2, merge=False, r=4, lora_alpha=6, use_rslora=True)
    adapter = read_adapter(made.folder, tiny.shape, max_rank=8)
    assert {m.scale for m in adapter.modules.values()} == {6 / math.sqrt(4)}


def test_the_digest_is_the_files_identity(tiny: LoadedModel, tmp_path: Path) -> None:
    one = make_adapter(tiny.model, tmp_path / "one", seed=3, merge=False, r=2)
    same = make_adapter(tiny.model, tmp_path / "same", seed=3, merge=False, r=2)
    other = make_adapter(tiny.model, tmp_path / "other", seed=4, merge=False, r=2)
    digest = read_adapter(one.folder, tiny.shape, 8).digest
    assert len(digest) == 32
    assert read_adapter(same.folder, tiny.shape, 8).digest == digest  # the same bytes in another folder
    assert read_adapter(other.folder, tiny.shape, 8).digest != digest


def test_projection_shapes_are_the_models_linears(tiny: LoadedModel) -> None:
    layer = tiny.model.model.layers[0]
    for name, (fan_in, fan_out) in projection_shapes(tiny.shape).items():
        linear = getattr(layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, name)
        assert (linear.in_features, linear.out_features) == (fan_in, fan_out)


# -- refused --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good adapter (rank 4, all targets) that the refusal tests copy and damage."""
    return make_adapter(tiny.model, tmp_path_factory.mktemp("good") / "a", seed=5, merge=False, r=4).folder


def _copy(folder: Path, to: Path) -> Path:
    to.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (to / name).write_bytes((folder / name).read_bytes())
    return to


def _refused(folder: Path, shape: object, match: str, max_rank: int = 8, kind: type = AdapterRefused) -> None:
    with pytest.raises(kind, match=match) as info:
        read_adapter(folder, shape, max_rank)  # type: ignore[arg-type]
    assert str(folder) in info.value.path


def test_missing_folder_and_files(saved: Path, tiny: LoadedModel, tmp_path: Path) -> None:
    _refused(tmp_path / "nowhere", tiny.shape, "no such adapter folder", kind=AdapterNotFound)
    no_config = _copy(saved, tmp_path / "no_config")
    (no_config / CONFIG_FILE).unlink()
    _refused(no_config, tiny.shape, f"{CONFIG_FILE}: missing", kind=AdapterNotFound)
    pickled = _copy(saved, tmp_path / "pickled")
    (pickled / WEIGHTS_FILE).rename(pickled / "adapter_model.bin")
    _refused(pickled, tiny.shape, f"{WEIGHTS_FILE}: missing .adapter_model.bin is there", kind=AdapterNotFound)


def test_damaged_files(saved: Path, tiny: LoadedModel, tmp_path: Path) -> None:
    bad_json = _copy(saved, tmp_path / "json")
    (bad_json / CONFIG_FILE).write_text('{"r": 4, ')
    _refused(bad_json, tiny.shape, f"{CONFIG_FILE}: cannot be read as JSON")
    truncated = _copy(saved, tmp_path / "truncated")
    data = (truncated / WEIGHTS_FILE).read_bytes()
    (truncated / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    _refused(truncated, tiny.shape, f"{WEIGHTS_FILE}: cannot be read as safetensors")
    not_peft = _copy(saved, tmp_path / "not_peft")
    (not_peft / CONFIG_FILE).write_text(json.dumps({"hello": 1}))
    _refused(not_peft, tiny.shape, f"{CONFIG_FILE}: not a PEFT adapter config")
    nan = _copy(saved, tmp_path / "nan")
    factors = load_file(nan / WEIGHTS_FILE)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    factors[key][0, 0] = float("nan")
    save_file(factors, nan / WEIGHTS_FILE)
    _refused(nan, tiny.shape, "module model.layers.1.mlp.up_proj: non-finite values")
    half = _copy(saved, tmp_path / "half")
    factors = load_file(half / WEIGHTS_FILE)
    del factors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    save_file(factors, half / WEIGHTS_FILE)
    _refused(half, tiny.shape, "module model.layers.0.self_attn.k_proj: lora_B is missing")
    lied = _copy(saved, tmp_path / "lied")
    config = json.loads((lied / CONFIG_FILE).read_text())
    (lied / CONFIG_FILE).write_text(json.dumps({**config, "r": 8}))
    _refused(lied, tiny.shape, f"rank 4 in the weights, 8 in {CONFIG_FILE}")


def test_rank_above_the_limit_names_the_module_and_the_rank(saved: Path, tiny: LoadedModel) -> None:
    _refused(saved, tiny.shape, r"module model.layers.0.self_attn.q_proj: rank 4 is above --max-lora-rank 2", 2)


def test_another_models_shape_names_the_module_and_the_shapes(tiny: LoadedModel, tmp_path: Path) -> None:
    wider = from_config(tiny_config("llama").__class__(**{**tiny_config("llama").to_dict(), "hidden_size": 96}))
    made = make_adapter(wider.model, tmp_path / "wide", seed=6, merge=False, r=2)
    _refused(made.folder, tiny.shape, r"module model.layers.0.self_attn.q_proj: lora_A \(2, 96\) .* \(64 -> 64\)")
    deeper = from_config(tiny_config("llama").__class__(**{**tiny_config("llama").to_dict(), "num_hidden_layers": 3}))
    made = make_adapter(deeper.model, tmp_path / "deep", seed=6, merge=False, r=2, target_modules=["v_proj"])
    _refused(made.folder, tiny.shape, r"layers.2.self_attn.v_proj.lora_A.weight: layer 2, but the served model has 2")


def test_modules_and_methods_that_are_not_served(tiny: LoadedModel, tmp_path: Path) -> None:
    head = make_adapter(tiny.model, tmp_path / "head", seed=7, merge=False, r=2, target_modules=["q_proj", "lm_head"])
    _refused(
        head.folder, tiny.shape, r"tensor base_model.model.lm_head\.\S+: not a LoRA factor of a Llama-family projection"
    )
    dora = make_adapter(tiny.model, tmp_path / "dora", seed=7, merge=False, r=2, use_dora=True)
    _refused(dora.folder, tiny.shape, f"{CONFIG_FILE}: use_dora is set")
    saved_too = make_adapter(tiny.model, tmp_path / "mts", seed=7, merge=False, r=2, modules_to_save=["lm_head"])
    _refused(saved_too.folder, tiny.shape, f"{CONFIG_FILE}: modules_to_save is set")
    biased = make_adapter(tiny.model, tmp_path / "bias", seed=7, merge=False, r=2, bias="lora_only")
    _refused(biased.folder, tiny.shape, f"{CONFIG_FILE}: bias 'lora_only'")
