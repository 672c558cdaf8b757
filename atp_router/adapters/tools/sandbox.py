"""The sandbox every local next-hop's subprocess runs in (issue 19; spec §11, §19):
bubblewrap (``bwrap``, Debian ``bubblewrap``) namespaces, a cgroup or rlimits,
and private, size-bounded file systems.

A :class:`Sandbox` is the policy of one next-hop (what is mounted, the
environment, the network, the limits); :meth:`Sandbox.run` runs one command in a
sandbox of its own and removes everything the run made when it ends.

One run, from the inside:

* **namespaces**: new user, PID, network (unless the RIB's ``allow_network``:
  then the host's network), mount, IPC, UTS and — where the kernel allows —
  cgroup namespaces; ``--disable-userns`` (no nested user namespace, so no
  capability can be regained inside); all capabilities dropped
  (``--cap-drop ALL``); ``--new-session`` (no terminal to inject into);
  ``--die-with-parent``;
* **a uid of its own**: ``--uid/--gid`` from :data:`UID_RANGE`, never shared by
  two runs of this process at once (each run is also in its own user namespace,
  so no two runs can signal, trace or read each other whatever their uids);
* **what it sees**: a new root (read-only after set-up) holding only the system
  directories (``/usr``, ``/bin``, ``/sbin``, ``/lib*`` and a few files of
  ``/etc`` — the dynamic loader's, the time zone, the public TLS trust
  anchors: :data:`ETC_FILES`, plus
  :data:`ETC_NETWORK_FILES` with ``allow_network``), the interpreter's and the
  tool's installation prefixes (read-only: ``sys.prefix``, ``sys.base_prefix``,
  the prefix of the tool's executable and of its ``#!`` interpreter), a new
  ``/proc`` (its own PIDs only), a minimal ``/dev``, and, private to the run and
  size-bounded, ``/tmp`` and ``/dev/shm``. Never the router's state directory,
  its home or its keys: a mount that would hold one of :func:`forbidden_paths`
  is refused (:class:`SandboxUnavailable`). Nor the host's ``/tmp``: a path a
  run needs (the interpreter, the tool's executable and its ``#!`` interpreter —
  as written and where their symlinks lead —, their installation prefixes, a
  file a run mounts) under a directory every run gets private
  (:data:`PRIVATE_DIRS`) cannot be seen inside, so the policy is refused
  (:class:`SandboxUnavailable` naming the path and the fix: e.g. keep the
  checkout and its ``.venv`` outside ``/tmp``), never made to work by binding
  the host's directory in;
* **the work tree**: the host directory the adapter wrote is mounted read-only
  at ``/run/atp-in`` and copied into a private tmpfs mounted at the same path
  as on the host (so the tool's paths are the adapter's), which is the
  command's working directory;
* **environment**: only what :meth:`Sandbox.environment` gives (``PATH`` of the
  tool's and the system's ``bin`` directories, ``HOME``/``TMPDIR`` ``/tmp``,
  ``LANG`` ``C.UTF-8``) plus what the adapter adds; ``--clearenv`` first, so
  nothing of the router's environment (API keys, ``ATP_HMAC_KEYS``) reaches it.

Limits of one run (:class:`~atp_router.adapters.tools.base.ToolLimits`):

==========================  ===========================================================
limit                       how
==========================  ===========================================================
``timeout_s``               wall clock of the run; then the sandbox is killed
``cpu_s``                   ``RLIMIT_CPU`` (SIGXCPU, SIGKILL a second later)
``address_space_bytes``     ``RLIMIT_AS`` of each process, and the run's memory
                            cgroup (``memory.limit_in_bytes``: resident memory and
                            its tmpfs pages together) where the host gives one
``max_procs``               processes and threads of the run together: the run's
                            ``pids`` cgroup (``pids.max``) where the host gives a
                            writable one, and ``RLIMIT_NPROC`` set inside the run's
                            user namespace (the kernel counts it per namespace:
                            per run, never across runs). A root router without a
                            writable ``pids`` cgroup is refused: ``RLIMIT_NPROC``
                            does not bind host uid 0
``max_write_bytes``         what the run may write beyond its tree's copy: the
                            private ``/tmp`` tmpfs (holding the copy when the host's
                            temporary directory is under ``/tmp``; else the copy's
                            own tmpfs has the same bound) is the copy's size plus
                            ``max_write_bytes``, all files together; also
                            ``RLIMIT_FSIZE``; ``/dev/shm`` is a tmpfs of
                            :data:`SHM_BYTES`; everything else is read-only
``output_bytes``            stdout + stderr (+ the report pipe) read; past it the run
                            is killed
==========================  ===========================================================

When a run ends — normally, on a limit, on cancellation, on an exception in the
router — everything it started is gone: its PID namespace dies with its first
process (a detached ``setsid`` child included), its cgroup is swept with
SIGKILL and removed, and its work tree on the host is removed by the adapter.

:func:`probe` checks once per process (cached) that a sandbox can be made here
(``bwrap`` present, user namespaces allowed, a process-count limit that binds)
and returns the precise reason when not; :meth:`Sandbox.check` raises it as
:class:`SandboxUnavailable` (a ``ValueError``), which the adapter registry turns
into a refusal of the RIB at load (``PolicyError``, also printed by
``atp-router policy check``). Nothing ever falls back to running tenant code
without the sandbox.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import trio

if TYPE_CHECKING:
    from atp_router.adapters.tools.base import ToolLimits

__all__ = [
    "ETC_FILES",
    "ETC_NETWORK_FILES",
    "PRIVATE_DIRS",
    "REPORT",
    "SHM_BYTES",
    "UID_RANGE",
    "RunResult",
    "Sandbox",
    "SandboxUnavailable",
    "forbid_paths",
    "forbidden_paths",
    "probe",
]

KiB = 1024
MiB = 1024 * KiB

#: Size of the run's private ``/dev/shm`` (POSIX semaphores, small shared buffers).
SHM_BYTES = 4 * MiB
#: Uids (and gids) the runs get inside their namespace: ``range(100_000, 160_000)``.
UID_RANGE = range(100_000, 160_000)
#: Files and folders of ``/etc`` mounted read-only (when present): the dynamic
#: loader's, the time zone, and the public TLS trust anchors (semgrep-core loads
#: them at start even offline).
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives",
             "/etc/ssl/certs", "/etc/ca-certificates", "/etc/pki/ca-trust")
#: More of ``/etc`` with ``allow_network``: name resolution.
ETC_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/gai.conf", "/etc/services",
                     "/etc/protocols")
#: An argument of :meth:`Sandbox.run`'s command replaced by a path inside the
#: sandbox that writes to the run's report pipe (its bytes come back as
#: :attr:`RunResult.report`), e.g. ``f"--junitxml={REPORT}"``.
REPORT = "@ATP_REPORT@"

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_STAGE = "/run/atp-in"
#: Directories every run gets a private mount of (a tmpfs, a new ``/proc`` or
#: ``/dev``, its work tree's stage), mounted over whatever the host has there: a
#: host path under one cannot be seen inside a sandbox. Most specific first.
PRIVATE_DIRS = ("/tmp", "/dev/shm", "/dev", "/proc", _STAGE)
#: Device files every run's own ``/dev`` has (an analyser's ``--rcfile=/dev/null``):
#: named, they need no mount.
_DEV_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
#: The router's checkout (``atp_router/adapters/tools/sandbox.py`` is in it), named in
#: the fix when the interpreter's environment is its ``.venv``.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_CGROUP_ROOT = "/sys/fs/cgroup"
_READ_CHUNK = 64 * KiB
_PAGE = 4 * KiB
# The shell step before the command: RLIMIT_NPROC inside the run's user namespace
# (the kernel counts it per namespace there: per run), copy the read-only tree
# into the run's tmpfs, enter it, become the command (same PID: its exit status is
# the run's).
_ENTER = ('n=$1 src=$2 dst=$3; shift 3; { ulimit -p "$n" 2>/dev/null || ulimit -u "$n"; } && '
          'cp -R -- "$src"/. "$dst" && cd "$dst" && exec "$@"')
_SWEEP_S = 5.0

_forbidden: set[str] = set()
_forbidden_lock = threading.Lock()


class SandboxUnavailable(ValueError):
    """A sandbox cannot be made here (or not with this policy); the message says
    why and what would fix it."""


def forbid_paths(*paths: str | os.PathLike[str]) -> None:
    """Never mount ``paths`` (nor a directory holding one) into a sandbox: the
    router registers its state directory here at start-up."""
    with _forbidden_lock:
        _forbidden.update(os.path.realpath(p) for p in paths)


def forbidden_paths() -> list[str]:
    """What no sandbox mounts: the paths given to :func:`forbid_paths`, the
    router's home directory (``$HOME`` and the password entry's) and the
    running user's ``~/.ssh``-style secrets with it. Resolved paths, sorted."""
    out = set(_forbidden)
    homes = {os.environ.get("HOME", "")}
    try:
        import pwd

        homes.add(pwd.getpwuid(os.geteuid()).pw_dir)
    except (ImportError, KeyError):
        pass
    out.update(os.path.realpath(h) for h in homes if h and h != "/")
    return sorted(out)


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _private_dir(path: str) -> str | None:
    """The :data:`PRIVATE_DIRS` entry that hides absolute ``path`` inside a
    sandbox, or ``None`` when a mount of it can be seen there."""
    path = os.path.normpath(path)
    return next((d for d in PRIVATE_DIRS if _within(path, d)), None)


