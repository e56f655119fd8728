"""``GET /metrics`` in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

from mlxvlm.server.service import GenerationService

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")


def render_metrics(service: GenerationService) -> str:
    stats = service.engine.stats
    counters = service.counters
    lines: list[str] = []
    m = lambda *args: _metric(lines, *args)  # noqa: E731
    m("mlxvlm_requests_total", "counter", "HTTP requests answered, by status",
      [({"status": str(code)}, n) for code, n in sorted((counters.by_status or {}).items())])
    m("mlxvlm_requests_rejected_busy_total", "counter",
      "Requests refused with 429 because the queue was full", [({}, counters.rejected_busy)])
    m("mlxvlm_requests_in_flight", "gauge",
      "Requests admitted and not finished (preparing, queued or generating)",
      [({}, service.in_flight)])
    m("mlxvlm_queue_depth", "gauge", "Requests waiting for a batch slot", [({}, stats.waiting)])
    m("mlxvlm_active_sequences", "gauge", "Requests being prefilled or decoded",
      [({}, stats.active)])
    m("mlxvlm_peak_batch_size", "gauge", "The most requests decoded together so far",
      [({}, stats.peak_batch_size)])
    m("mlxvlm_sequences_finished_total", "counter", "Requests that generated to the end",
      [({}, stats.requests_finished)])
    m("mlxvlm_sequences_cancelled_total", "counter",
      "Requests stopped because their client went away", [({}, stats.requests_cancelled)])
    m("mlxvlm_sequences_failed_total", "counter", "Requests that failed in the engine",
      [({}, stats.requests_failed)])
    m("mlxvlm_prompt_tokens_total", "counter", "Prompt tokens of started requests",
      [({}, stats.prompt_tokens)])
    m("mlxvlm_prompt_tokens_cached_total", "counter",
      "Prompt tokens reused from an earlier request's cache instead of prefilled",
      [({}, stats.cached_prompt_tokens)])
    m("mlxvlm_generation_tokens_total", "counter", "Generated tokens",
      [({}, stats.generated_tokens)])
    m("mlxvlm_decode_tokens_per_second", "gauge",
      "Decode throughput of the whole batch, smoothed over recent steps",
      [({}, round(stats.decode_tokens_per_second, 3))])
    m("mlxvlm_time_to_first_token_seconds", "summary",
      "Time from submission to the first generated token",
      [])
    lines.append(f"mlxvlm_time_to_first_token_seconds_sum {stats.time_to_first_token_sum:.6f}")
    lines.append(f"mlxvlm_time_to_first_token_seconds_count {stats.time_to_first_token_count}")
    return "\n".join(lines) + "\n"
