"""How a stream that fails once its headers are sent is logged: ended by the server's own
stop (a rank of a sharded model lost, the server stopping -- a 503's error event, the
cause logged where it was seen) as one WARNING line without a traceback; any other
failure (a fault: a 500's error event) with its traceback. For each streaming endpoint
(chat completions, Messages, Responses), over a live server whose model's decode step
raises."""

from __future__ import annotations

import logging

import httpx
import pytest
from server_harness import MODEL_ID, LiveServer

import mlxvlm
from mlxvlm.distributed.group import RankLostError
from mlxvlm.server.answering import logged_stream_failure
from mlxvlm.server.sharded_stop import ServerStopping

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}],
                             "max_tokens": 20},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 20},
}


class FailingDecode:
    """The model, whose decode steps (one new token a row) raise ``fail_with`` when set."""

    def __init__(self, model):
        self.model = model
        self.fail_with: Exception | None = None

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids, *args, **kwargs):
        if self.fail_with is not None and input_ids.shape[-1] == 1:
            raise self.fail_with
        return self.model(input_ids, *args, **kwargs)


@pytest.fixture(scope="module")
def live(tiny_checkpoints):
    model, processor = mlxvlm.load(tiny_checkpoints.path("qwen2_vl", "hub"))
    failing = FailingDecode(model)
    with LiveServer(failing, processor) as server:
        yield server, failing


def server_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "mlxvlm.server"]


def streamed(server, path: str) -> str:
    body = {"model": MODEL_ID, "stream": True, **BODIES[path]}
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200  # (the failure comes after the headers)
        return response.read().decode()


@pytest.mark.parametrize("path", BODIES)
def test_a_stream_the_server_stop_ends_is_one_warning_a_fault_keeps_its_traceback(
        live, caplog, path):
    server, failing = live
    caplog.set_level(logging.INFO, logger="mlxvlm.server")
    failing.fail_with = RankLostError("another rank left the run: rank 1 is gone")
    try:
        lost = streamed(server, path)
        lost_records = server_records(caplog)
        caplog.clear()
        failing.fail_with = RuntimeError("a kernel failed")
        fault = streamed(server, path)
        fault_records = server_records(caplog)
    finally:
        failing.fail_with = None
    assert "another rank left the run: rank 1 is gone" in lost
    assert [(r.levelno, r.exc_info) for r in lost_records] == [(logging.WARNING, None)]
    assert lost_records[0].getMessage().startswith("a streamed answer ended with a 503: ")
    assert "rank 1 is gone" in lost_records[0].getMessage()
    assert "generation failed; see the server log" in fault
    assert [r.levelno for r in fault_records] == [logging.ERROR]
    assert fault_records[0].exc_info is not None
    assert "a kernel failed" in caplog.text and "Traceback" in caplog.text


@pytest.mark.parametrize("error", [
    RankLostError("another rank left the run: rank 1 is gone; the server is stopping"),
    ServerStopping("the server is stopping (on SIGTERM) before this answer ended")])
def test_the_servers_own_stop_is_a_warning_when_raised_bare(caplog, error):
    """As ``ShardedStop`` fails the requests running: the error itself, no engine fault."""
    caplog.set_level(logging.INFO, logger="mlxvlm.server")
    try:
        raise error
    except Exception as caught:
        assert logged_stream_failure(caught) == (503, str(error))
    assert [(r.levelno, r.exc_info, r.getMessage()) for r in server_records(caplog)] == [
        (logging.WARNING, None, f"a streamed answer ended with a 503: {error}")]