def _hidden(what: str, path: str, fix: str) -> str | None:
    """The reason (without the ``sandbox:`` prefix) when ``path`` — as written or
    where its symlinks lead — lies under a :data:`PRIVATE_DIRS` entry: ``what``
    names it, ``fix`` says what to do (``{dir}``: that entry). ``None`` when it
    can be seen inside."""
    real = os.path.realpath(path)
    for form in (path, real):
        d = _private_dir(form)
        if d is not None:
            shown = path if form == path else f"{path} (really {real})"
            return (f"the {what} {shown} lives under {d}, which every sandboxed run gets private (it cannot be "
                    f"seen inside); {fix.replace('{dir}', d)}")
    return None


def _interpreter_hidden() -> str | None:
    """:func:`_hidden`'s reason for this interpreter (``sys.executable``) or its
    installation (``sys.prefix``, ``sys.base_prefix``, ``sys.exec_prefix``)."""
    if _within(os.path.normpath(sys.prefix), _CHECKOUT):
        fix = "keep the checkout (and its .venv) outside {dir}"
    else:
        fix = "install the router's interpreter and its environment outside {dir}"
    reason = _hidden("interpreter", sys.executable, fix) if sys.executable else None
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix):
        reason = reason or _hidden("interpreter's installation", p, fix)
    return reason


