"""The prompt cache on disk (``--prompt-cache-dir``), through the entry point users start:
a conversation resumes from its cache after the server restarts (an attention-only
family and a hybrid one with recurrent states), answering as a fresh prefill does and
reporting as cached what the memory tier would have; damaged or foreign files are
ignored with a warning, never used and never a crash; the folder stays under
``--prompt-cache-disk-gb``, least recently used out first."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_harness import png_data_url, user, wait_until
from server_process import ServerProcess
from tiny import make_image
from user_environment import user_environment

from mlxvlm.batching.disk_prefix_cache import namespace_digest
from mlxvlm.server.security import key_id

IMAGE = make_image(56, 56, seed=31)
GREEDY = {"temperature": 0, "max_tokens": 12, "logprobs": True}
TURN1 = [user("Describe this image in a few words.", png_data_url(IMAGE))]


def turn2(answer1: "Answer") -> list[dict]:
    return [*TURN1, {"role": "assistant", "content": answer1.content},
            {"role": "user", "content": "What colours are in it?"}]


@dataclass
class Answer:
    tokens: list[tuple[str, tuple[int, ...]]]  # each token's text and bytes
    content: str
    message: dict  # content and, for a thinking template, reasoning_content
    cached: int


def ask(client, model: str, messages: list[dict]) -> Answer:
    response = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    (choice,) = response.choices
    details = response.usage.prompt_tokens_details
    return Answer([(t.token, tuple(t.bytes or ())) for t in choice.logprobs.content],
                  choice.message.content or "", choice.message.model_dump(exclude_none=True),
                  details.cached_tokens if details else 0)


def cache_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# Any of the server's keys may read /metrics.
AUTH = {"Authorization": "Bearer key-one"}


def key_flags(*keys: str) -> list[str]:
    return [flag for key in keys for flag in ("--api-key", key)]


# ---------------------------------------------------------------------- across a restart


FAMILIES = ["qwen2_vl", "qwen3_5"]  # attention only; Gated DeltaNet layers beside attention


def test_a_conversation_resumes_after_a_restart(tiny_checkpoints, tmp_path):
    """Turn 1 answered, the server stopped; started again on the same folder, turn 2
    reuses turn 1's cache (KV, the image's M-RoPE positions; for Qwen3.5 also the linear
    layers' states, from their snapshot) as far as the memory tier of a server that never
    stopped does, and answers as a cold prefill of the whole conversation does.

    Each API key has its own namespace, so one server gives the references: the cold
    answer under a key without files, the memory tier's reuse under another. Both
    families are served by the same server, each model with files of its own."""
    paths = [str(tiny_checkpoints.path(family, "hub")) for family in FAMILIES]
    folder = tmp_path / "prompt-cache"
    flags = [*(flag for path in paths for flag in ("--model", path)), "--max-loaded-models", "2",
             "--prompt-cache-dir", str(folder), *key_flags("resumed", "cold", "memory", "key-one")]
    answers1, colds = {}, {}
    with ServerProcess(*flags) as server:
        for path in paths:
            answers1[path] = ask(server.openai_client(api_key="resumed"), path, TURN1)
            colds[path] = ask(server.openai_client(api_key="cold"), path, turn2(answers1[path]))
    assert all(cold.cached == 0 for cold in colds.values())
    # Turn 1 under "resumed", turn 2 under "cold", for each model.
    assert len(cache_files(folder)) == 2 * len(paths)

    with ServerProcess(*flags) as server:
        for path in paths:
            answer1 = answers1[path]
            resumed = ask(server.openai_client(api_key="resumed"), path, turn2(answer1))
            memory_client = server.openai_client(api_key="memory")
            assert ask(memory_client, path, TURN1) == answer1
            memory = ask(memory_client, path, turn2(answer1))
            assert memory.cached > 0, path
            assert resumed.cached == memory.cached, path
            assert resumed.tokens == colds[path].tokens == memory.tokens, path
            assert resumed.message == colds[path].message, path
        metrics = httpx.get(server.base_url + "/metrics", headers=AUTH).text
        log = server.log()
    for path in paths:  # one entry read back per model (the memory tier's hit is not)
        assert f'mlxvlm_prompt_cache_disk_loads_total{{model="{path}"}} 1\n' in metrics
    assert " ignored: " not in log
    assert log.count("2 files of this model") == len(paths)


# ------------------------------------------------------------------- damaged and foreign

KEYS = ["key-one", "key-two", "key-three", "key-four", "key-five"]


@dataclass
class Written:
    path: str  # the checkpoint
    files: dict[str, Path]  # turn 1's file under each of KEYS
    answer1: Answer
    cold: Answer  # turn 2 prefilled cold


@pytest.fixture(scope="module")
def written(tiny_checkpoints, tmp_path_factory) -> Written:
    """Turn 1 of the same conversation under each of ``KEYS`` (one file each, namespaced
    by its key), and turn 2 answered cold under a key of its own."""
    path = str(tiny_checkpoints.path("qwen2_vl", "hub"))
    folder = tmp_path_factory.mktemp("written")
    with ServerProcess("--model", path, "--prompt-cache-dir", str(folder),
                       *key_flags(*KEYS, "cold")) as server:
        answers = [ask(server.openai_client(api_key=key), path, TURN1) for key in KEYS]
        cold = ask(server.openai_client(api_key="cold"), path, turn2(answers[0]))
    assert all(answer == answers[0] for answer in answers) and cold.cached == 0
    files = {}
    for file in cache_files(folder):
        namespace = read_header(file)["__metadata__"]["namespace"]
        files.update({k: file for k in KEYS if namespace == namespace_digest(key_id(k))})
    assert len(files) == len(KEYS)
    return Written(path, files, answers[0], cold)


def read_header(file: Path) -> dict:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def with_header(file: Path, header: dict) -> bytes:
    """The file's bytes under another header (its tensors' bytes unchanged)."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + length :]


