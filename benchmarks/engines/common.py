"""What every engine driver shares: arguments, the stopwatch around a token stream, and
the JSON line it prints (the fields of ``mlxvlm.benchmark.RunStats``)."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--image", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--dtype", default="float32",
                        help="transformers' weights (the other engines keep the checkpoint's)")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=None,
                        help="mlxvlm only: speculative decoding by prompt lookup")
    return parser.parse_args()


def max_rss_gb() -> float:
    kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kilobytes * (1 if sys.platform == "darwin" else 1024) / 1e9


class Stopwatch:
    """Marks the start of a request and the arrival of each generated token."""

    def __init__(self):
        self.start = time.perf_counter()
        self.token_times: list[float] = []

    def token(self) -> None:
        self.token_times.append(time.perf_counter())

    def report(self, engine: str, load_s: float, prompt_tokens: int, peak_memory_gb: float) -> None:
        first, last = self.token_times[0], self.token_times[-1]
        ttft = first - self.start
        decode_s = last - first
        n = len(self.token_times)
        print(json.dumps({
            "engine": engine,
            "load_s": load_s,
            "ttft_s": ttft,
            "prompt_tokens": prompt_tokens,
            "prompt_tps": prompt_tokens / ttft,
            "decode_tokens": n,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 else 0.0,
            "peak_memory_gb": peak_memory_gb,
            "max_rss_gb": max_rss_gb(),
        }), flush=True)
