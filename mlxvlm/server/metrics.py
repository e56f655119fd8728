"""``GET /metrics`` in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

from mlxvlm.server.models_registry import ModelRegistry
from mlxvlm.server.service import REFUSAL_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")


# The prompt cache's disk tier (--prompt-cache-dir), per model.
_DISK_METRICS = [
    ("mlxvlm_prompt_cache_disk_files", "gauge", "Prompt-cache files of the model on disk",
     "files"),
    ("mlxvlm_prompt_cache_disk_loads_total", "counter",
     "Prompt-cache entries read back from disk and reused", "loads"),
    ("mlxvlm_prompt_cache_disk_refused_total", "counter",
     "Prompt-cache files ignored as damaged or foreign", "refused"),
    ("mlxvlm_prompt_cache_disk_writes_total", "counter", "Prompt-cache files written",
     "writes"),
    ("mlxvlm_prompt_cache_disk_dropped_writes_total", "counter",
     "Finished requests' caches not written (the writer behind, or no stored form)",
     "dropped_writes"),
]


def render_metrics(models: ModelRegistry, app_state) -> str:
    """The server's counts, then each loaded model's engine (labelled by model where the
    server serves several). ``app_state``: the app's state, with the listener's
    ``protocol.ConnectionLimits`` where it runs under them."""
    counters = models.counters
    services = models.services()
    labelled = len(models.ids()) > 1
    lines: list[str] = []
    m = lambda *args: _metric(lines, *args)  # noqa: E731

    def per_model(value_of) -> list:
        return [({"model": model_id} if labelled else {}, value_of(service))
                for model_id, service in services]

    def engine(name: str, kind: str, help_text: str, stat: str) -> None:
        m(name, kind, help_text, per_model(lambda s: getattr(s.engine.stats, stat)))

    m("mlxvlm_requests_total", "counter", "HTTP requests answered, by status",
      [({"status": str(code)}, n) for code, n in sorted((counters.by_status or {}).items())])
    m("mlxvlm_requests_rejected_busy_total", "counter",
      "Requests refused with 429 because the queue was full", [({}, counters.rejected_busy)])
    connections = getattr(app_state, "connection_limits", None)
    if connections is not None:
        m("mlxvlm_connections_open", "gauge", "Client connections open now",
          [({}, connections.open)])
        m("mlxvlm_connections_refused_total", "counter",
          "Connections refused at --max-connections (answered 503)",
          [({}, connections.refused)])
        m("mlxvlm_connections_timed_out_total", "counter",
          "Connections closed because their headers or body did not arrive in time "
          "(--header-timeout, --body-timeout)", [({}, connections.timed_out)])
    m("mlxvlm_body_bytes_buffered", "gauge",
      "Bytes of request bodies being read now (at most --max-buffered-body-bytes)",
      [({}, app_state.body_budget.in_use)])
    reasons = sorted(set(REFUSAL_REASONS) | set(counters.refused))
    m("mlxvlm_requests_refused_total", "counter",
      "Requests refused with 400 for passing a limit, by reason: a media limit (e.g. "
      "max_video_decode_pixels), context_length, grammar (it cannot run), max_tokens (too "
      "few for a whole answer of its grammar)",
      [({"reason": reason}, counters.refused.get(reason, 0)) for reason in reasons])
    preparation = counters.preparation
    m("mlxvlm_requests_preparing", "gauge",
      "Requests being prepared now (template, media decoding, processor), by whether they "
      "carry media (each kind has its own workers)",
      [({"inputs": kind}, n) for kind, n in sorted(preparation.preparing.items())])
    m("mlxvlm_preparations_cancelled_total", "counter",
      "Requests whose preparation was stopped (or never started) because their client "
      "went away", [({}, preparation.cancelled)])
    m("mlxvlm_models_loaded", "gauge", "Models loaded now", [({}, len(services))])
    m("mlxvlm_model_loads_total", "counter", "Models loaded (at start or on first use)",
      [({}, models.loads)])
    m("mlxvlm_model_unloads_total", "counter",
      "Models unloaded (to make room, or unused for --idle-unload-seconds)",
      [({}, models.unloads)])
    m("mlxvlm_model_waiting_requests", "gauge",
      "Requests waiting for their model to be loaded", [({}, models.waiting())])
    m("mlxvlm_model_waits_abandoned_total", "counter",
      "Requests whose client left while they waited for their model to be loaded",
      [({}, models.waits_abandoned)])
    m("mlxvlm_model_waits_refused_total", "counter",
      "Requests refused with 429 because too many already waited for their model",
      [({}, models.waits_refused)])
    store = getattr(app_state, "response_store", None)
    if store is not None:
        m("mlxvlm_stored_responses", "gauge",
          "Responses kept for previous_response_id", [({}, len(store))])
        m("mlxvlm_stored_response_bytes", "gauge",
          "Estimated bytes of the stored responses (an image once per API key)",
          [({}, store.bytes)])
        m("mlxvlm_stored_responses_evicted_total", "counter",
          "Stored responses dropped to make room for newer ones of the same API key",
          [({}, store.evicted)])
        m("mlxvlm_stored_responses_refused_total", "counter",
          "Responses not stored because they did not fit their API key's or the "
          "server's byte bound", [({}, store.refused)])
    m("mlxvlm_requests_in_flight", "gauge",
      "Requests admitted and not finished (preparing, queued or generating)",
      per_model(lambda s: s.in_flight))
    engine("mlxvlm_queue_depth", "gauge", "Requests waiting for a batch slot", "waiting")
    engine("mlxvlm_active_sequences", "gauge", "Requests being prefilled, decoded or spoken",
           "active")
    engine("mlxvlm_peak_batch_size", "gauge", "The most requests decoded together so far",
           "peak_batch_size")
    engine("mlxvlm_sequences_finished_total", "counter", "Requests that generated to the end",
           "requests_finished")
    engine("mlxvlm_sequences_cancelled_total", "counter",
           "Requests stopped because their client went away", "requests_cancelled")
    engine("mlxvlm_sequences_failed_total", "counter", "Requests that failed in the engine",
           "requests_failed")
    engine("mlxvlm_prompt_tokens_total", "counter", "Prompt tokens of started requests",
           "prompt_tokens")
    engine("mlxvlm_prompt_tokens_cached_total", "counter",
           "Prompt tokens reused from an earlier request's cache instead of prefilled",
           "cached_prompt_tokens")
    engine("mlxvlm_generation_tokens_total", "counter", "Generated tokens", "generated_tokens")
    engine("mlxvlm_draft_tokens_total", "counter",
           "Tokens drafted for speculative decoding (requests that finished speculating)",
           "drafted_tokens")
    engine("mlxvlm_draft_tokens_accepted_total", "counter",
           "Drafted tokens the model accepted", "accepted_draft_tokens")
    engine("mlxvlm_stopped_drafts_total", "counter",
           "Requests whose draft model stopped drafting at a token its embedding table lacks",
           "stopped_drafts")
    m("mlxvlm_decode_tokens_per_second", "gauge",
      "Decode throughput of the whole batch, smoothed over recent steps",
      per_model(lambda s: round(s.engine.stats.decode_tokens_per_second, 3)))
    on_disk = [(model_id, service.prefix_cache.disk) for model_id, service in services
               if service.prefix_cache is not None and service.prefix_cache.disk is not None]
    for metric, kind, help_text, stat in _DISK_METRICS:
        if on_disk:
            m(metric, kind, help_text,
              [({"model": model_id} if labelled else {}, getattr(disk.stats, stat))
               for model_id, disk in on_disk])
    name = "mlxvlm_time_to_first_token_seconds"
    m(name, "summary", "Time from submission to the first generated token", [])
    for model_id, service in services:
        label = f'{{model="{model_id}"}}' if labelled else ""
        stats = service.engine.stats
        lines.append(f"{name}_sum{label} {stats.time_to_first_token_sum:.6f}")
        lines.append(f"{name}_count{label} {stats.time_to_first_token_count}")
    return "\n".join(lines) + "\n"
