"""What hostile media and oversized prompts cost `python -m mlxvlm.server` (issue 39,
items 3-5), for the tree at ``--repo`` (default: this checkout), so that a tree before
the bounds can be measured the same way.

    python benchmarks/hostile_media.py --output hostile.json
    python benchmarks/hostile_media.py --repo /tmp/older-tree --server-args ""

Starts the server on the demo model (examples/shapes-vlm) with ``--server-args`` and
measures, for each case, the answer's status, its wall time and the server's CPU
seconds and resident memory growth over it:

- ``video_pixels``: one keyframe then 6,000 frames repeating it at 4096 x 4096 (250 KB);
- ``huge_frames``: four 8192 x 8192 frames;
- ``long_message``: a 6 MB text message;
- ``bystander``: two clients send the 6,000-frame video and leave after 3 s; then a text
  request, whose wall time is the bystander's wait; the server's CPU seconds over the
  whole case and how many preparations /metrics says were cancelled.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
from av_media import write_repeating_video  # noqa: E402  (the test suite's video writer)

MODEL = REPO / "examples" / "shapes-vlm"
CASES = ["video_pixels", "huge_frames", "long_message", "bystander"]
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, repo: Path, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(repo)}
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlxvlm.server", "--model", str(MODEL), "--port",
             str(self.port), *args], env=env, cwd=repo, stdout=self.log,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(Path(self.log.name).read_text())

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
        return 0.0

    def close(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def chat(content) -> dict:
    return {"model": str(MODEL), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}


def video_request(path: Path) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    return chat([{"type": "video_url", "video_url": {"url": url}},
                 {"type": "text", "text": "What happens?"}])


def measured(server: Server, body: dict) -> dict:
    cpu, rss, start = server.cpu_seconds(), server.rss_mb(), time.perf_counter()
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)
    return {"status": response.status_code, "seconds": round(time.perf_counter() - start, 2),
            "server_cpu_seconds": round(server.cpu_seconds() - cpu, 2),
            "rss_growth_mb": round(server.rss_mb() - rss, 1),
            "message": response.json().get("error", {}).get("message", "")[:160]}


def bystander(server: Server, body: dict) -> dict:
    payload = json.dumps(body).encode()
    cpu, start = server.cpu_seconds(), time.perf_counter()
    leaving = []
    for _ in range(2):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        leaving.append(sock)
    time.sleep(3)
    for sock in leaving:
        sock.close()
    asked = time.perf_counter()
    response = httpx.post(server.url + "/v1/chat/completions", json=chat("Hello"), timeout=600)
    waited = time.perf_counter() - asked
    time.sleep(5)  # what the departed clients' work still costs after the answer
    return {"status": response.status_code, "text_request_seconds": round(waited, 2),
            "server_cpu_seconds": round(server.cpu_seconds() - cpu, 2),
            "case_seconds": round(time.perf_counter() - start, 2),
            "preparations_cancelled": server.metric("mlxvlm_preparations_cancelled_total")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the tree whose server runs")
    parser.add_argument("--server-args", default="", help="extra server flags, one string")
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES,
                        help="which cases to run (default: all)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hostile-media-"))
    hostile = write_repeating_video(folder / "hostile.mp4", 4096, 4096, 6000)
    huge = write_repeating_video(folder / "huge.mp4", 8192, 8192, 4)
    results = {"repo": str(args.repo), "server_args": args.server_args,
               "video_bytes": hostile.stat().st_size, "huge_frames_bytes": huge.stat().st_size}
    server = Server(args.repo, args.server_args.split())
    try:
        # The first generation builds the model's graphs: not a bystander's wait.
        httpx.post(server.url + "/v1/chat/completions", json=chat("Hello"), timeout=600)
        cases = {
            "video_pixels": lambda: measured(server, video_request(hostile)),
            "huge_frames": lambda: measured(server, video_request(huge)),
            "long_message": lambda: measured(server, chat("garden path " * 500_000)),
            "bystander": lambda: bystander(server, video_request(hostile)),
        }
        for case in args.cases:
            results[case] = cases[case]()
    finally:
        server.close()
    print(json.dumps(results, indent=2))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
