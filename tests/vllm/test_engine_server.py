"""A real OpenAI-compatible vLLM server with the kvarn plugin, on loopback, started and stopped by the test.

It answers a chat completion; and prompts that cross several blocks give the same greedy tokens when sent one at a
time as when sent together (continuous batching, and the second round meets the first round's prefix-cache
blocks). Every request is bounded (max_tokens, timeout); the server is stopped whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_common import ENV, PRESET, model_dir, prompts

pytestmark = [pytest.mark.model, pytest.mark.timeout(3600)]  # vLLM starts take minutes on 2 cores

START_TIMEOUT = 600
REQUEST_TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "smollm2", "--dtype", "bfloat16", "--max-model-len", "1024",
           "--max-num-seqs", "8", "--enforce-eager", "--additional-config", json.dumps({"kvarn": {"preset": PRESET}})]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise AssertionError(f"server not healthy after {START_TIMEOUT} s:\n{log.read_text()[-6000:]}")
            time.sleep(2)
        yield base, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture started: server and its engine processes
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_chat_completion(server) -> None:
    base, log = server
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = _post(f"{base}/v1/chat/completions", {"model": "smollm2", "max_tokens": 16, "temperature": 0,
                                               "messages": question})
    text = r["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text.strip(), r
    assert "kvarn: preset " + PRESET in log.read_text()


def test_concurrent_requests_match_one_at_a_time(server) -> None:
    base, _ = server
    ps = prompts()[1:]  # the ones that cross block boundaries

    def complete(p: list[int]) -> str:
        r = _post(f"{base}/v1/completions", {"model": "smollm2", "prompt": p, "max_tokens": 16, "temperature": 0})
        return r["choices"][0]["text"]

    one_by_one = [complete(p) for p in ps]
    with ThreadPoolExecutor(len(ps)) as ex:
        together = list(ex.map(complete, ps))
    assert all(one_by_one)
    assert together == one_by_one
