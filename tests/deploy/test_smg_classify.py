"""smg's /v1/classify through the real gateway (deploy/smg/launch.sh) to a real llmserve replica serving a tiny
LlamaForSequenceClassification from its folder (`python -m llmserve --model DIR --dtype float32`, engine process):
smg sees `is_generation` false, sends each text to the vLLM protocol's Embed (api/vllm_servicer.py), reads the vector
as logits and applies softmax; its probabilities are transformers' own, its label the reference's top class.

vLLM's GetModelInfo has no field for id2label, so smg names the classes LABEL_i whatever the model's config says
(llmserve.v1's Embed returns the config's labels): the model here keeps transformers' default labels, which are those.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.classifier_models import reference_logits, save_llama_classifier
from tests.deploy.replicas import Replica, serving
from tests.deploy.smg import Smg, smg_binary

pytestmark = pytest.mark.skipif(smg_binary() is None, reason="smg (the gateway extra) is not installed")

TEXTS = ["A cat sat on the mat.", "I did not like this film at all.", "Prices rose sharply in the third quarter."]
LABELS = {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_classifier(tmp_path_factory.mktemp("classifier"), LABELS)


@pytest.fixture(scope="module")
def replica(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    logs = tmp_path_factory.mktemp("logs")
    with serving(Replica("classify", logs, "--dtype", "float32", model=str(folder))) as (node,):
        yield node


def _classify(smg: Smg, model: str, text: str) -> dict[str, object]:
    body = json.dumps({"model": model, "input": text}).encode()
    request = urllib.request.Request(smg.url + "/v1/classify", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, object] = json.loads(response.read())
    return answer


def test_classify_returns_the_references_probabilities_and_label(gateway: tuple[Smg, str], folder: Path) -> None:
    smg, model = gateway
    want = torch.softmax(reference_logits(folder, TEXTS), dim=-1)
    for text, probabilities in zip(TEXTS, want, strict=True):
        answer = _classify(smg, model, text)
        (data,) = answer["data"]  # type: ignore[misc]
        assert data["num_classes"] == 3
        assert (torch.tensor(data["probs"]) - probabilities).abs().max().item() <= 1e-4
        assert data["label"] == LABELS[int(probabilities.argmax())]
        assert answer["usage"]["prompt_tokens"] > 0  # type: ignore[index]
