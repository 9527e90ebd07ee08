"""Speculative decoding as a caller meets it: the server over gRPC with its engine process (as `python -m llmserve`
runs it), `--speculative ngram` against `off`: the same text, token ids, finish reasons and usage for greedy and
seeded calls, stop strings included, and the speculation counters on /metrics. The tiny random model loops, which
prompt lookup catches; a flat cost table makes verification free, so the load rule drafts what is offered."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from harness import ServerThread, tiny_engine
from prometheus_client.parser import text_string_to_metric_families

from llmserve_client import Client

PROMPTS = ["the cat sat on the mat " * 6, "one two three four five six seven eight nine ten", "a b a b a b a b"]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def calls(address: str) -> list[tuple[str, list[int], int, int]]:
    out = []
    with Client(address, timeout=120) as client:
        for i, prompt in enumerate(PROMPTS):
            for options in (
                {},
                {"temperature": 0.9, "top_k": 2, "seed": 11 + i},
                {"stop": ["the", "five"], "include_stop_sequence": True},
            ):
                responses = list(client.generate(prompt, max_new_tokens=48, return_token_ids=True, **options))
                final = responses[-1]
                text = "".join(r.text for r in responses)
                ids = [t for r in responses for t in r.token_ids]
                out.append((text, ids, final.finish_reason, final.usage.completion_tokens))
    return out


def serve(tmp_path: Path, speculative: str) -> tuple[list, dict[str, float]]:
    table = tmp_path / "free.json"
    rows = [{"batch": b, "k": k, "forward_ms": 10.0} for b in (1, 16) for k in (0, 8)]
    table.write_text(json.dumps({"rows": rows}))
    extra = {} if speculative == "off" else {"speculative": speculative, "speculative_cost_table": str(table)}
    srv = ServerThread(tiny_engine(**extra), metrics=True).start()  # the engine in a process of its own
    try:
        return calls(srv.address), scrape(srv.metrics_port)
    finally:
        srv.stop()


def test_speculation_over_grpc_sends_what_the_server_without_it_sends(tmp_path: Path) -> None:
    plain, plain_metrics = serve(tmp_path, "off")
    fast, metrics = serve(tmp_path, "ngram")
    assert fast == plain
    assert "llmserve_spec_proposed_tokens_total" not in plain_metrics
    proposed, accepted = metrics["llmserve_spec_proposed_tokens_total"], metrics["llmserve_spec_accepted_tokens_total"]
    assert proposed > 0 and 0 < accepted <= proposed
    assert metrics["llmserve_spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    emitted = metrics["llmserve_spec_emitted_tokens_total"]
    assert (
        metrics["llmserve_spec_verifying_sequences_total"]
        < emitted
        <= accepted + metrics["llmserve_spec_verifying_sequences_total"]
    )
