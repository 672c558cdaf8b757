"""The sandbox of every local next-hop (issue 19, items 1-3; finding "tenant tests
run as root", "no isolation between runs"): each escape a hostile tenant tried,
as a test file of hers run by the ``tool: pytest`` next-hop of a real router
process — started as root and as an unprivileged user (``nobody``, with a state
directory and a home of its own).

Each hostile test asserts that its escape *worked*: reading the router's
environment and processes, its state directory (``usage.pem``, ``audit.key``,
``state.db``) and home, writing outside its tree, a detached child outliving its
run into the next tenant's, a fork bomb, filling the disk, the network (a
loopback listener of this test), signals to the router. Every one of them must
fail — reported in the FINAL as a failing test (or, for a run that kills itself,
as the tenant's error) — the host side is checked too (nothing planted, the
listener saw nobody, no process of the run left), and Bob is served right after.

Then: where no sandbox can be made (no bubblewrap on ``PATH``) the RIB is refused
at load and ``atp-router policy check`` says why; and 1,000 hostile requests
leave no ``atp-tool-*`` / ``atp-tests-*`` directory behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import atp
import pytest
import trio

from atp_router.adapters.base import Prompt
from atp_router.adapters.tools import sandbox, semgrep
from atp_router.adapters.tools.base import ToolLimits
from atp_router.adapters.tools.ruff import RuffAdapter
from atp_router.adapters.tools.summariser import scan_repo
from atp_router.adapters.tools.testrunner import TestRunnerAdapter
from atp_router.wire.errors import AgentError, ClientInputError, ErrorCode
from tests.helpers import ROUTER
from tests.peers import free_port, stop_process

TOKENS = {"alice": "tok-alice-sbx0", "bob": "tok-bob-sbx0"}
ROLES = ",".join(f"{t}:{k}" for t, k in TOKENS.items())
META = {"task_type": "code_review", "languages": ["py"]}
NOBODY = 65534
#: Bob's task: one test that passes.
BOB = {"files": {"test_bob.py": "def test_bob():\n    assert 1 + 1 == 2\n"}}
RIB = {
    "agents": {"tests.pytest": {
        "layer": "L1", "tool": "pytest", "p95_ms": 3000, "timeout_ms": 60_000, "strengths": ["code_review"],
        # Small bounds keep the fork bomb and the disk fill quick on a 2-core machine.
        "options": {"max_procs": 64, "max_write_bytes": 8 << 20},
    }},
    "policies": [{"name": "tests", "match": {"task_type": "code_review"}, "fanout": ["tests.pytest"],
                  "deadline_ms": 180_000}],
}


@dataclass
class Routed:
    """A router process serving :data:`RIB` (``as_user``: root or nobody)."""

    proc: subprocess.Popen[bytes]
    url: str
    state_dir: Path
    home: Path
    secret: str
    as_user: str
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def _masked_ancestor(path: str) -> str | None:
    """The first ancestor of ``path`` others may not enter (e.g. ``/root``), if any."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        p = Path(*parts[:i])
        if not os.stat(p).st_mode & stat.S_IXOTH:
            return str(p)
    return None


def _as_nobody(argv: list[str]) -> list[str]:
    """``argv`` run as ``nobody``. Where this interpreter lives under a directory
    others may not enter (pyenv under a 0700 /root here), that directory is
    replaced, for the router only, by an empty one holding the interpreter's
    installation (read-only) — as a system-wide Python would be."""
    prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all"]
    hidden = _masked_ancestor(sys.base_prefix)
    if hidden is None:
        return prefix + argv
    box = ["bwrap", "--dev-bind", "/", "/", "--perms", "0755", "--tmpfs", hidden]
    rel = Path(sys.base_prefix).relative_to(hidden).parts
    for i in range(1, len(rel)):
        box += ["--perms", "0755", "--dir", str(Path(hidden, *rel[:i]))]
    box += ["--ro-bind", sys.base_prefix, sys.base_prefix, "--"]
    return box + prefix + argv