@dataclass(slots=True)
class RunResult:
    """What one run left: its exit status (negative: killed by that signal —
    bwrap reports a command killed by signal N as status 128 + N, read back as
    -N; ``None`` when the run was killed at a limit), its stdout, stderr and report pipe
    (bytes, at most ``output_bytes`` together), and which limit stopped it:
    ``timed_out`` (wall clock), ``capped`` (output), ``oom`` (the memory cgroup's
    limit), ``procs_capped`` (a fork refused at ``max_procs``)."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    report: bytes | None = None
    timed_out: bool = False
    capped: bool = False
    oom: bool = False
    procs_capped: bool = False


# -- probing -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Host:
    """What :func:`probe` found: the bwrap binary, how process counts are bounded
    (``"cgroup"`` or ``"rlimit"``), and the cgroup directories to make runs in."""

    bwrap: str
    procs_by: str
    pids_cgroup: str | None
    memory_cgroup: str | None


_probe_lock = threading.Lock()
_probed: list[_Host | str] = []


def probe() -> str | None:
    """``None`` when a sandbox can be made here, else the precise reason. Checks
    once per process (cached; blocking, ~50 ms: call it off the event loop when
    the loop runs): bwrap on ``PATH``, a real run of this interpreter in a full
    sandbox, and a process-count limit that binds."""
    host = _host()
    return host if isinstance(host, str) else None


def _host() -> _Host | str:
    with _probe_lock:
        if not _probed:
            _probed.append(_probe())
        return _probed[0]


def _own_cgroup(controller: str) -> str | None:
    """The directory of this process's cgroup of v1 ``controller``, if it is
    mounted and we may make cgroups under it."""
    base = os.path.join(_CGROUP_ROOT, controller)
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            here = os.path.normpath(base + path)
            test = os.path.join(here, f"atp-probe-{os.getpid()}")
            try:
                os.mkdir(test)
                os.rmdir(test)
            except OSError:
                return None
            return here
    return None


def _probe() -> _Host | str:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return ("bubblewrap is not installed (no 'bwrap' on PATH): install Debian's 'bubblewrap' "
                "(scripts/setup.sh does) — tenant code never runs outside a sandbox")
    pids = _own_cgroup("pids")
    memory = _own_cgroup("memory")
    if pids is None and os.geteuid() == 0:
        return ("no writable cgroup v1 'pids' controller (/sys/fs/cgroup/pids) and the router runs as root, "
                "whose processes RLIMIT_NPROC does not bound: mount the pids controller, or run the router "
                "as a user of its own")
    hidden = _interpreter_hidden()
    if hidden is not None:
        return hidden
    host = _Host(bwrap=bwrap, procs_by="cgroup" if pids else "rlimit", pids_cgroup=pids, memory_cgroup=memory)
    from atp_router.adapters.tools.base import DEFAULT_LIMITS

    box = Sandbox(tool="probe", limits=DEFAULT_LIMITS)
    tree = tempfile.mkdtemp(prefix="atp-tool-probe-")
    drop = _drop_uid(UID_RANGE[0])
    try:
        with open(os.path.join(tree, "probe.txt"), "w") as fh:
            fh.write("ok")
        if drop is not None:
            _give_tree(tree, drop)
        tree_fd = os.open(tree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        argv = box.argv([sys.executable, "-I", "-c",
                         "import os; print(os.getuid(), os.getpid(), open('probe.txt').read())"],
                        tree=tree, uid=UID_RANGE[0], bwrap=bwrap, tree_fd=tree_fd)
        try:
            done = subprocess.run(argv, check=False, capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
                                  env={}, pass_fds=(tree_fd,),
                                  preexec_fn=functools.partial(_child_setup, box._rlimits(host), (), drop))
        except (OSError, subprocess.SubprocessError) as e:
            return f"bubblewrap ({bwrap}) could not run: {e}"
        finally:
            os.close(tree_fd)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    want = f"{UID_RANGE[0]} 2 ok"
    if done.returncode != 0 or done.stdout.decode(errors="replace").strip() != want:
        err = done.stderr.decode(errors="replace").strip()[-300:] or f"exit status {done.returncode}"
        hint = ""
        if drop is not None and ("permission denied" in err.lower() or "no such file" in err.lower()):
            hint = (f" (the router runs as root, and each run starts as an unprivileged user of its own, who "
                    f"cannot reach this interpreter or its libraries: {sys.prefix}, {sys.base_prefix}; install "
                    "the router where any user may read it — scripts/setup.sh builds .venv on /usr/bin/python3 — "
                    "or run the router as a user of its own)")
        elif "namespace" in err.lower() or "permission" in err.lower():
            hint = (" (user namespaces unavailable: check sysctl user.max_user_namespaces > 0 and, on Debian/"
                    "Ubuntu, kernel.unprivileged_userns_clone / kernel.apparmor_restrict_unprivileged_userns)")
        return f"bubblewrap ({bwrap}) cannot make a sandbox here: {err}{hint}"
    return host


# -- the sandbox -------------------------------------------------------------------


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_seq = itertools.count(1)


@contextlib.contextmanager
def _uid() -> Iterator[int]:
    """A uid of :data:`UID_RANGE` no other run of this process holds."""
    with _uid_lock:
        start = UID_RANGE[0] + (next(_seq) % len(UID_RANGE))
        for uid in itertools.chain(range(start, UID_RANGE[-1] + 1), range(UID_RANGE[0], start)):
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                break
        else:  # pragma: no cover - 60,000 concurrent runs
            raise RuntimeError("no free sandbox uid")
    try:
        yield uid
    finally:
        with _uid_lock:
            _uids_in_use.discard(uid)


def _prefix_of(path: str) -> str:
    """The installation prefix of an executable (``<prefix>/bin/<name>``)."""
    return os.path.dirname(os.path.dirname(path))


def _shebang(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    return os.fsdecode(words[0]) if words else None


def install_paths(executables: Iterable[str]) -> list[str]:
    """The directories to mount read-only for ``executables`` and this
    interpreter: ``sys.prefix``, ``sys.base_prefix``, ``sys.exec_prefix``, and for
    each executable (symlinks followed) its prefix and its ``#!`` interpreter's.
    System directories are left out (always mounted). Sorted, no path inside
    another."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, _prefix_of(os.path.realpath(sys.executable))}
    for exe in executables:
        for form in (exe, os.path.realpath(exe)):
            paths.add(_prefix_of(form))
            interp = _shebang(form)
            if interp:
                paths.add(_prefix_of(interp))
                paths.add(_prefix_of(os.path.realpath(interp)))
    real = {os.path.normpath(p) for p in paths if p and os.path.isdir(p)}
    real = {p for p in real if not any(_within(p, s) for s in _SYSTEM_DIRS)}
    out: list[str] = []
    for p in sorted(real):
        if not any(_within(p, q) for q in out):
            out.append(p)
    return out


