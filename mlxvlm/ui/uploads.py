"""Which files the chat may read: only those uploaded through it, each by its conversation.

Gradio accepts, in any file field of a request, a path the client names. It refuses paths
outside its upload folder, but that folder is by default ``/tmp/gradio``, shared by every
Gradio app on the host and kept across runs, and inside it any file is accepted (and
served by ``/gradio_api/file=``) to anyone who names it; it also downloads any public URL
it is given. So the app:

- gives Gradio a private upload folder, new for each process (``GRADIO_TEMP_DIR``, before
  any component exists: Gradio reads it when a component is made and at launch), removed
  at exit; the examples cache (also served) goes inside it;
- counts what Gradio's upload route receives (``record``), so that a file placed in the
  folder by anything else (Gradio's own copies, a client's guess) is refused;
- hands each upload to the first conversation that sends it (``claim``; one claim per
  upload, so two users who upload the same picture each get theirs) and lets a
  conversation's history hold only files it claimed (``owns``).

Every refusal is the same ``AttachmentRefused``, raised before the file is opened, and
Gradio answers it like its own refusals: an error with no message, whatever the path,
so that it tells nothing about what exists on the host.

The app's own files (a spoken answer's audio: ``keep_answer_audio``) are written in the
same folder under names no one can guess; Gradio's file handling takes them (the chat
shows them, and its history brings them back), but no conversation can claim one as an
attachment, so the model never reads them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from mlxvlm.ui.conversation import attachment_paths

# The Gradio settings that name folders it serves files from.
UPLOAD_DIR_VARIABLE = "GRADIO_TEMP_DIR"
EXAMPLES_CACHE_VARIABLE = "GRADIO_EXAMPLES_CACHE"


class AttachmentRefused(Exception):
    """A file the client named but did not upload through this conversation. Not a
    ``gradio.Error`` on purpose: Gradio shows clients no message for other exceptions."""

    def __init__(self) -> None:
        super().__init__("attachment refused: not uploaded through this conversation")


def _key(path: str | os.PathLike) -> str:
    # Lexical only: the file is not touched before it is accepted (no existence probe).
    return os.path.normpath(os.path.abspath(os.fspath(path)))


class Uploads:
    """The files uploaded to one app and the conversation (Gradio session) of each."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).resolve()
        self._lock = threading.Lock()
        self._unclaimed: Counter[str] = Counter()  # uploads not yet sent by any conversation
        self._owners: dict[str, set[str]] = {}  # session hash -> paths it sent
        self._answers: set[str] = set()  # files the app wrote (spoken answers' audio)

    def record(self, paths: Iterable[str | os.PathLike]) -> None:
        """Files Gradio's upload route has just written (one call per upload request)."""
        with self._lock:
            self._unclaimed.update(_key(p) for p in paths)

    def is_upload(self, path: str | os.PathLike) -> bool:
        key = _key(path)
        with self._lock:
            return self._unclaimed[key] > 0 or any(key in s for s in self._owners.values())

    def claim(self, session: str, path: str | os.PathLike) -> bool:
        """``path`` becomes ``session``'s if it is an upload no conversation took yet."""
        key = _key(path)
        with self._lock:
            owned = self._owners.setdefault(session, set())
            if key in owned:
                return True
            if self._unclaimed[key] <= 0:
                return False
            self._unclaimed[key] -= 1
            owned.add(key)
            return True

    def owns(self, session: str, path: str | os.PathLike) -> bool:
        with self._lock:
            return _key(path) in self._owners.get(session, ())

    def admit(self, session: str | None, message: dict | str, history: Sequence[dict]) -> None:
        """Refuse (``AttachmentRefused``) a turn naming any file ``session`` did not
        upload: new attachments must be uploads no other conversation took, earlier ones
        the conversation's own."""
        new, earlier = attachment_paths(history, message)
        if (new or earlier) and session is None:
            raise AttachmentRefused()
        for path in new:
            if not self.claim(session, path):
                raise AttachmentRefused()
        for path in earlier:
            if not self.owns(session, path):
                raise AttachmentRefused()

    def require_upload(self, path: str | os.PathLike | None) -> None:
        """For Gradio's file handling: refuse, before any copy or download, a file or URL
        that did not come through the upload route (nor was written by the app)."""
        if path is None:
            return
        with self._lock:
            ours = _key(path) in self._answers
        if not ours and not self.is_upload(path):
            raise AttachmentRefused()

    def keep_answer_audio(self, data: bytes, suffix: str = ".wav") -> str:
        """A spoken answer's audio written to the folder (``answers/``, a random name);
        its path, which Gradio's file handling then takes."""
        folder = self.directory / "answers"
        folder.mkdir(exist_ok=True)
        path = folder / f"{uuid.uuid4().hex}{suffix}"
        path.write_bytes(data)
        with self._lock:
            self._answers.add(_key(path))
        return str(path)


class _RecordingSet(set):
    """Stands in for ``Blocks.upload_file_set``, which Gradio's upload route updates with
    the paths of each upload: the same set, and every update also goes to ``uploads``."""

    def __init__(self, items: Iterable, uploads: Uploads):
        super().__init__(items)
        self.uploads = uploads

    def update(self, *others: Iterable) -> None:
        for paths in others:
            paths = list(paths)
            self.uploads.record(paths)
            super().update(paths)


def watch_upload_route(blocks, uploads: Uploads) -> None:
    """Record every upload ``blocks`` receives in ``uploads``."""
    recording = _RecordingSet(blocks.upload_file_set, uploads)
    blocks.temp_file_sets = [
        recording if s is blocks.upload_file_set else s for s in blocks.temp_file_sets
    ]
    blocks.upload_file_set = recording


_process_uploads: Uploads | None = None
_process_lock = threading.Lock()


def process_uploads() -> Uploads:
    """This process's private upload folder (created, and given to Gradio, on first use)."""
    global _process_uploads
    with _process_lock:
        if _process_uploads is None:
            # Inside a folder the user chose for Gradio's files, if any.
            parent = os.environ.get(UPLOAD_DIR_VARIABLE) or None
            if parent:
                Path(parent).mkdir(parents=True, exist_ok=True)
            # Resolved: Gradio compares the paths it hands out with this one lexically.
            directory = str(Path(tempfile.mkdtemp(prefix="mlxvlm-ui-", dir=parent)).resolve())
            os.environ[UPLOAD_DIR_VARIABLE] = directory
            os.environ[EXAMPLES_CACHE_VARIABLE] = os.path.join(directory, "examples")
            atexit.register(shutil.rmtree, directory, True)
            _process_uploads = Uploads(directory)
        return _process_uploads
