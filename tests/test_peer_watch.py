"""A rank sees its peers go (distributed/peer_watch.py), over loopback sockets laid out as
MLX's ring lays out rank 0's: one accepted on its own address from its left neighbour,
one connected to its right neighbour's address, both named in ``MLX_HOSTFILE``."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading

import pytest

from mlxvlm.distributed import peer_watch, rank_stop
from mlxvlm.distributed.group import RankLostError
from mlxvlm.distributed.peer_watch import PeerWatch, ring_links


@pytest.fixture
def ring(tmp_path, monkeypatch):
    """Rank 0's two ring connections to rank 1 (this process's sockets for both ends):
    (rank 0's, rank 1's) ends."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    addresses = [s.getsockname() for s in listeners]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"{host}:{port}"] for host, port in addresses]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    from_left = socket.create_connection(addresses[0])  # rank 1 -> rank 0's address
    accepted, _ = listeners[0].accept()
    to_right = socket.create_connection(addresses[1])  # rank 0 -> rank 1's address
    accepted_by_1, _ = listeners[1].accept()
    for s in listeners:
        s.close()
    ends = ([accepted, to_right], [from_left, accepted_by_1])
    yield ends
    for s in ends[0] + ends[1]:
        s.close()


def test_rank_0_finds_its_ring_connections_and_nothing_else(ring):
    rank0_ends, _ = ring
    other = socket.create_server(("127.0.0.1", 0))  # (a listening socket, as uvicorn's)
    links = ring_links(0)
    try:
        found = {(peer, s.getsockname(), s.getpeername()) for peer, s in links}
        assert found == {(1, s.getsockname(), s.getpeername()) for s in rank0_ends}
    finally:
        other.close()
        for _, s in links:
            s.close()
    # The duplicates closed, the backend's own descriptors stay open.
    rank0_ends[0].sendall(b"x")
    assert ring[1][0].recv(1) == b"x"


def test_a_peer_that_closes_either_connection_is_gone(ring):
    rank0_ends, rank1_ends = ring
    watch = PeerWatch(0, lambda reason: None)
    assert "ring's connections to rank 1" in watch.watched
    assert watch.lost() is None
    # Data waiting is no end, and peeking at it leaves it for the backend.
    rank1_ends[0].sendall(b"abc")
    assert watch.lost() is None
    assert rank0_ends[0].recv(3) == b"abc"
    rank1_ends[1].close()
    assert watch.lost() == "rank 1 is gone (its connection to rank 0 closed)"
    watch.stop()


def test_the_watch_calls_once_when_the_launcher_is_gone(ring, monkeypatch):
    calls, called = [], threading.Event()

    def on_lost(reason):
        calls.append(reason)
        called.set()
    watch = PeerWatch(0, on_lost, interval=0.01)
    parent = watch._parent
    monkeypatch.setattr(peer_watch.os, "getppid", lambda: 1 if parent != 1 else 2)
    watch.start()
    assert called.wait(30)
    watch._thread.join(30)
    assert calls == [f"the launcher (pid {parent}) that started rank 0 is gone"]
    watch.stop()


def test_without_a_hostfile_only_the_launcher_is_watched(monkeypatch):
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    watch = PeerWatch(0, lambda reason: None)
    assert ring_links(0) == [] and watch.watched.startswith("the launcher")
    assert watch.lost() is None


class Ended:
    """``rank_stop.exit_now`` for a test: records (what was said, the status); on the
    main thread it ends the ``with`` block."""

    def __init__(self, monkeypatch):
        self.said: list[str] = []
        self.codes: list[int] = []
        self.event = threading.Event()
        monkeypatch.setattr(rank_stop, "exit_now", self.exit_now)

    def exit_now(self, code):
        self.codes.append(code)
        self.event.set()
        if threading.current_thread() is threading.main_thread():
            raise SystemExit(code)


def test_an_error_while_a_peer_is_gone_ends_the_rank_as_the_watch_would(ring, monkeypatch):
    """A collective failing on the main thread (before the watch looked) ends the rank
    with the watch's words; a run that ended before its peer left ends well."""
    rank0_ends, rank1_ends = ring
    ended = Ended(monkeypatch)
    with rank_stop.RankStop(0, ended.said.append):
        pass
    rank1_ends[0].close()
    with pytest.raises(SystemExit):
        with rank_stop.RankStop(0, ended.said.append):
            raise RankLostError("rank 0 of 2: another rank left the run")
    assert ended.said == ["rank 1 is gone (its connection to rank 0 closed)"]
    assert ended.codes == [1]


def test_sigterm_on_rank_0_ends_it_from_a_thread_naming_the_rank_gone(ring, monkeypatch):
    """SIGTERM (mlx.launch's, once a rank exited) while the main thread is busy: the
    signal's thread ends the rank, naming the rank gone; with every peer there, it says
    it stopped on SIGTERM (status 143). The handlers are restored after."""
    rank0_ends, rank1_ends = ring
    ended = Ended(monkeypatch)
    before = signal.getsignal(signal.SIGTERM)
    with rank_stop.RankStop(0, ended.said.append, signals=True):
        os.kill(os.getpid(), signal.SIGTERM)
        assert ended.event.wait(30)
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(-1) == -1  # (none left behind)
    ended.event.clear()
    rank1_ends[1].close()
    with rank_stop.RankStop(0, ended.said.append, signals=True):
        os.kill(os.getpid(), signal.SIGTERM)
        assert ended.event.wait(30)
    assert ended.said == ["stopped on SIGTERM",
                          "rank 1 is gone (its connection to rank 0 closed)"]
    assert ended.codes == [143, 1]


def test_sigint_ends_rank_0_whose_step_does_not_end(ring, monkeypatch):
    """Ctrl-C raises KeyboardInterrupt as usual; a main thread that does not get out of
    its step (as one inside a collective that never completes) is ended from the
    signal's thread, status 130, after the grace or at once at a second Ctrl-C."""
    monkeypatch.setattr(rank_stop, "SIGINT_GRACE", 0.2)
    ended = Ended(monkeypatch)
    with rank_stop.RankStop(0, ended.said.append, signals=True):
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            ended.event.wait(30)  # (interrupted before it returns)
        assert ended.event.wait(30)  # the step "still running"
    assert ended.said == ["stopped on SIGINT (its step did not end: a rank does not answer)"]
    assert ended.codes == [130]
    ended.event.clear()
    with rank_stop.RankStop(0, ended.said.append, signals=True):
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            ended.event.wait(30)
    assert not ended.event.wait(0.5)  # a step that ended in time: nothing more
    monkeypatch.setattr(rank_stop, "SIGINT_GRACE", 600)
    with rank_stop.RankStop(0, ended.said.append, signals=True):
        for _ in range(2):
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                ended.event.wait(30)
        assert ended.event.wait(30)
    assert ended.said[1:] == ["stopped at once on a second SIGINT"]
    assert ended.codes == [130, 130]