def _tree_bytes(tree: str) -> int:
    """What the tree takes in a tmpfs: its files' bytes rounded up to pages, a
    page per directory and file."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        total += _PAGE * (1 + len(dirnames))
        for f in filenames:
            try:
                size = os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                continue
            total += _PAGE + -(-size // _PAGE) * _PAGE
    return total


def _child_setup(limits: Sequence[tuple[int, tuple[int, int]]], cgroups: Sequence[str],
                 drop_to: int | None = None) -> None:
    """``preexec_fn`` (in the forked child, before ``exec`` of bwrap): rlimits,
    then join the run's cgroups, so bwrap and everything it starts are in them
    from the first instruction; then, for a root router (``drop_to``), become
    that unprivileged host uid/gid with no supplementary groups — bwrap maps the
    sandbox's uid to its caller's, and a run mapped to host uid 0 could write
    root-owned kernel interfaces (``/proc/sys``) and reach root's keyrings
    without any capability."""
    for res, pair in limits:
        resource.setrlimit(res, pair)
    pid = str(os.getpid()).encode()
    for cg in cgroups:
        fd = os.open(os.path.join(cg, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)
    if drop_to is not None:
        os.setgroups([])
        os.setresgid(drop_to, drop_to, drop_to)
        os.setresuid(drop_to, drop_to, drop_to)


def _drop_uid(uid: int) -> int | None:
    """The host uid a run starts as: ``uid`` when the router is root, else None
    (it runs as the router's own unprivileged user, in a user namespace)."""
    return uid if os.geteuid() == 0 else None


def _give_tree(tree: str, uid: int) -> None:
    """Hand a run's host work tree to the unprivileged ``uid`` a root router's run
    starts as (owner only, 0700), and let it search (not list) the router's own
    temporary parent directories (``atp-*``). Raises :class:`SandboxUnavailable`
    for another parent it could not search (a ``TMPDIR`` only root may enter:
    give the router one any user may search, like ``/tmp``)."""
    for root, dirs, files in os.walk(tree):
        os.lchown(root, uid, uid)
        for name in (*dirs, *files):
            os.lchown(os.path.join(root, name), uid, uid)
    os.chmod(tree, 0o700)
    parent = os.path.dirname(os.path.abspath(tree))
    while parent != "/":
        mode = os.stat(parent).st_mode
        if not mode & 0o001:
            if not os.path.basename(parent).startswith("atp-"):
                raise SandboxUnavailable(f"sandbox: {parent} is not searchable by other users, so the run's "
                                         "unprivileged user cannot reach its work tree: give the router a TMPDIR "
                                         "any user may search (like /tmp)")
            os.chmod(parent, (mode & 0o7777) | 0o001)
        parent = os.path.dirname(parent)


class Sandbox:
    """The sandbox policy of one next-hop (module docstring).

    ``tool``: its name in reasons; ``executables``: what it runs (their prefixes
    are mounted read-only; the interpreter's always are); ``allow_network``: the
    host's network instead of an empty network namespace (the RIB's
    ``options.allow_network``); ``limits``: the run limits (``timeout_s``,
    ``cpu_s``, ``address_space_bytes``, ``max_procs``, ``max_write_bytes``,
    ``output_bytes``); ``env``: variables added to :meth:`environment`. Raises
    :class:`SandboxUnavailable` when a mount would expose a
    :func:`forbidden_paths` entry, or when the interpreter, an executable, its
    ``#!`` interpreter (as written or where their symlinks lead) or the
    interpreter's installation lies under a :data:`PRIVATE_DIRS` entry, where no
    run could see it."""

    def __init__(self, *, tool: str, limits: ToolLimits, executables: Iterable[str] = (),
                 allow_network: bool = False, env: Mapping[str, str] | None = None) -> None:
        self.tool = tool
        self.limits = limits
        self.allow_network = bool(allow_network)
        exes = [e for e in executables if e]
        reason = _interpreter_hidden()
        for exe in exes:
            reason = reason or _hidden(f"{tool} executable", exe, "install it outside {dir}")
            interp = _shebang(exe)
            if interp and os.path.isabs(interp):
                reason = reason or _hidden(f"{tool} executable's #! interpreter", interp, "install it outside {dir}")
        if reason is not None:
            raise SandboxUnavailable(f"sandbox: {reason}")
        self.mounts = self._checked(install_paths(exes), what="installation")
        bins = [os.path.dirname(e) for e in exes] + [os.path.join(sys.prefix, "bin")]
        self.path = ":".join(dict.fromkeys([*bins, "/usr/local/bin", "/usr/bin", "/bin"]))
        self.env = dict(env or {})

    # -- policy ------------------------------------------------------------------

    def _checked(self, paths: Iterable[str], what: str = "file") -> list[str]:
        """``paths`` (normalised, existing ones, outside the always-mounted system
        directories and other than the device files every run's ``/dev`` has);
        raises :class:`SandboxUnavailable` for one that is or holds a
        :func:`forbidden_paths` entry, or lies under a :data:`PRIVATE_DIRS` entry
        (mounted there, it could not be seen inside)."""
        out = []
        for p in paths:
            m = os.path.normpath(p)
            if (not os.path.isabs(m) or not os.path.exists(m) or any(_within(m, d) for d in _SYSTEM_DIRS)
                    or m in _DEV_FILES):
                continue
            for f in forbidden_paths():
                if _within(f, m):
                    raise SandboxUnavailable(
                        f"sandbox: the {self.tool} {what} at {m} holds {f} (the router's home or state), which no "
                        "sandbox may see: install the tools and their files outside it")
            d = _private_dir(m)
            if d is not None:
                raise SandboxUnavailable(
                    f"sandbox: the {self.tool} {what} {m} lives under {d}, which every sandboxed run gets private "
                    f"(it cannot be seen inside); keep it outside {d}")
            out.append(m)
        return out

    def check(self, paths: Iterable[str] = ()) -> None:
        """Raise :class:`SandboxUnavailable` when a run could not see one of
        ``paths`` (host files its runs will mount read-only, as
        :meth:`run`'s ``ro_paths``: :meth:`_checked`), or with :func:`probe`'s
        reason when no sandbox can be made here."""
        self._checked(paths)
        reason = probe()
        if reason is not None:
            raise SandboxUnavailable(f"sandbox: {reason}")

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The run's whole environment: ``PATH``, ``HOME``/``TMPDIR`` ``/tmp``,
        ``LANG`` ``C.UTF-8``, ``USER``/``LOGNAME`` ``sandbox``, then the policy's
        ``env`` and ``extra``."""
        env = {"PATH": self.path, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "USER": "sandbox",
               "LOGNAME": "sandbox"}
        env.update(self.env)
        env.update(extra or {})
        return env

    def _rlimits(self, host: _Host) -> list[tuple[int, tuple[int, int]]]:
        lim = self.limits
        wanted = [
            (resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1)),
            (resource.RLIMIT_AS, (lim.address_space_bytes, lim.address_space_bytes)),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_FSIZE, (lim.max_write_bytes, lim.max_write_bytes)),
        ]
        out = []
        for res, (soft, hard) in wanted:
            cur_hard = resource.getrlimit(res)[1]
            if cur_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, cur_hard), min(hard, cur_hard)
            out.append((res, (soft, hard)))
        return out

    def argv(self, command: Sequence[str], *, tree: str, uid: int, bwrap: str = "bwrap",
             env: Mapping[str, str] | None = None, tree_bytes: int = 0, ro_paths: Sequence[str] = (),
             tree_fd: int | None = None) -> list[str]:
        """The bwrap command line that runs ``command`` in ``tree``'s copy as
        ``uid`` (module docstring). ``tree`` is an absolute host directory;
        ``tree_bytes`` its size in a tmpfs (the run's ``/tmp`` is that plus
        ``max_write_bytes``)."""
        lim = self.limits
        tmp_bytes = tree_bytes + lim.max_write_bytes
        a = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.allow_network:
            a.append("--unshare-net")
        a += ["--disable-userns", "--uid", str(uid), "--gid", str(uid), "--hostname", "sandbox",
              "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        for f in ETC_FILES + (ETC_NETWORK_FILES if self.allow_network else ()):
            a += ["--ro-bind-try", f, f]
        for m in [*self.mounts, *ro_paths]:
            a += ["--ro-bind", m, m]
        a += ["--proc", "/proc", "--dev", "/dev",
              "--size", str(tmp_bytes), "--tmpfs", "/tmp",
              "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
              # By an open descriptor when given: bwrap then needs no search permission on
              # the tree's parents (a root router's runs are an unprivileged user).
              *(("--ro-bind-fd", str(tree_fd)) if tree_fd is not None else ("--ro-bind", tree)), _STAGE]
        if not _within(tree, "/tmp"):
            a += ["--size", str(tmp_bytes), "--tmpfs", tree]
        else:
            a += ["--dir", tree]
        a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/", "--clearenv"]
        for k, v in self.environment(env).items():
            a += ["--setenv", k, v]
        a += ["--", "/bin/sh", "-c", _ENTER, "sh", str(lim.max_procs), _STAGE, tree, *command]
        return a

    # -- one run -----------------------------------------------------------------

    async def run(self, command: Sequence[str], *, tree: str, env: Mapping[str, str] | None = None,
                  ro_paths: Iterable[str] = ()) -> RunResult:
        """Run ``command`` in a fresh sandbox on a copy of host directory ``tree``
        (module docstring) and return what it left. ``ro_paths``: more host files
        or directories the command needs, mounted read-only at the same paths
        (e.g. an analyser's rule files; never one holding a
        :func:`forbidden_paths` entry). An argument containing :data:`REPORT`
        gets the report pipe's path there. Raises
        :class:`SandboxUnavailable` when no sandbox can be made here, ``OSError``
        when bwrap cannot be started; cancellation kills the run at once. Every
        process of the run is gone when this returns or raises."""
        host = await trio.to_thread.run_sync(_host)
        if isinstance(host, str):
            raise SandboxUnavailable(f"sandbox: {host}")
        lim = self.limits
        extra = self._checked(ro_paths)
        size = await trio.to_thread.run_sync(_tree_bytes, tree)
        want_report = any(REPORT in c for c in command)
        with _uid() as uid, _Fds() as fds:
            if _drop_uid(uid) is not None:
                await trio.to_thread.run_sync(_give_tree, tree, uid)
            cgroups = await trio.to_thread.run_sync(_make_cgroups, host, lim)
            try:
                return await self._run(command, tree=tree, env=env, host=host, uid=uid, fds=fds, cgroups=cgroups,
                                       want_report=want_report, size=size, extra=extra)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_remove_cgroups, cgroups)

    async def _run(self, command: Sequence[str], *, tree: str, env: Mapping[str, str] | None, host: _Host,
                   uid: int, fds: _Fds, cgroups: list[str], want_report: bool, size: int,
                   extra: Sequence[str]) -> RunResult:
        pipes = {}
        for name in ("out", "err", *(("report",) if want_report else ())):
            pipes[name] = fds.pipe()
        if want_report:
            command = [c.replace(REPORT, f"/proc/self/fd/{pipes['report'][1]}") for c in command]
            if _drop_uid(uid) is not None:  # opened by path inside: the run's unprivileged user must own it
                os.fchown(pipes["report"][1], uid, uid)
        tree_fd = fds.keep(os.open(tree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        argv = self.argv(command, tree=tree, uid=uid, bwrap=host.bwrap, env=env, tree_bytes=size, ro_paths=extra,
                         tree_fd=tree_fd)
        spawn = functools.partial(
            subprocess.Popen, argv, cwd="/", env={}, stdin=subprocess.DEVNULL, stdout=pipes["out"][1],
            stderr=pipes["err"][1], start_new_session=True,
            pass_fds=(tree_fd, *((pipes["report"][1],) if want_report else ())),
            preexec_fn=functools.partial(_child_setup, self._rlimits(host), cgroups, _drop_uid(uid)),
        )
        proc = await trio.to_thread.run_sync(_spawn, spawn)
        fds.close(tree_fd)
        for _, w in pipes.values():
            fds.close(w)
        streams = {name: trio.lowlevel.FdStream(fds.take(r)) for name, (r, _) in pipes.items()}
        result = await self._supervise(proc, streams, cgroups)
        if cgroups:
            result.oom, result.procs_capped = await trio.to_thread.run_sync(_cgroup_events, cgroups)
        return result

    async def _supervise(self, proc: subprocess.Popen[bytes], streams: dict[str, trio.lowlevel.FdStream],
                         cgroups: Sequence[str]) -> RunResult:
        lim = self.limits
        bufs = {name: bytearray() for name in ("out", "err", "report")}
        capped = timed_out = False
        pidfd = os.pidfd_open(proc.pid)
        try:
            with trio.move_on_after(lim.timeout_s) as deadline:
                async with trio.open_nursery() as nursery:

                    async def drain(pipe: trio.abc.ReceiveStream, buf: bytearray) -> None:
                        nonlocal capped
                        while chunk := await pipe.receive_some(_READ_CHUNK):
                            if sum(map(len, bufs.values())) + len(chunk) > lim.output_bytes:
                                capped = True
                                nursery.cancel_scope.cancel()
                                return
                            buf += chunk

                    for name, stream in streams.items():
                        nursery.start_soon(drain, stream, bufs[name])
                if not capped:
                    await trio.lowlevel.wait_readable(pidfd)
            timed_out = deadline.cancelled_caught
        finally:
            with trio.CancelScope(shield=True):
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # bwrap: its sandbox dies with it
                    await trio.lowlevel.wait_readable(pidfd)
                    proc.wait()
                os.close(pidfd)
                for stream in streams.values():
                    await stream.aclose()
                if cgroups:
                    await trio.to_thread.run_sync(_sweep, cgroups)
        status = proc.returncode
        if status is not None and 128 < status <= 128 + 64:
            status = 128 - status  # bwrap's init exits 128 + N for a command killed by signal N
        return RunResult(
            returncode=None if (timed_out or capped) else status,
            stdout=bytes(bufs["out"]), stderr=bytes(bufs["err"]),
            report=bytes(bufs["report"]) if "report" in streams else None,
            timed_out=timed_out, capped=capped,
        )


class _Fds:
    """Pipe ends of one run, each closed exactly once (on :meth:`close`, or on
    the way out unless :meth:`take` n)."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in list(self._open):
            self.close(fd)

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        self._open.update((r, w))
        return r, w

    def keep(self, fd: int) -> int:
        """Own ``fd`` (closed on the way out); returns it."""
        self._open.add(fd)
        return fd

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            os.close(fd)

    def take(self, fd: int) -> int:
        """``fd``, now owned by the caller."""
        self._open.discard(fd)
        return fd


# bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread*
# that started it ends: every sandbox is started from this one thread, which
# lives as long as the router, so a run dies with the router and never before.
_spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="atp-sandbox-spawn")


