"""``rest-bridge cluster``: N replicas and nginx in front of them, on one machine.

The replicas are ``rest-bridge serve`` processes on loopback ports, each with its id
(``<prefix>-<n>``), the others as peers, and a mark of its own in its environment
(:data:`CLUSTER_MARK_VARIABLE`), which its app-servers and everything they start
inherit. nginx runs with its own prefix directory (configuration, pid file, logs,
temporary files) and the configuration :mod:`bridge_ops.front` generates. When the
replicas require a token (``REST_ADAPTER_TOKEN``), the front checks it too, from a
token map written 0600 beside nginx.conf (never in nginx.conf itself).

The launcher is a child subreaper: when a replica dies (SIGKILL, a crash), its
app-servers are re-parented to the launcher, which then kills every process carrying
the replica's mark and reaps them, so none outlives its replica; the other replicas
serve on, and the front answers the dead replica's sessions with 503
``replica_unavailable``. A replica that exits after draining (SIGUSR1) is let go the
same way. Each exit is a line that says how many replicas are left.

nginx open source has no active health checks, and the kernel accepts connections for
a stopped (``SIGSTOP``) or wedged replica, so nginx alone learns of a hung replica only
from requests that wait their read timeout. The launcher checks instead (:meth:`Cluster.probe`):
it asks each replica's ``/health`` (with ``--ops-port``, ``/livez`` on its operations
listener instead) every ``--probe-interval-ms``, each answer awaited
``--probe-timeout-ms``; a replica that misses ``--probe-misses`` in a row is marked
``down`` in nginx.conf (every pool, and its own upstream: its sessions get 503 at once),
nginx is reloaded (SIGHUP: graceful, requests and streams in flight finish on the old
workers), and one line says so; one answer puts it back the same way.

When no replica is left (killed, crashed or drained) or nginx exits, and the launcher
was not asked to stop, the cluster can serve nothing any more (nginx would answer 503
to everything): the launcher says so (``no replica left: stopping``), stops what is left
and exits with status 1, so that a supervisor (systemd's ``Restart=on-failure``)
starts the cluster again. Replicas and nginx get SIGTERM if the launcher itself dies
(``PR_SET_PDEATHSIG``). On SIGINT, SIGTERM or SIGHUP the launcher stops the replicas (which stop
their app-servers) and nginx, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bridge import TOKEN_VARIABLE, credentials, logs, runtime, watchdog
from bridge.limits import PEERS_VARIABLE, REPLICA_ID_VARIABLE, RestLimitsEnvError
from bridge.process import descendants
from bridge.settings import LimitVariables, LogVariables, variable_name
from bridge_ops.front import FrontSettings, Replica, render, token_map_text

#: Marks every process a replica starts, so that none outlives the replica.
CLUSTER_MARK_VARIABLE = "REST_ADAPTER_CLUSTER_MARK"
START_SECONDS = 60.0
#: Starts tried before giving up (the ports are chosen again each time).
START_ATTEMPTS = 3
STOP_SECONDS = 15.0
#: The active health check (``--probe-*``): each replica's ``/health`` is asked every
#: PROBE_INTERVAL_MS, each answer awaited PROBE_TIMEOUT_MS; PROBE_MISSES unanswered in a
#: row mark it ``down`` at the front, and one answer puts it back.
PROBE_INTERVAL_MS = 1000
PROBE_TIMEOUT_MS = 2000
PROBE_MISSES = 2
#: How long the launcher waits for nginx's workers to take a new configuration.
RELOAD_SECONDS = 10.0
#: The front's token map, beside nginx.conf in the cluster's directory (0600).
TOKEN_MAP = "token-map.conf"
_PR_SET_PDEATHSIG = 1


#: Read by each replica; the launcher gives each its own port instead (--ops-port).
OPS_PORT_VARIABLE = variable_name("ops_port")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


#: The launcher's log format (``--log-format``): its own lines and how it passes its
#: members' lines on.
log_format = "text"


def say(text: str, event: str, level: str = "INFO", **fields: object) -> None:
    """One line of the launcher's own log, on stderr (as `serve`'s log): in text
    ``rest-bridge cluster: <text>``; in json one object, logger ``bridge.cluster``, with
    ``event`` and ``fields``."""
    if log_format == "json":
        line = {
            "time": logs.utc_stamp(time.time()),
            "level": level,
            "logger": "bridge.cluster",
            "message": text,
            "event": event,
            **fields,
        }
        text = json.dumps(line, ensure_ascii=False)
    else:
        text = f"rest-bridge cluster: {text}"
    with contextlib.suppress(OSError, ValueError):  # stderr closed: nobody to tell
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def passed_on(member: str, line: str, replica: bool) -> str:
    """A member's line as the launcher's log shows it: in text with a ``[member] ``
    prefix; in json a replica's object as it is (with ``replicaId`` added where it
    lacks one), and anything else (nginx's error log, a line a replica wrote before its
    format was set) wrapped in an object of its own (logger ``nginx`` or
    ``bridge.cluster``, event ``output``)."""
    if log_format != "json":
        return f"[{member}] {line}"
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if isinstance(record, dict) and replica:
        if "replicaId" in record:
            return line
        record["replicaId"] = member
        return json.dumps(record, ensure_ascii=False)
    wrapped = {
        "time": logs.utc_stamp(time.time()),
        "level": "INFO",
        "logger": "bridge.cluster" if replica else member,
        "message": line,
        "event": "output",
        "member": member,
    }
    if replica:
        wrapped["replicaId"] = member
    return json.dumps(wrapped, ensure_ascii=False)


async def bury(mark: str, timeout: float = STOP_SECONDS) -> int:
    """SIGKILL every process carrying ``mark``, wait until they are gone, reap them.

    Searches again until a search finds nothing new (one may fork meanwhile). Returns
    how many were killed.
    """
    return await runtime.kill_all(runtime.carrying(CLUSTER_MARK_VARIABLE, mark), timeout)


def nginx_workers(master: int) -> dict[int, str]:
    """nginx's worker processes (the master's children): ``accepting``, or
    ``shutting down`` (an old worker after a reload, which no longer accepts: it sets
    its title so before it closes its listening sockets, in the same turn of its loop)."""
    try:
        children = psutil.Process(master).children()
    except psutil.NoSuchProcess:
        return {}
    workers: dict[int, str] = {}
    for child in children:
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        workers[child.pid] = "shutting down" if "shutting down" in title else "accepting"
    return workers


class FrontError(RuntimeError):
    """nginx did not start (its port taken, most likely)."""


@dataclass
class Member:
    """One child process of the cluster: a replica or nginx."""

    name: str
    process: asyncio.subprocess.Process
    url: str = ""
    mark: str = ""
    #: Its operations listener (``--ops-port``), or empty.
    ops_url: str = ""
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class Cluster:
    """The replicas and the front, started and stopped together."""

    def __init__(
        self,
        *,
        replicas: int,
        host: str,
        port: int,
        preset: str,
        app_server: str,
        nginx: str,
        directory: Path,
        workers: str,
        id_prefix: str,
        loop_name: str,
    ) -> None:
        self.count = replicas
        self.host = host
        self.port = port or free_port(host)
        #: The front's port was chosen here (``--port 0``), and may be chosen again.
        self.chosen_port = not port
        self.preset = preset
        self.app_server = app_server
        self.nginx = nginx
        self.directory = directory
        self.workers = workers
        self.id_prefix = id_prefix
        self.loop_name = loop_name
        self.members: dict[str, Member] = {}
        #: The secret variables (bridge.credentials) the launcher was started with, which
        #: it no longer has in its environment: the replicas' alone, never nginx's.
        self.secrets: dict[str, str] = {}
        self.stopping = False
        #: Why the cluster stopped of itself (no replica left, nginx gone); empty: it did not.
        self.failed = ""
        self._readers: list[asyncio.Task[None]] = []
        self.probe_interval = PROBE_INTERVAL_MS / 1000
        self.probe_timeout = PROBE_TIMEOUT_MS / 1000
        self.probe_misses = PROBE_MISSES
        #: The front's replicas as nginx.conf names them now (``down`` or not), and
        #: what else the configuration needs: set by :meth:`start`.
        self.front_replicas: dict[str, Replica] = {}
        self.front_settings = FrontSettings()
        self._reloading = asyncio.Lock()
        #: ``--ops-port``: replica N's operations listener on this + N (0: free ports).
        self.ops_port: int | None = None
        #: --log-format and --log-level, passed on to each replica.
        self.log_options: list[str] = []

    async def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Member:
        with descendants.children.spawning() as own:
            process = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            own(process.pid)
        member = Member(name, process)
        self.members[name] = member
        return member

    async def _forward(self, member: Member) -> None:
        """Pass a member's output on to the launcher's log (:func:`passed_on`)."""
        assert member.process.stdout is not None
        async for raw in member.process.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not member.ready.is_set() and " listening on " in line:
                member.ready.set()
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(passed_on(member.name, line, bool(member.mark)) + "\n")
                sys.stderr.flush()

    async def start(self) -> None:
        ids = [f"{self.id_prefix}-{n}" for n in range(self.count)]
        ports = {name: free_port(self.host) for name in ids}
        peers = ",".join(f"{name}=http://{self.host}:{ports[name]}" for name in ids)
        # One REST_ADAPTER_OPS_PORT for every replica could not be bound but once:
        # --ops-port numbers them instead.
        base = {
            k: v
            for k, v in credentials.child_environment().items()
            if k not in (CLUSTER_MARK_VARIABLE, OPS_PORT_VARIABLE)
        }
        for name in ids:
            mark = secrets.token_hex(16)
            env = {
                **base,
                **self.secrets,
                REPLICA_ID_VARIABLE: name,
                PEERS_VARIABLE: peers,
                CLUSTER_MARK_VARIABLE: mark,
            }
            argv = [
                *(sys.executable, "-m", "bridge.cli", "serve"),
                *("--preset", self.preset, "--app-server", self.app_server),
                *("--host", self.host, "--port", str(ports[name]), "--loop", self.loop_name),
                *self.log_options,
            ]
            ops_port = self._ops_port(ids.index(name))
            if ops_port is not None:
                argv += ["--ops-port", str(ops_port)]
            member = await self._spawn(name, argv, env)
            member.url = f"http://{self.host}:{ports[name]}"
            member.ops_url = "" if ops_port is None else f"http://{self.host}:{ops_port}"
            member.mark = mark
            self._readers.append(asyncio.create_task(self._forward(member)))
        for name in ids:
            member = self.members[name]
            await self._ready(member)
            ops = f" ops {member.ops_url}" if member.ops_url else ""
            say(
                f"replica {name} {member.url} pid {member.process.pid} mark {member.mark}{ops}",
                "replica_started",
                replicaId=name,
                url=member.url,
                pid=member.process.pid,
                ops=member.ops_url or None,
            )
        self.front_replicas = {name: Replica(name, f"{self.host}:{ports[name]}") for name in ids}
        self.directory.mkdir(parents=True, exist_ok=True)
        self.front_settings = FrontSettings(
            listen=f"{self.host}:{self.port}",
            workers=self.workers,
            # The secrets are the replicas' (self.secrets), never nginx's environment:
            # the front gets the token as its map file only.
            token_map=self._write_token_map(credentials.read_secret(TOKEN_VARIABLE, self.secrets)),
        )
        self._write_config()
        prefix = str(self.directory)
        argv = [self.nginx, "-p", prefix + "/", "-c", f"{prefix}/nginx.conf", "-e", "stderr"]
        front = await self._spawn("nginx", [*argv, "-g", "daemon off;"], dict(base))
        front.url = f"http://{self.host}:{self.port}"
        self._readers.append(asyncio.create_task(self._forward(front)))
        await self._front_ready(front)
        say(
            f"front {front.url} pid {front.process.pid} config {prefix}/nginx.conf",
            "front_started",
            url=front.url,
            pid=front.process.pid,
        )

    def _ops_port(self, index: int) -> int | None:
        if self.ops_port is None:
            return None
        return self.ops_port + index if self.ops_port else free_port(self.host)

    def _write_config(self) -> None:
        """nginx.conf for :attr:`front_replicas`, replaced in one rename (nginx never
        reads half a file)."""
        config = render(
            list(self.front_replicas.values()),
            LimitVariables.from_env().limits(),
            self.front_settings,
        )
        path = self.directory / "nginx.conf"
        partial = self.directory / "nginx.conf.new"
        partial.write_text(config)
        partial.replace(path)

    def _write_token_map(self, token: str | None) -> str:
        """The front's token map (0600) beside its configuration, if the replicas
        require a token: its path relative to nginx.conf's directory, else ""."""
        if token is None:
            return ""
        path = self.directory / TOKEN_MAP
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as file:
            os.fchmod(descriptor, 0o600)  # an older file may have been more open
            file.write(token_map_text(token))
        return TOKEN_MAP

    async def _ready(self, member: Member) -> None:
        waiting = asyncio.ensure_future(member.ready.wait())
        exited = asyncio.ensure_future(member.process.wait())
        done, _ = await asyncio.wait(
            {waiting, exited}, timeout=START_SECONDS, return_when=asyncio.FIRST_COMPLETED
        )
        waiting.cancel()
        exited.cancel()
        if waiting not in done:
            raise RuntimeError(f"{member.name} did not start")

    async def _front_ready(self, front: Member) -> None:
        """Until nginx answers ``GET /health`` from a replica (it prints nothing at start).

        Asked over HTTP, not just connected to: whatever else holds the port does not
        answer as nginx does.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_SECONDS
        while loop.time() < deadline:
            if front.process.returncode is not None:
                raise FrontError(f"nginx exited with status {front.process.returncode}")
            gone = [
                m.name for m in self.members.values() if m.mark and m.process.returncode is not None
            ]
            if gone:
                raise RuntimeError(f"{', '.join(gone)} exited while the front was starting")
            if await self._health_through_front():
                front.ready.set()
                return
            await asyncio.sleep(0.05)
        raise FrontError("nginx did not answer in time")

    async def _health_through_front(self) -> bool:
        try:
            async with asyncio.timeout(2.0):
                reader, writer = await asyncio.open_connection(self.host, self.port)
                try:
                    writer.write(b"GET /health HTTP/1.0\r\nHost: front\r\n\r\n")
                    head = await reader.read(4096)
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
        except (OSError, TimeoutError):
            return False
        return head.startswith(b"HTTP/1.1 200") and b"\r\nServer: nginx" in head

    @staticmethod
    def probe_path(member: Member) -> str:
        """What the launcher probes: the operations listener's ``/livez`` when the replica
        has one (no access line, no HTTP metric: a probe a second per replica would
        otherwise be most of the request rate), else the API's ``/health``."""
        return "/livez" if member.ops_url else "/health"

    async def _answers_health(self, member: Member) -> bool:
        """Whether the replica answers its probe (:meth:`probe_path`; any HTTP answer)
        within the probe's deadline. No token: neither path asks for it."""
        address = (member.ops_url or member.url).removeprefix("http://")
        host, _, port = address.rpartition(":")
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.probe_timeout):
                reader, writer = await asyncio.open_connection(host, int(port))
                path = self.probe_path(member)
                writer.write(f"GET {path} HTTP/1.0\r\nHost: probe\r\n\r\n".encode())
                head = await reader.read(64)
        except (OSError, TimeoutError):
            return False
        finally:
            if writer is not None:
                writer.close()
        return head.startswith(b"HTTP/1.")

    async def probe(self) -> None:
        """The front's active health check, until cancelled: a replica that misses
        :attr:`probe_misses` probes in a row is marked ``down`` in nginx.conf (nginx
        reloaded), and put back the same way once it answers again."""
        missed: dict[str, int] = {}
        while not self.stopping:
            live = [m for m in self.members.values() if m.mark and m.process.returncode is None]
            answers = await asyncio.gather(*(self._answers_health(m) for m in live))
            changed: list[tuple[str, str, str]] = []  # the line, its event, the replica
            for member, answered in zip(live, answers, strict=True):
                replica = self.front_replicas.get(member.name)
                if replica is None:
                    continue
                missed[member.name] = 0 if answered else missed.get(member.name, 0) + 1
                if answered and replica.down:
                    self.front_replicas[member.name] = Replica(replica.id, replica.address)
                    path = self.probe_path(member)
                    back = f"replica {member.name} answers {path} again: back in the front"
                    changed.append((back, "back_in_front", member.name))
                elif missed[member.name] >= self.probe_misses and not replica.down:
                    self.front_replicas[member.name] = Replica(
                        replica.id, replica.address, down=True
                    )
                    down = (
                        f"replica {member.name} missed {missed[member.name]} health probes "
                        "in a row: marked down at the front"
                    )
                    changed.append((down, "marked_down", member.name))
            if changed and not self.stopping:
                done = await self.reload_front()
                for line, event, name in changed:
                    said = line if done else f"{line}; nginx did not take the new configuration"
                    level = "WARNING" if event == "marked_down" or not done else "INFO"
                    say(said, event, level, replicaId=name)
            await asyncio.sleep(self.probe_interval)

    async def reload_front(self) -> bool:
        """Write nginx.conf again and reload nginx (SIGHUP: a graceful reload, requests
        and streams in flight finish on the old workers); True once every worker
        that takes new connections runs the new configuration."""
        front = self.members.get("nginx")
        if front is None or front.process.returncode is not None:
            return False
        async with self._reloading:
            try:
                self._write_config()
            except OSError as exc:
                say(
                    f"could not write nginx.conf: {exc.strerror or type(exc).__name__}",
                    "front_config_failed",
                    "ERROR",
                )
                return False
            before = set(nginx_workers(front.process.pid))
            with contextlib.suppress(ProcessLookupError):
                front.process.send_signal(signal.SIGHUP)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + RELOAD_SECONDS
            while loop.time() < deadline and front.process.returncode is None:
                workers = nginx_workers(front.process.pid)
                old_accepting = [pid for pid in before if workers.get(pid) == "accepting"]
                new = [pid for pid in workers if pid not in before]
                if new and not old_accepting:
                    return True
                await asyncio.sleep(0.02)
            return False

    def replicas_left(self) -> list[Member]:
        """The replicas still running."""
        return [m for m in self.members.values() if m.mark and m.process.returncode is None]

    async def watch(self) -> None:
        """Until every member has exited: report each exit, and bury dead replicas.

        When the last replica or nginx exits and the cluster is not stopping, the cluster
        can serve nothing any more: it stops, and :attr:`failed` says why.
        """
        waits = {asyncio.ensure_future(m.process.wait()): m for m in self.members.values()}
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                member = waits.pop(finished)
                code = member.process.returncode
                how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
                if member.mark:
                    killed = await bury(member.mark)
                    buried = f"; killed {killed} of its processes" if killed else ""
                    left = len(self.replicas_left())
                    counted = "" if self.stopping else f"; {left} of {self.count} left"
                    level = "INFO" if self.stopping else "WARNING"
                    say(
                        f"replica {member.name} exited ({how}){buried}{counted}",
                        "replica_exited",
                        level,
                        replicaId=member.name,
                        left=left,
                    )
                    if not left and not self.stopping:
                        self.failed = "no replica left"
                        await self.stop(self.failed)
                else:
                    say(
                        f"{member.name} exited ({how})",
                        "front_exited",
                        "INFO" if self.stopping else "ERROR",
                    )
                    if not self.stopping:
                        self.failed = f"{member.name} exited"
                        await self.stop(self.failed)
                descendants.children.released(member.process.pid)

    def reset(self) -> None:
        """Forget the members of a failed start, and choose new ports."""
        for reader in self._readers:
            reader.cancel()
        self._readers.clear()
        self.members.clear()
        self.stopping = False
        self.failed = ""
        if self.chosen_port:
            self.port = free_port(self.host)

    async def stop(self, reason: str = "") -> None:
        if self.stopping:
            return
        self.stopping = True
        say(
            f"{reason}: stopping" if reason else "stopping",
            "stopping",
            "ERROR" if reason else "INFO",
        )
        for member in self.members.values():
            if member.process.returncode is None:
                sig = signal.SIGQUIT if not member.mark else signal.SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    member.process.send_signal(sig)