def test_damaged_and_foreign_files_are_ignored_with_a_warning(written, tmp_path):
    """Each key's follow-up finds a file under its own name that is truncated, has bytes
    flipped, is another key's file, or another key's file relabelled as its own (its
    metadata edited): each is ignored with a warning (and removed), and the follow-up is
    prefilled cold, answering as a cold prefill does. The intact file of the fifth key is
    used by that key, and not by another model served beside it (the same checkpoint
    with an edited config.json), which leaves it alone with a warning."""
    folder = tmp_path / "prompt-cache"
    folder.mkdir()
    one, two, three, four, five = (folder / written.files[k].name for k in KEYS)
    original = written.files["key-one"].read_bytes()
    one.write_bytes(original[: len(original) * 2 // 3])  # truncated
    flipped = bytearray(written.files["key-two"].read_bytes())
    flipped[-100:-90] = bytes(b ^ 0xFF for b in flipped[-100:-90])
    two.write_bytes(bytes(flipped))
    three.write_bytes(original)  # key one's file under key three's name
    relabelled = read_header(written.files["key-one"])
    relabelled["__metadata__"]["namespace"] = namespace_digest(key_id("key-four"))
    four.write_bytes(with_header(written.files["key-one"], relabelled))
    shutil.copy(written.files["key-five"], five)
    other = tmp_path / "other-model"
    shutil.copytree(written.path, other)
    config = json.loads((other / "config.json").read_text())
    config["mlxvlm_test_note"] = "edited"
    (other / "config.json").write_text(json.dumps(config))

    with ServerProcess("--model", written.path, "--model", str(other),
                       "--max-loaded-models", "2", "--prompt-cache-dir", str(folder),
                       *key_flags(*KEYS)) as server:
        for key in KEYS[:4]:
            answer = ask(server.openai_client(api_key=key), written.path, turn2(written.answer1))
            assert (answer.tokens, answer.cached) == (written.cold.tokens, 0), key
        client = server.openai_client(api_key="key-five")
        foreign = ask(client, str(other), turn2(written.answer1))
        used = ask(client, written.path, turn2(written.answer1))
        metrics = httpx.get(server.base_url + "/metrics", headers=AUTH).text
        log = server.log()
    assert f'mlxvlm_prompt_cache_disk_refused_total{{model="{written.path}"}} 4\n' in metrics
    assert f'mlxvlm_prompt_cache_disk_loads_total{{model="{written.path}"}} 1\n' in metrics
    assert (foreign.tokens, foreign.cached) == (written.cold.tokens, 0)
    assert used.tokens == written.cold.tokens and used.cached > 0
    assert log.count(" ignored: ") == 4, log
    for name in (one, two, three, four):
        assert f"prompt-cache file {name.name} ignored" in log
        assert not name.exists()
    # (Key five's file, and the other keys' turn 2 written meanwhile.)
    assert re.search(r"WARNING .*: [1-5] prompt-cache files in .* are of another model, "
                     r"adapter or format: not used by this one", log)
    assert "Traceback" not in log


# ---------------------------------------------------------------------------- the limit


def conversation(seed: int, question: str) -> list[dict]:
    return [user(question, png_data_url(make_image(56, 56, seed=seed)))]


def test_the_folder_keeps_the_least_recently_used_out(written, tmp_path):
    """With the memory tier off every reuse reads the disk. Under a limit of three and a
    half files (of the size of turn 1's): A and B written, A then used by a conversation
    that shares its start (A is now more recent than B), C written: B goes, not A (the
    oldest written)."""
    path = written.path
    limit_gb = written.files["key-one"].stat().st_size * 3.5 / 1e9
    folder = tmp_path / "prompt-cache"
    with ServerProcess("--model", path, "--prompt-cache-dir", str(folder),
                       "--prompt-cache-disk-gb", repr(limit_gb),
                       "--prompt-cache-size", "0") as server:
        client = server.openai_client()

        def written_by(messages) -> tuple[Path, int]:
            """The file the answer to ``messages`` left (written in the background)."""
            before = set(cache_files(folder))
            cached = ask(client, path, messages).cached
            assert wait_until(lambda: set(cache_files(folder)) - before, timeout=60)
            [new] = set(cache_files(folder)) - before
            return new, cached

        first = "Describe this image in a few words."
        a, _ = written_by(conversation(1, first))
        b, _ = written_by(conversation(2, first))
        _, cached = written_by(conversation(1, "Describe this image in other words."))
        assert cached > 0  # A was read
        assert a.exists() and b.exists()
        c, _ = written_by(conversation(3, first))
        assert wait_until(lambda: len(cache_files(folder)) == 3, timeout=60)
        assert a.exists() and c.exists() and not b.exists()
        # B is gone for good: its conversation shares with the files left only what
        # every prompt shares (up to its image), as a new picture's does; A's picture
        # is still reused (from the file of the conversation that used A).
        shared = ask(client, path, conversation(4, first)).cached
        assert ask(client, path, conversation(1, "What colours are in it?")).cached > shared
        assert ask(client, path, conversation(2, "What colours are in it?")).cached == shared


def test_the_flags_are_in_the_help():
    from mlxvlm.server.config import build_parser

    text = build_parser().format_help()
    assert "--prompt-cache-dir" in text and "--prompt-cache-disk-gb" in text


def test_a_folder_that_is_a_file_is_a_one_line_error(tmp_path):
    """Said before the model loads, as the entry point's other errors are."""
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    done = subprocess.run([sys.executable, "-m", "mlxvlm.server", "--model", "unused",
                           "--prompt-cache-dir", str(not_a_folder)],
                          capture_output=True, text=True, timeout=120,
                          env=user_environment())  # a user's process: torch-free
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --prompt-cache-dir '{not_a_folder}' is not a folder")