@contextlib.contextmanager
def router(as_user: str) -> Iterator[Routed]:
    """A router process on :data:`RIB` with tenants alice and bob, a secret in its
    environment (``OPENAI_API_KEY``), its own ``HOME`` holding a secret file, and
    a state directory of its own — all in a fresh directory under /tmp that
    ``nobody`` may enter when ``as_user`` is ``"nobody"``."""
    base = Path(tempfile.mkdtemp(prefix="atp-sbx-test-", dir="/tmp"))
    os.chmod(base, 0o755)
    secret = "sk-sandbox-" + os.urandom(8).hex()
    home, state = base / "home", base / "state"
    home.mkdir(mode=0o700)
    state.mkdir(mode=0o700)
    (home / "secret").write_text(secret)
    (home / "secret").chmod(0o600)
    rib = base / "rib.yaml"
    rib.write_text(json.dumps(RIB))
    if as_user == "nobody":
        for p in (home, home / "secret", state):
            os.chown(p, NOBODY, NOBODY)
    http, ws = free_port(), free_port()
    argv = [*ROUTER, "--policies", str(rib), "--state-dir", str(state), "--http-port", str(http),
            "--ws-port", str(ws), "--no-watch"]
    if as_user == "nobody":
        argv = _as_nobody(argv)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "ATP_ROUTER_TOKENS": ROLES, "OPENAI_API_KEY": secret}
    log = base / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd="/")
    try:
        end = time.monotonic() + 90
        while b"listening" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"router ({as_user}) did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.1)
        yield Routed(proc, f"http://127.0.0.1:{http}", state, home, secret, as_user, log)
    finally:
        stop_process(proc)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module", params=["root", "nobody"])
def routed(request) -> Iterator[Routed]:
    if os.geteuid() != 0:
        pytest.fail("tests/security/test_sandbox.py starts routers as root and as nobody: run it as root")
    with router(request.param) as r:
        yield r


async def follow(r: Routed, tenant: str, content: dict) -> list[atp.Event]:
    async with atp.Client(r.url, TOKENS[tenant], timeout=180) as c:
        _, st = await c.open_stream(task=META, content=content)
        with trio.fail_after(240):
            return [ev async for ev in c.events(st)]


def final_of(events: list[atp.Event]) -> dict:
    finals = [ev.payload for ev in events if ev.type == "FINAL"]
    assert len(finals) == 1, [(ev.type, ev.payload) for ev in events]
    return finals[0]


def outcome(events: list[atp.Event]) -> tuple[str, dict[str, str]]:
    """(the runner's summary, {test name: its failure claim}) of a FINAL."""
    result = final_of(events)["result"]
    [summary] = [a["text"] for a in result["answers"]]
    claims = {}
    for f in result["findings"]:
        node, _, rest = f["claim"].partition(" ")
        claims[node.rpartition("::")[2]] = rest
    return summary, claims


async def bob_is_served(r: Routed) -> None:
    assert r.proc.poll() is None, f"the router ({r.as_user}) died:\n{r.log.read_text(errors='replace')[-2000:]}"
    summary, claims = outcome(await follow(r, "bob", BOB))
    assert (summary, claims) == ("1 passed, 0 failed", {})