async def _started(cluster: Cluster, stop: asyncio.Event) -> bool:
    """Start ``cluster``, unless ``stop`` is set first (False, the start abandoned)."""
    starting = asyncio.ensure_future(cluster.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if stop.is_set():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, RuntimeError, OSError):
            await starting
        return False
    starting.result()  # its error, if it failed
    return True


async def _stop_all(cluster: Cluster, watching: Awaitable[None]) -> int:
    """Stop every member, wait (``watching``) for them to exit, at most STOP_SECONDS,
    then kill and reap whatever is left below the launcher: how many that was."""
    await cluster.stop()
    try:
        await asyncio.wait_for(watching, STOP_SECONDS)
    except TimeoutError:
        say("members still running after the grace period: killing them", "killing", "WARNING")
    return await runtime.end_all(5.0)


async def run(cluster: Cluster) -> int:
    stop = asyncio.Event()
    runtime.stop_on_first_signal(stop)
    runtime.become_subreaper()
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            if not await _started(cluster, stop):
                # Asked to stop while starting (Ctrl-C reaches the replicas too).
                await _stop_all(cluster, cluster.watch())
                say("stopped before it was ready", "stopped")
                return 0
            break
        except (RuntimeError, OSError) as exc:
            # Most likely a port taken between choosing it and binding it: new ports.
            say(
                f"could not start (attempt {attempt} of {START_ATTEMPTS}): {exc}",
                "start_failed",
                "ERROR",
            )
            await _stop_all(cluster, cluster.watch())
            given_port_taken = isinstance(exc, FrontError) and not cluster.chosen_port
            if attempt == START_ATTEMPTS or stop.is_set() or given_port_taken:
                return 1
            cluster.reset()
    say("ready", "ready")
    orphans = asyncio.ensure_future(runtime.reap_every(1.0))
    probing = asyncio.ensure_future(cluster.probe())
    watching = asyncio.ensure_future(cluster.watch())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({watching, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    probing.cancel()
    orphans.cancel()  # end_all reaps what is left
    killed = await _stop_all(cluster, watching)
    if killed:
        say(f"killed {killed} leftover processes", "leftovers_killed", "WARNING")
    if cluster.failed:
        # Not asked to stop: a supervisor (systemd's Restart=on-failure) starts it again.
        say(f"stopped ({cluster.failed}): exit status 1", "stopped", "ERROR")
        return 1
    say("stopped", "stopped")
    return 0


def main(args: argparse.Namespace) -> int:
    """`rest-bridge cluster` with parsed arguments (see bridge.cli)."""
    nginx = getattr(args, "nginx", None) or shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.access(nginx, os.X_OK):
        print(
            "rest-bridge cluster: nginx not found (Debian: apt-get install nginx-light; "
            "or pass --nginx PATH)",
            file=sys.stderr,
        )
        return 2
    # The replicas read the secrets (and then leave them) at their start; the launcher
    # keeps them for the replicas only, out of its own environment and out of nginx's.
    given = {k: v for k, v in os.environ.items() if k in credentials.HIDDEN_VARIABLES}
    in_environment = set(given) & set(credentials.SECRET_VARIABLES)
    if not credentials.forget_secrets() and in_environment:
        print(
            f"rest-bridge cluster: cannot remove {', '.join(sorted(in_environment))} from "
            "this process's /proc/self/environ: give it in its _FILE variable instead",
            file=sys.stderr,
        )
        return 2
    if given:
        credentials.make_undumpable()
    replicas = int(getattr(args, "replicas", 0) or os.cpu_count() or 1)
    workers = str(getattr(args, "workers", "1"))
    host, port = str(getattr(args, "host", "127.0.0.1")), int(getattr(args, "port", 8787))
    try:
        FrontSettings(listen=f"{host}:{port}", workers=workers)  # before anything starts
        free_port(host)  # the replicas listen on it too
    except ValueError as exc:
        print(f"rest-bridge cluster: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"rest-bridge cluster: --host {host[:120]!r} (an IPv4 address or name): "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    ops_port = getattr(args, "ops_port", None)
    if ops_port and ops_port + replicas - 1 > 65535:
        print(
            f"rest-bridge cluster: --ops-port {ops_port} leaves no port for replica "
            f"{replicas - 1} (it gets --ops-port + its number, at most 65535)",
            file=sys.stderr,
        )
        return 2
    global log_format
    try:  # the replicas read the variable too: the launcher's lines match theirs
        log_format = getattr(args, "log_format", None) or LogVariables.from_env().log_format
    except RestLimitsEnvError as exc:
        print(f"rest-bridge cluster: {exc}", file=sys.stderr)
        return 2
    directory = getattr(args, "dir", None)
    made = directory is None
    path = Path(directory or tempfile.mkdtemp(prefix="rest-bridge-cluster-"))
    cluster = Cluster(
        replicas=replicas,
        host=host,
        port=port,
        preset=str(getattr(args, "preset", "trusted")),
        app_server=str(getattr(args, "app_server", "codex app-server")),
        nginx=nginx,
        directory=path,
        workers=workers,
        id_prefix=str(getattr(args, "id_prefix", "replica")),
        loop_name=str(getattr(args, "loop", "asyncio")),
    )
    cluster.secrets = given
    cluster.probe_interval = int(getattr(args, "probe_interval_ms", PROBE_INTERVAL_MS)) / 1000
    cluster.probe_timeout = int(getattr(args, "probe_timeout_ms", PROBE_TIMEOUT_MS)) / 1000
    cluster.probe_misses = int(getattr(args, "probe_misses", PROBE_MISSES))
    cluster.ops_port = ops_port
    for option in ("log_format", "log_level"):
        value = getattr(args, option, None)
        if value is not None:
            cluster.log_options += ["--" + option.replace("_", "-"), str(value)]
    # The watchdog (bridge.watchdog): if the launcher is killed, it kills every process
    # the launcher started and removes the folder it made, which holds the token map.
    with runtime.Watchdog(log_format):
        if made:
            watchdog.guard_folder(str(path))
        try:
            with asyncio.Runner() as runner:
                return runner.run(run(cluster))
        finally:
            if made:
                shutil.rmtree(path, ignore_errors=True)
