"""Whether the ranks this one works with are still there, watched from a thread of its own.

A collective whose peer is gone does not always fail: MLX's ring backend can wait inside
C++ forever (seen on a sharded server's forward pass after the other rank was killed), where
no Python signal handler runs either. So a rank does not learn of a lost peer from its
collectives; ``PeerWatch`` looks from outside them, every half second:

- the ring's own connections (the backend's TCP sockets to its neighbours, found among
  this process's open descriptors by the addresses of ``MLX_HOSTFILE``): one the peer
  closed reads as the end of the stream when peeked at (nothing is consumed), or fails;
- the launcher: ``mlx.launch`` (or mpirun) is this rank's parent, and a new parent means
  it is gone, and with it whatever would have stopped the ranks.

Other backends (JACCL, MPI) have no sockets found here: the launcher is watched alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _open_descriptors() -> list[int]:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return [int(name) for name in os.listdir(folder)]
        except OSError:
            continue
    return []


def _stream_socket(fd: int) -> socket.socket | None:
    """A duplicate of descriptor ``fd`` as a socket, where it is a connected TCP one."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.close()
        return None
    return sock


def ring_links(rank: int) -> list[tuple[int, socket.socket]]:
    """This rank's connections of MLX's ring backend, each with the rank at its other end
    (duplicates of the backend's descriptors: closing them leaves the backend's open).
    Empty under another backend, or before ``mx.distributed.init``."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if not hostfile:
        return []
    try:
        nodes = json.loads(Path(hostfile).read_text())
        size = len(nodes)
        # The ring: each rank accepts its left neighbour on its own addresses and
        # connects to its right neighbour's.
        mine = {_address(a) for a in nodes[rank]}
        right = {_address(a) for a in nodes[(rank + 1) % size]}
    except (OSError, ValueError, TypeError, IndexError):
        return []
    links = []
    for fd in _open_descriptors():
        sock = _stream_socket(fd)
        if sock is None:
            continue
        try:
            local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
        except OSError:  # not connected (a listening socket)
            sock.close()
            continue
        if local in mine:
            links.append(((rank - 1) % size, sock))
        elif peer in right:
            links.append(((rank + 1) % size, sock))
        else:
            sock.close()
    return links


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (or it broke); nothing is read from it."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing to read now
    except OSError:
        return True


class PeerWatch:
    """Calls ``on_lost(reason)`` once, from its own thread, when a peer of ``rank`` is
    gone (its ring connection closed) or the launcher that started this rank is."""

    def __init__(self, rank: int, on_lost: Callable[[str], None], interval: float = 0.5):
        self.rank = rank
        self.on_lost = on_lost
        self.interval = interval
        self._parent = os.getppid()
        self._links = ring_links(rank)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def watched(self) -> str:
        """What is watched, for the log."""
        peers = sorted({peer for peer, _ in self._links})
        links = (f"the ring's connections to rank{'s' if len(peers) > 1 else ''} "
                 f"{', '.join(map(str, peers))} and " if peers else "")
        return f"{links}the launcher (pid {self._parent})"

    def lost(self) -> str | None:
        """Why a peer is gone, or None while all seem there."""
        for peer, sock in self._links:
            if closed_by_peer(sock):
                return f"rank {peer} is gone (its connection to rank {self.rank} closed)"
        if os.getppid() != self._parent:
            return f"the launcher (pid {self._parent}) that started rank {self.rank} is gone"
        return None

    def start(self) -> "PeerWatch":
        self._thread = threading.Thread(target=self._watch, name="mlxvlm-peer-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for _, sock in self._links:
            sock.close()
        self._links = []

    def _watch(self) -> None:
        while not self._stopped.wait(self.interval):
            reason = self.lost()
            if reason is not None:
                self.on_lost(reason)
                return
