"""Batched decoding through ``python -m mlxvlm.server`` as users start it (issue 42):
eight greedy streams at once, on a bfloat16 checkpoint (16-bit weights: every decode step
of up to 8 sequences takes the small-row gemv of cpu/kernels/half_linear.cpp, which gave
the prefill GEMM 5 rows and more before), answer exactly what each request gets alone,
and ``/metrics`` shows that batches of more than 4 sequences were decoded."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import ServerProcess
from test_cpu_kernels import _as_bf16_checkpoint

TOPICS = ("cats", "the sea", "trains", "bread", "rivers", "clocks", "snow", "bridges")


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tmp_path_factory):
    path = _as_bf16_checkpoint(tiny_checkpoints.path("idefics3", "hub"),
                               tmp_path_factory.mktemp("bf16") / "idefics3")
    with ServerProcess("--model", str(path), "--served-model-name", "tiny",
                       "--max-concurrency", "8", "--prompt-cache-size", "0") as live:
        yield live


def answer(server, topic: str) -> str:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions", timeout=300,
        json={"model": "tiny", "temperature": 0, "max_tokens": 32,
              "messages": [{"role": "user", "content": f"Tell me about {topic}."}]})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_eight_streams_at_once_answer_as_each_alone(server):
    alone = [answer(server, topic) for topic in TOPICS]
    assert len(set(alone)) > 1  # different prompts, different answers: rows not mixed up
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = list(pool.map(lambda topic: answer(server, topic), TOPICS))
    assert together == alone
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    peak = re.search(r"^mlxvlm_peak_batch_size(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    assert peak is not None, metrics
    assert float(peak.group(1)) >= 5