def _spawn(start: functools.partial[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """``start()`` on the spawner thread (blocking: call in a worker thread)."""
    return _spawner.submit(start).result()


def _make_cgroups(host: _Host, lim: ToolLimits) -> list[str]:
    """The run's cgroups (pids: ``pids.max``; memory: ``memory.limit_in_bytes``),
    made under this process's own (blocking). Raises OSError (nothing left
    behind) when the pids cgroup cannot be made."""
    made: list[str] = []
    name = f"atp-run-{os.getpid()}-{next(_seq)}"
    try:
        if host.pids_cgroup is not None:
            d = os.path.join(host.pids_cgroup, name)
            os.mkdir(d)
            made.append(d)
            Path(d, "pids.max").write_text(str(lim.max_procs))
        if host.memory_cgroup is not None:
            d = os.path.join(host.memory_cgroup, name)
            try:
                os.mkdir(d)
            except OSError:
                pass  # memory is bounded by RLIMIT_AS alone then
            else:
                made.append(d)
                Path(d, "memory.limit_in_bytes").write_text(str(lim.address_space_bytes))
    except BaseException:
        _remove_cgroups(made)
        raise
    return made


def _remove_cgroups(made: Sequence[str]) -> None:
    """Sweep (SIGKILL) and remove the run's cgroups (blocking)."""
    if made:
        _sweep(made)
        for d in made:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    _sweep([d])
                    time.sleep(0.02)


def _sweep(cgroups: Sequence[str]) -> None:
    """SIGKILL every process of ``cgroups`` until none is left (at most
    :data:`_SWEEP_S` seconds)."""
    end = time.monotonic() + _SWEEP_S
    for cg in cgroups:
        while time.monotonic() < end:
            try:
                pids = [int(p) for p in Path(cg, "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                break
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)


def _cgroup_events(cgroups: Sequence[str]) -> tuple[bool, bool]:
    """(the memory limit was hit and a process OOM-killed, a fork was refused at
    ``pids.max``)."""
    oom = procs = False
    for cg in cgroups:
        with contextlib.suppress(OSError, ValueError):
            if os.path.exists(os.path.join(cg, "pids.events")):
                procs = procs or any(line.split()[0] == "max" and int(line.split()[1]) > 0
                                     for line in Path(cg, "pids.events").read_text().splitlines())
            if os.path.exists(os.path.join(cg, "memory.oom_control")):
                for line in Path(cg, "memory.oom_control").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill" and int(v) > 0:
                        oom = True
    return oom, procs
