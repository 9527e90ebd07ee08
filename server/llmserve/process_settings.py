"""Process-wide settings, made once by whoever owns the process (`python -m llmserve`, the benchmark, the test
session), before torch is imported. No module of llmserve changes process-wide state when it is imported."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from llmserve import cpu_features


def configure_process(environ: MutableMapping[str, str] = os.environ, *, shared_cores: bool = False) -> None:
    """Never reach a model hub; bounded oneDNN primitive caches; a LLMSERVE_CPU_ISA cap handed to oneDNN
    (cpu_features.cap_onednn; raises cpu_features.IsaError for an unknown level); with `shared_cores`, a short
    OpenMP spin.

    How long idle OpenMP threads spin before they sleep: a model forward is hundreds of short parallel regions;
    threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) pay a wake-up in each, threads that spin long collapse
    when anything else wants the cores. Measured on the 2-core machine, SmolLM2-135M decode step at 32 sequences,
    quiet / with one competing busy process: PASSIVE 222 / 236 ms, GOMP_SPINCOUNT=3000 139 / 285 ms, 30000 134 /
    831 ms, 100000 151 / 1,429 ms. The served process keeps libgomp's own spin: `python -m llmserve` at 32 gRPC
    clients, nothing else running, four alternated rounds (2026-12-01, results/2026-12-01-cpu-engine-process.md):
    median window 84.5 output tokens/s with libgomp's default against 74.3 with 3000 (no 3000 window above 80.6),
    so the short spin does not pay where the server has its cores. Where processes share the cores (the test
    session's two workers) `shared_cores` keeps the short spin. libgomp reads it when torch loads it, hence before
    torch is imported; an explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins (PASSIVE suits a shared
    machine).
    """
    environ["HF_HUB_OFFLINE"] = "1"
    cpu_features.cap_onednn(environ)
    if shared_cores and "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", "3000")
    # The packed CPU linears build a oneDNN primitive per row count, kept by ideep's cache and oneDNN's, 1,024
    # entries each by default: a server seeing ever new batch sizes grew ~11 KiB per call until both were full
    # (~1.5 GiB for SmolLM2-135M's layers over row counts 1-512; 574 -> 702 MiB over a 180-s soak). 256 entries
    # bound that near 0.3 GiB at no measurable cost (rows 1-64: 14.3 s vs 13.8 s uncapped; 64 entries: 18.8 s).
    environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    environ.setdefault("LRU_CACHE_CAPACITY", "256")
