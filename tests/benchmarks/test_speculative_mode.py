"""benchmarks/modes/speculative.py without servers: its workloads' prompts are all distinct, a server is never sent
a prompt twice (the suffix cache could otherwise have learned the very answer), every server of a round gets the
same prompts in the same order, and the page is built from a run's JSON alone."""

from __future__ import annotations

import pytest

from benchmarks import spec_workloads
from benchmarks.modes import speculative


@pytest.mark.parametrize("workload", speculative.WORKLOADS)
def test_a_workload_has_hundreds_of_distinct_prompts(workload: str) -> None:
    prompts = [repr(sorted(options.items())) for options in speculative.requests_of(workload)]
    assert len(prompts) >= 400 and len(set(prompts)) == len(prompts)


def test_edit_prompts_use_each_text_once() -> None:
    texts = [prompt.split("\n\n", 1)[1] for prompt in spec_workloads.edit_prompts()]
    assert len(set(texts)) == len(texts)


def test_a_server_is_never_sent_a_prompt_twice_and_a_round_starts_alike() -> None:
    feed = speculative.Feed("chat", [{"n": i} for i in range(20)])
    sent: dict[str, list[int]] = {"off": [], "ngram": [], "suffix": []}
    for taken in ([3, 5, 2], [4, 1, 6]):
        for system, n in zip(sent, taken, strict=True):
            take = feed.window()
            sent[system] += [take()["n"] for _ in range(n)]
        feed.next_round()
    assert sent["off"] == [0, 1, 2, 5, 6, 7, 8]  # the second round starts past the first's furthest (5)
    assert sent["ngram"] == [0, 1, 2, 3, 4, 5]
    assert sent["suffix"] == [0, 1, 5, 6, 7, 8, 9, 10]
    take = feed.window()
    with pytest.raises(RuntimeError, match="a repeat would follow"):
        for _ in range(10):
            take()


def test_the_page_comes_from_the_json() -> None:
    window = {"tokens_per_s": 10.0, "per_stream_tokens_per_s": 10.0, "decode_rate_median": 12.0, "requests": 2}
    counters = {name: 4.0 for name in speculative.SPEC_COUNTERS} | {"k_chosen": {"2": 3.0}}
    cell = {
        "workload": "edit",
        "clients": 1,
        "windows": [
            window | {"system": "off", "spec": None},
            window | {"system": "ngram", "spec": counters, "tokens_per_s": 20.0},
            window | {"system": "suffix", "spec": counters, "tokens_per_s": 30.0},
        ],
    }
    speculative.summarise(cell, ["off", "ngram", "suffix"])
    assert cell["methods"]["ngram"]["ratio"] == 2.0 and cell["methods"]["suffix"]["ratio_per_round"] == [3.0]
    assert cell["methods"]["suffix"]["acceptance_rate"] == 1.0 and cell["methods"]["suffix"]["off_share"] == 0.5
    result = {
        "systems": ["off", "ngram", "suffix"],
        "window_s": 10.0,
        "warmup_s": 2.0,
        "max_new_tokens": 128,
        "prompts": {"edit": 525},
        "cells": [cell],
    }
    page = "\n".join(speculative.section(result))
    assert "**2.00x** (2.00)" in page and "**3.00x** (3.00)" in page and "2:3" in page