def running(marker: str) -> list[int]:
    """Host pids of live processes whose command line holds ``marker``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
                    and Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] not in "ZX"):
                out.append(int(pid))
        except (OSError, IndexError):
            continue
    return out


def hostile(tests: dict[str, str], prelude: str = "") -> dict:
    """One test file ``test_escape.py`` of ``tests`` (name → body, indented 4)."""
    src = "import os\nimport signal\nimport socket\nimport subprocess\nimport sys\nimport time\n" + prelude + "\n"
    for name, body in tests.items():
        src += f"\n\ndef {name}():\n" + "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    return {"files": {"test_escape.py": src}}


# -- the escapes -------------------------------------------------------------------


async def test_the_routers_environment_processes_and_identity_are_out_of_reach(routed: Routed):
    task = hostile({
        "test_router_environ": f"assert b'sk-sandbox-' in open('/proc/{routed.pid}/environ', 'rb').read()",
        "test_own_environ": "assert 'sk-sandbox-' in repr(dict(os.environ))",
        "test_see_the_router": (
            "seen = []\n"
            "for p in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n"
            "        seen.append(open(f'/proc/{p}/cmdline', 'rb').read())\n"
            "    except OSError:\n"
            "        pass\n"
            "assert any(b'atp-router' in c for c in seen), seen"),
        "test_root_or_the_routers_uid": f"assert os.getuid() in (0, {NOBODY}) or os.geteuid() == 0",
    })
    summary, claims = outcome(await follow(routed, "alice", task))
    assert summary == "0 passed, 4 failed", (summary, claims)
    assert "FileNotFoundError" in claims["test_router_environ"], claims
    assert "100" in claims["test_root_or_the_routers_uid"]  # a uid of the sandbox's range (100000 …)
    assert routed.secret not in json.dumps(claims) and "atp-router" not in claims["test_see_the_router"]
    await bob_is_served(routed)


async def test_the_state_directory_the_home_and_the_host_are_out_of_reach(routed: Routed):
    sd, home = routed.state_dir, routed.home
    assert (sd / "usage.pem").is_file() and (sd / "state.db").is_file()  # there to be stolen
    planted = Path(tempfile.gettempdir()) / f"atp-planted-{os.getpid()}"
    task = hostile({
        "test_usage_pem": f"assert b'PRIVATE KEY' in open('{sd}/usage.pem', 'rb').read()",
        "test_audit_key": f"open('{sd}/audit.key', 'rb').read()",
        "test_state_db": ("import sqlite3\n"
                          f"db = sqlite3.connect('file:{sd}/state.db?mode=ro', uri=True)\n"
                          "db.execute('SELECT count(*) FROM sqlite_master').fetchone()"),
        "test_list_state": f"assert os.listdir('{sd}')",
        "test_home": f"assert open('{home}/secret').read() == {routed.secret!r}",
        "test_plant_on_the_host": f"open('{planted}', 'w').write('x')\nassert os.path.exists('{planted}')",
        "test_write_the_interpreter": "open(os.__file__, 'ab').write(b'#')",
    })
    summary, claims = outcome(await follow(routed, "alice", task))
    assert summary == "1 passed, 6 failed", (summary, claims)
    # Her /tmp is a private tmpfs: the "planted" file exists only there, gone with the run.
    assert "test_plant_on_the_host" not in claims and not planted.exists()
    for t in ("test_usage_pem", "test_audit_key", "test_state_db", "test_list_state", "test_home"):
        assert "FileNotFoundError" in claims[t] or "unable to open database" in claims[t], (t, claims[t])
    assert any(e in claims["test_write_the_interpreter"] for e in ("Read-only file system", "Permission denied"))
    await bob_is_served(routed)


async def test_a_detached_child_dies_with_its_run_and_never_meets_the_next(routed: Routed):
    """Alice's test starts a ``setsid`` child meant to outlive her run by a minute
    and read or plant files in later runs; it is gone when her FINAL comes, and
    Bob's run neither sees it nor finds anything of hers."""
    marker = f"atp-detached-{os.getpid()}-{routed.as_user}"
    child = (
        "import glob, os, time\\n"
        "end = time.time() + 60\\n"
        "while time.time() < end:\\n"
        "    for d in glob.glob('/tmp/**/src', recursive=True) + [os.getcwd()]:\\n"
        "        try:\\n"
        "            open(os.path.join(d, 'planted_by_alice'), 'w').write('x')\\n"
        "        except OSError:\\n"
        "            pass\\n"
        "    time.sleep(0.05)\\n"
        f"# {marker}"
    )
    alice = hostile({"test_detach": (
        f"subprocess.Popen([sys.executable, '-c', \"{child}\"], start_new_session=True,\n"
        "                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "time.sleep(0.5)")})
    summary, _ = outcome(await follow(routed, "alice", alice))
    assert summary == "1 passed, 0 failed"
    with trio.fail_after(5):  # the run's PID namespace died with it
        while running(marker):
            await trio.sleep(0.05)
    bob = {"files": {"test_bob.py": (
        "import os\n\n\n"
        "def test_nothing_of_alice():\n"
        "    assert not os.path.exists('planted_by_alice')\n"
        "    procs = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "    for p in procs:\n"
        "        try:\n"
        f"            assert b'{marker}' not in open(f'/proc/{{p}}/cmdline', 'rb').read()\n"
        "        except OSError:\n"
        "            pass\n"
        "    assert len(procs) < 10, procs\n")}}
    summary, claims = outcome(await follow(routed, "bob", bob))
    assert (summary, claims) == ("1 passed, 0 failed", {})


async def test_a_fork_bomb_is_bounded_and_gone_after_the_run(routed: Routed):
    marker = f"atp-forkbomb-{os.getpid()}-{routed.as_user}"
    task = hostile({"test_fork_bomb": (
        "n = 0\n"
        "try:\n"
        "    for _ in range(5000):\n"
        "        if os.fork() == 0:\n"
        f"            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)  # {marker}'])\n"
        "        n += 1\n"
        "finally:\n"
        "    print('forked', n)\n"
        "assert n >= 5000")})
    summary, claims = outcome(await follow(routed, "alice", task))
    assert summary == "0 passed, 1 failed", (summary, claims)
    assert "BlockingIOError" in claims["test_fork_bomb"] or "Resource temporarily" in claims["test_fork_bomb"]
    with trio.fail_after(5):
        while running(marker):
            await trio.sleep(0.05)
    await bob_is_served(routed)


async def test_a_disk_fill_is_bounded(routed: Routed):
    fill = ("chunk = b'x' * (1 << 20)\n"
            "with open({path!r}, 'wb') as fh:\n"
            "    for _ in range(512):\n"
            "        fh.write(chunk)\n"
            "        fh.flush()")
    task = hostile({
        "test_fill_the_tree": fill.format(path="big"),
        "test_fill_tmp": fill.format(path="/tmp/big"),
        "test_fill_shm": fill.format(path="/dev/shm/big"),
        "test_many_files": ("for i in range(100_000):\n"
                            "    with open(f'f{i}', 'wb') as fh:\n"
                            "        fh.write(b'x' * 4096)"),
    })
    summary, claims = outcome(await follow(routed, "alice", task))
    assert summary == "0 passed, 4 failed", (summary, claims)
    for t, claim in claims.items():
        assert "No space left on device" in claim or "File too large" in claim, (t, claim)
    await bob_is_served(routed)


async def test_the_network_is_off(routed: Routed):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        router_port = int(routed.url.rsplit(":", 1)[1])
        task = hostile({
            "test_reach_the_listener": f"socket.create_connection(('127.0.0.1', {port}), timeout=5).close()",
            "test_reach_the_router": f"socket.create_connection(('127.0.0.1', {router_port}), timeout=5).close()",
            "test_reach_outside": "socket.create_connection(('1.1.1.1', 53), timeout=5).close()",
        })
        summary, claims = outcome(await follow(routed, "alice", task))
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody came
    assert summary == "0 passed, 3 failed", (summary, claims)
    for t, claim in claims.items():
        assert "ConnectionRefusedError" in claim or "Network is unreachable" in claim, (t, claim)
    await bob_is_served(routed)


async def test_signals_never_reach_the_router(routed: Routed):
    task = hostile({
        "test_kill_the_router": f"os.kill({routed.pid}, signal.SIGKILL)",
        "test_kill_its_group": f"os.killpg({os.getpgid(routed.pid)}, signal.SIGKILL)",
        # Every process she may signal: none but her own run's (and not herself).
        "test_kill_everything": "os.kill(-1, signal.SIGKILL)",
    })
    summary, claims = outcome(await follow(routed, "alice", task))
    assert summary == "0 passed, 3 failed", (summary, claims)
    assert all("ProcessLookupError" in c for c in claims.values()), claims
    assert routed.proc.poll() is None
    # A run that kills itself ends without a report: her error (a canary run the
    # same way passes), not the runner's.
    events = await follow(routed, "alice", hostile({"test_kill_itself": "os.kill(os.getpid(), signal.SIGKILL)"}))
    errors = [ev.payload for ev in events if ev.type == "ERROR"]
    assert errors and all("caused by this task" in e["reason"] for e in errors), [e.payload for e in events]
    assert routed.proc.poll() is None
    await bob_is_served(routed)


async def test_concurrent_runs_never_share_a_uid(tmp_path):
    box = sandbox.Sandbox(tool="id", limits=ToolLimits())
    uids: list[int] = []

    async def one() -> None:
        # A tree of its own, as the adapters give each run (a root router hands it to the run's user).
        tree = tempfile.mkdtemp(prefix="atp-test-tree-", dir=str(tmp_path.parent if os.geteuid() else "/tmp"))
        try:
            res = await box.run(["/bin/sh", "-c", "id -u; sleep 1"], tree=tree)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        assert res.returncode == 0, res.stderr
        uids.append(int(res.stdout))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
    assert len(set(uids)) == 4 and all(u in sandbox.UID_RANGE for u in uids), uids


# -- refuse rather than weaken -----------------------------------------------------


def test_without_bubblewrap_the_rib_is_refused_and_policy_check_says_why(tmp_path):
    rib = tmp_path / "rib.yaml"
    rib.write_text(json.dumps(RIB))
    env = {"PATH": "/nonexistent", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    check = subprocess.run([*ROUTER, "policy", "check", str(rib)], env=env, capture_output=True, text=True,
                           timeout=120, check=False)
    assert check.returncode == 1, check
    assert (f"{rib}: agents.tests.pytest: sandbox: bubblewrap is not installed (no 'bwrap' on PATH)"
            in check.stderr), check.stderr
    state = tmp_path / "state"
    start = subprocess.run([*ROUTER, "--policies", str(rib), "--state-dir", str(state), "--http-port",
                            str(free_port()), "--ws-port", str(free_port()), "--no-watch"],
                           env=env, capture_output=True, text=True, timeout=120, check=False)
    assert start.returncode != 0
    assert "agents.tests.pytest: sandbox: bubblewrap is not installed" in start.stdout + start.stderr
    with_bwrap = subprocess.run([*ROUTER, "policy", "check", str(rib)], capture_output=True, text=True,
                                timeout=120, check=False)
    assert with_bwrap.returncode == 0, with_bwrap.stderr


def test_a_root_router_without_a_pids_cgroup_is_refused(monkeypatch):
    """RLIMIT_NPROC does not bind host uid 0: without the cgroup, a root router
    has no process-count limit for its runs, so it refuses."""
    if os.geteuid() != 0:
        pytest.fail("run as root")
    monkeypatch.setattr(sandbox, "_probed", [])
    monkeypatch.setattr(sandbox, "_own_cgroup", lambda controller: None)
    with pytest.raises(ValueError, match="no writable cgroup v1 'pids' controller"):
        TestRunnerAdapter("t")


def test_a_sandbox_never_mounts_the_routers_state_or_home(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_forbidden", set())
    sandbox.forbid_paths(tmp_path / "state")
    box = sandbox.Sandbox(tool="t", limits=ToolLimits())
    assert not any(str(tmp_path) in m for m in box.mounts)
    with pytest.raises(sandbox.SandboxUnavailable, match="holds .*state"):
        box._checked([str(tmp_path)])
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    with pytest.raises(sandbox.SandboxUnavailable, match="router's home or state"):
        box._checked([str(tmp_path / "home")])


def test_a_checkout_under_tmp_is_refused_at_load_and_start_naming_the_cause_and_the_fix(tmp_path):
    """Every run gets a private ``/tmp``, so the interpreter of a checkout (and
    its ``.venv``) under ``/tmp`` cannot be seen inside a sandbox: the RIB is
    refused at load and at start with one line naming the cause and the fix, not
    with bubblewrap's ``exec: …/python: not found`` (finding "checkout under
    /tmp"). The checkout here: a copy of the code under test and a venv beside it."""
    checkout = Path(tempfile.mkdtemp(prefix="atp-test-checkout-", dir="/tmp"))
    checkout.chmod(0o755)  # as `git clone` leaves it: any user may read it
    try:
        shutil.copytree(Path(sandbox.__file__).resolve().parents[2], checkout / "atp_router",
                        ignore=shutil.ignore_patterns("__pycache__"))
        venv.create(checkout / ".venv", with_pip=False, symlinks=True)
        # Its dependencies: this interpreter's site-packages (behind PYTHONPATH, so the copy's atp_router is the one run).
        site = checkout / ".venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        (site / "atp_test_deps.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        python = checkout / ".venv" / "bin" / "python"
        rib = tmp_path / "rib.yaml"
        rib.write_text(json.dumps({
            "agents": {"lint.ruff": {"layer": "L1", "tool": "ruff", "p95_ms": 3000, "timeout_ms": 60_000,
                                     "strengths": ["code_review"]}},
            "policies": [{"name": "lint", "match": {"task_type": "code_review"}, "fanout": ["lint.ruff"]}],
        }))
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        router = [str(python), "-m", "atp_router.deploy.cli"]  # run in the checkout, as scripts/demo.sh does
        line = (f"agents.lint.ruff: sandbox: the interpreter {python} lives under /tmp, which every sandboxed run "
                "gets private (it cannot be seen inside); keep the checkout (and its .venv) outside /tmp")
        check = subprocess.run([*router, "policy", "check", str(rib)], env=env, cwd=checkout, capture_output=True,
                               text=True, timeout=120, check=False)
        assert check.returncode == 1, check
        assert f"{rib}: {line}" in check.stderr.splitlines(), check.stderr
        start = subprocess.run([*router, "--policies", str(rib), "--state-dir", str(tmp_path / "state"),
                                "--http-port", str(free_port()), "--ws-port", str(free_port()), "--no-watch"],
                               env=env, cwd=checkout, capture_output=True, text=True, timeout=120, check=False)
        assert start.returncode != 0
        assert line in start.stdout + start.stderr, start
    finally:
        shutil.rmtree(checkout, ignore_errors=True)


def test_the_probe_names_an_interpreter_no_run_can_see(monkeypatch):
    """:func:`~atp_router.adapters.tools.sandbox.probe` says why, without trying a run
    that would fail with ``exec: …: not found``, for an interpreter outside the
    router's checkout too."""
    tmp = Path(tempfile.mkdtemp(prefix="atp-test-python-", dir="/tmp"))
    try:
        (tmp / "bin").mkdir()
        (tmp / "bin" / "python3").symlink_to(os.path.realpath(sys.executable))
        monkeypatch.setattr(sys, "executable", str(tmp / "bin" / "python3"))
        monkeypatch.setattr(sys, "prefix", str(tmp))
        monkeypatch.setattr(sandbox, "_probed", [])
        assert sandbox.probe() == (f"the interpreter {tmp}/bin/python3 lives under /tmp, which every sandboxed run "
                                   "gets private (it cannot be seen inside); install the router's interpreter and "
                                   "its environment outside /tmp")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_tool_or_file_a_run_cannot_see_is_refused_naming_it(monkeypatch):
    """An executable, its ``#!`` interpreter (as written or where a symlink
    leads) or a file a run mounts under a directory every run gets private is
    refused when the policy is made, with the path, the cause and the fix."""
    private = " which every sandboxed run gets private (it cannot be seen inside);"
    tmp = Path(tempfile.mkdtemp(prefix="atp-test-tool-", dir="/tmp"))
    host = Path(tempfile.mkdtemp(prefix="atp-test-tool-", dir="/var/tmp"))  # a host directory runs can see
    shm = Path(tempfile.mkdtemp(prefix="atp-test-tool-", dir="/dev/shm"))
    try:
        exe = tmp / "bin" / "ruff"
        exe.parent.mkdir()
        shutil.copy("/bin/true", exe)
        with pytest.raises(sandbox.SandboxUnavailable) as e:
            sandbox.Sandbox(tool="ruff", limits=ToolLimits(), executables=[str(exe)])
        assert str(e.value) == f"sandbox: the ruff executable {exe} lives under /tmp,{private} install it outside /tmp"
        (host / "ruff").symlink_to(exe)
        with pytest.raises(sandbox.SandboxUnavailable) as e:
            sandbox.Sandbox(tool="ruff", limits=ToolLimits(), executables=[str(host / "ruff")])
        assert str(e.value) == (f"sandbox: the ruff executable {host / 'ruff'} (really {exe}) lives under /tmp,"
                                f"{private} install it outside /tmp")
        shutil.copy("/bin/true", shm / "ruff")
        with pytest.raises(sandbox.SandboxUnavailable) as e:
            sandbox.Sandbox(tool="ruff", limits=ToolLimits(), executables=[str(shm / "ruff")])
        assert str(e.value) == (f"sandbox: the ruff executable {shm / 'ruff'} lives under /dev/shm,{private} "
                                "install it outside /dev/shm")
        script = host / "bandit"
        script.write_text(f"#!{tmp}/bin/python3 -I\nprint('hi')\n")
        script.chmod(0o755)
        with pytest.raises(sandbox.SandboxUnavailable) as e:
            sandbox.Sandbox(tool="bandit", limits=ToolLimits(), executables=[str(script)])
        assert str(e.value) == (f"sandbox: the bandit executable's #! interpreter {tmp}/bin/python3 lives under "
                                f"/tmp,{private} install it outside /tmp")
        # A file runs mount (semgrep's rules): refused at load, and by the run itself.
        rules = tmp / "rules"
        shutil.copytree(semgrep.RULES_DIR, rules)
        box = sandbox.Sandbox(tool="semgrep", limits=ToolLimits())
        want = f"sandbox: the semgrep file {rules}/{semgrep.RULE_PACKS[0]}.yaml lives under /tmp,{private} " \
               "keep it outside /tmp"
        with pytest.raises(sandbox.SandboxUnavailable) as e:
            box.check([str(rules / f"{semgrep.RULE_PACKS[0]}.yaml")])
        assert str(e.value) == want
        assert box._checked(["/dev/null"]) == []  # mypy's and pylint's --rcfile=/dev/null: every run's /dev has it
        with pytest.raises(sandbox.SandboxUnavailable) as e:
            trio.run(functools.partial(box.run, ["/bin/true"], tree=str(host),
                                       ro_paths=[str(rules / f"{semgrep.RULE_PACKS[0]}.yaml")]))
        assert str(e.value) == want
        monkeypatch.setattr(semgrep, "RULES_DIR", rules)
        with pytest.raises(sandbox.SandboxUnavailable) as e:
            semgrep.SemgrepAdapter()
        assert str(e.value) == want
    finally:
        for d in (tmp, host, shm):
            shutil.rmtree(d, ignore_errors=True)


# -- no leaks, no crashes on absurd input -----------------------------------------


async def test_a_thousand_hostile_requests_leave_no_directory_behind(tmp_path, monkeypatch):
    """1,000 hostile tasks to ruff and pytest — refused early (absurd paths 2,000
    levels deep, traversal, non-text, trees that cannot be laid out, over-limit
    sizes) and some that run (a test that sleeps past the limit, one that kills
    its own run, a test file that is not Python) — each ends in the tenant's
    error or a report, never an uncaught exception, and not one ``atp-tool-*``
    or ``atp-tests-*`` directory is left (the adapters' temp dir is this test's)."""
    # The adapters' temp dir is this test's own, under /tmp (any user may search it: a root
    # router's runs are unprivileged users; the router's own atp-* dirs are made searchable).
    tmp_path = Path(tempfile.mkdtemp(prefix="atp-thousand-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ruff = RuffAdapter("ruff", scope="file", limits=ToolLimits(timeout_s=20, max_files=50))
    tests = TestRunnerAdapter("tests", limits=ToolLimits(timeout_s=10, max_files=50))
    deep = "/".join(["d"] * 2000) + "/x.py"
    refused = [
        {"files": {deep: "x = 1\n"}},
        {"files": {"a/" * 70 + "x.py": "x = 1\n"}},
        {"files": {"x" * 300 + ".py": "x = 1\n"}},
        {"files": {"../x.py": "x = 1\n"}},
        {"files": {"/etc/x.py": "x = 1\n"}},
        {"files": {"a.py": 7}},
        {"files": {"a.py": "x", "a.py/b.py": "y"}},
        {"files": {f"f{i}.py": "" for i in range(60)}},
        {"files": {"a.py": "\ud800"}},
        {"files": "nope"},
        "nope",
    ]
    before = sorted(os.listdir(tmp_path))
    outcomes: dict[str, int] = {}

    async def one(adapter, content) -> None:
        try:
            async for _ in adapter.stream(Prompt(task_type="code_review", content=content)):
                pass
            outcomes["report"] = outcomes.get("report", 0) + 1
        except ClientInputError:
            outcomes["client"] = outcomes.get("client", 0) + 1

    n = 0
    for i in range(990):
        content = refused[i % len(refused)]
        if isinstance(content, dict) and isinstance(content.get("files"), dict):
            content = {**content, "files": {**content["files"], "test_x.py": "def test_x():\n    pass\n"}} \
                if i % 2 else content
        await one(tests if i % 2 else ruff, content)
        n += 1
    running_tasks = [
        (tests, {"files": {"test_sleep.py": "import time\n\n\ndef test_sleep():\n    time.sleep(60)\n"}}),
        (tests, {"files": {"test_kill.py": "import os, signal\n\n\ndef test_kill():\n    os.kill(-1, signal.SIGKILL)\n"}}),
        (tests, {"files": {"test_bad.py": "def test_(:\n"}}),
        (tests, {"files": {"conftest.py": "import os\nos._exit(3)\n", "test_a.py": "def test_a():\n    pass\n"}}),
        (ruff, {"files": {"a.py": "x = (" * 5000 + ")" * 5000 + "\n"}}),
        (ruff, {"files": {"-rf.py": "import os\n", "--help.py": "x = 1\n"}}),
        (tests, BOB),
        (ruff, {"files": {"a.py": "print(undefined)\n"}}),
        (tests, {"files": {"test_ok.py": "def test_ok():\n    pass\n"}}),
        (ruff, {"files": {"b.py": "x = 1\n"}}),
    ]
    async with trio.open_nursery() as nursery:
        for adapter, content in running_tasks:
            nursery.start_soon(one, adapter, content)
            n += 1
    assert n == 1000
    print(f"\n1,000 hostile requests: {outcomes}")
    assert outcomes["client"] >= 990 and outcomes.get("report", 0) >= 4
    left = sorted(os.listdir(tmp_path))
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert left == before == []
    assert ruff.health().error_rate == 0 and tests.health().error_rate == 0


async def test_a_crash_only_one_task_causes_is_the_tasks_and_a_broken_runner_is_the_runners():
    """The attribution's two sides on one runner: a conftest that kills pytest is
    the task's (its canary passes); the same runner whose canary fails (no
    pytest left to run) is the next-hop's AgentError."""
    runner = TestRunnerAdapter("tests", limits=ToolLimits(timeout_s=30))
    crash = {"files": {"conftest.py": "import os\nos._exit(3)\n", "test_a.py": "def test_a():\n    pass\n"}}
    with pytest.raises(ClientInputError) as e:
        await runner.review(Prompt(task_type="code_review", content=crash))
    assert e.value.code is ErrorCode.EPROTO and "caused by this task" in e.value.reason

    broken = TestRunnerAdapter("tests", limits=ToolLimits(timeout_s=30))
    broken.canary_files = {"test_atp_canary.py": b"def test_add():\n    assert False\n"}  # a runner that fails all
    with pytest.raises(AgentError) as e:
        await broken.review(Prompt(task_type="code_review", content=crash))
    assert not isinstance(e.value, ClientInputError) and "a canary task failed on pytest too" in e.value.reason


def test_the_summariser_survives_a_file_nested_past_the_parser(tmp_path):
    (tmp_path / "deep.py").write_text("x = " + "(" * 100_000 + ")" * 100_000 + "\n")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\nx = " + "[" * 100_000 + "]" * 100_000 + "\n")
    facts = scan_repo(str(tmp_path))
    assert "deep.py" in facts.unparsable and "pyproject.toml" in facts.unparsable


@pytest.mark.skipif(os.geteuid() != 0, reason="the host-uid drop is what a root router does; an unprivileged "
                    "router's runs are its own unprivileged user already")
async def test_a_root_routers_run_is_an_unprivileged_host_user_that_cannot_write_kernel_settings():
    """Review of issue 19: bwrap maps the sandbox's uid to its caller's, so a root
    router's runs were host uid 0 inside their namespaces — no capability, yet the
    owner of /proc/sys (core_pattern: a pipe handler the kernel runs as root) and of
    root's keyrings. Each run now starts as its own unprivileged host uid: seen from
    the host, the run's processes are that uid; inside, the write is refused."""
    box = sandbox.Sandbox(tool="sh", limits=ToolLimits())
    tree = tempfile.mkdtemp(prefix="atp-test-tree-")
    marker = f"atp-uid-marker-{os.getpid()}"
    # The write puts back the value it read: were it allowed, it would change nothing on the host.
    script = ("v=$(cat /proc/sys/kernel/core_pattern); "
              "if (echo \"$v\" > /proc/sys/kernel/core_pattern) 2>/dev/null; then echo WROTE; else echo REFUSED; fi; "
              "if cat /proc/keys 2>/dev/null | grep -q '_uid.0'; then echo ROOTKEYS; fi; "
              f"exec /bin/sh -c 'sleep 2; :' {marker}")  # a marker the host finds in its command line
    host_uids: set[int] = set()

    def look() -> None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    status = Path(f"/proc/{pid}/status").read_text()
                    host_uids.add(int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1]))
            except (OSError, StopIteration):
                pass

    async def watch() -> None:
        while True:
            look()
            await trio.sleep(0.1)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            res = await box.run(["/bin/sh", "-c", script], tree=tree)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    assert host_uids and all(u in sandbox.UID_RANGE for u in host_uids), host_uids  # never host uid 0
    assert b"REFUSED" in res.stdout and b"WROTE" not in res.stdout and b"ROOTKEYS" not in res.stdout, res.stdout
