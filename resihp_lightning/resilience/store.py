"""A rendezvous store that no training process's death takes down.

Today's default group rendezvouses through a ``TCPStore`` that lives *inside* rank 0 (Lightning's
launcher and ``env://`` start its server there), so losing rank 0 loses the store, and with it every
way for the survivors to agree on anything. Here the store's server lives in a small process of its
own, :mod:`resihp_lightning.resilience.store_host`, which belongs to no training process:

* **who starts it**: whichever worker comes first. Workers serialise on an ``flock`` in the job's
  run directory (``$TMPDIR/resihp-<uid>/<run id>`` by default); the holder connects to the host named
  in ``store.json`` if its process lives, or else spawns a new host (``python -m
  resihp_lightning.resilience.store_host``, with ``start_new_session=True`` and a second fork, so
  that neither a signal to the job's process group nor the spawner's death reaches it, and nobody
  has to reap it), waits for it to publish its address, and registers itself, all under the lock;
* **how the others find it**: the address file, with a free port the host picked (no port clash
  with the job's ``MASTER_PORT`` or another job). With a fixed ``port`` (the multi-node layout,
  where other machines cannot read the file) it is ``(host, port)``;
* **when it ends**: every worker registers (pid, start time, pid namespace). The host checks them
  every 0.2 s on its own machine through ``/proc`` (a killed worker, zombie or gone, is dead at once;
  a SIGSTOPped one is alive) and, for members on other machines, by whether their machine's heartbeat
  key still changes. It exits ``linger_s`` (2 s) after the last member is gone, left (``close``) or was
  evicted by the survivors, or when nobody registered within ``startup_timeout_s``. It takes the
  lock before it exits, so a worker cannot register with a host that is going away. It never
  outlives its job by more than ``linger_s`` plus a poll.

Why not a ``FileStore`` on local disk, which would need no process at all: torch's ``FileStore``
appends every ``set`` to one file and has every reader replay it, so a heartbeat of 5 writes per
second per rank grows the file and the cost of every read without bound over a long job; it removes
its file when the last instance is destroyed (what "last" means is unclear once processes die
uncleanly); it waits by polling; and it cannot span machines without a shared file system whose
``flock`` is reliable. The store host costs one process per job (and one torch import, about 2 s, at
start) and gives an in-memory store with blocking waits, ``compare_set`` and ``append``.

Multi-node: pass a fixed ``port`` and ``host`` = an address of the node that runs the host, and
``spawn=False`` on the other nodes. The host's machine is then a single point of failure: if that
machine dies, so does the store; the survivors notice (:class:`~.failures.StoreUnavailable`) and the
job has to be restarted from a checkpoint. With ``etcd`` set (:mod:`.etcd_store`) there is no store
host: the keys live in a replicated etcd cluster that survives the loss of any one machine.

**Who may write.** The host listens on ``host`` only (127.0.0.1 on one machine; torch's own server
would listen on every interface). Every value is signed with the job's secret (:mod:`.store_auth`),
made in the run directory on one machine (mode 0600; several machines sign only with an explicit
``secret_file``), and values that are not are ignored: a stranger who reaches the port cannot publish
an abort marker, vote, register as a member or stop the host (it can still read, delete or overwrite
keys: a denial of service). On etcd, the cluster's users and roles do this
(:mod:`.etcd_admin`).

Keys: host bookkeeping lives under ``resihp/host/``; everything else a job writes goes under
``resihp/<run id>/a<attempt>`` (:attr:`RendezvousStore.namespace`), so that the next attempt of a
restarted job never reads the keys of the last one. Under torchrun the attempt is the launch round
the workers agree on through the store (:mod:`.store_round`):
``TORCHELASTIC_RESTART_COUNT`` differs between agents after a membership change. Relaunching the
same run id and attempt within ``linger_s`` of the end of the last launch could reuse its host and
keys: give each launch its own run id.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.errors import ConfigError, invalid_option
from resihp_lightning.resilience.etcd_config import EtcdConfig
from resihp_lightning.resilience.failures import StoreUnavailable
from resihp_lightning.resilience.machine_board import machine_beat_key
from resihp_lightning.resilience.procs import ProcessIdentity

log = get_logger(__name__)

HOST_PREFIX = "resihp/host/"
ADDRESS_FILE = "store.json"
LOCK_FILE = "store.lock"
LOG_FILE = "store_host.log"
#: How a process starts the store host (:attr:`StoreConfig.start_method`), and its environment default.
START_METHODS = ("exec", "fork")
START_METHOD_ENV = "RESIHP_STORE_START_METHOD"
SECRET_FILE = "store.secret"


def host_key(name: str) -> str:
    """A host bookkeeping key (``count``, ``member/<i>``, ``left/<i>``, ``shutdown``; the host writes
    ``members``, how many registrations it has read)."""
    return HOST_PREFIX + name


def _positive(option: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise invalid_option(option, value, "seconds > 0")


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where the store host runs and how long its parts wait.

    Attributes:
        run_dir: directory of the lock, the address file and the host's log; default
            ``$TMPDIR/resihp-<uid>/<run_id>``. Must be on a local disk.
        run_id: names the job; default ``$TORCHELASTIC_RUN_ID`` (unless ``"none"``), else
            ``$SLURM_JOB_ID``, else ``<MASTER_ADDR>-<MASTER_PORT>``.
        attempt: restart count of the job; default: under torchrun, the launch round the workers
            agree on through the store (:mod:`.store_round`; torchrun's own restart count differs
            between agents after a membership change), else ``$SLURM_RESTART_COUNT`` or 0.
        host: address the host binds and workers connect to; default 127.0.0.1, or
            ``$MASTER_ADDR`` when ``port`` is fixed.
        port: fixed port of the host (multi-node); None: a free port published in ``run_dir``.
        spawn: whether this process may start the host (False on nodes that do not run it).
        timeout_s: timeout of each store operation.
        connect_timeout_s: how long a worker waits for a host to be reachable (spawn included).
        linger_s: the host exits this long after its last member is gone.
        startup_timeout_s: the host exits if nobody registers within this long.
        remote_idle_s: a member on another machine counts as alive while its heartbeat key changed
            within this long.
        authenticate: sign every value with the job's secret (:mod:`.store_auth`) and ignore values
            that are not; on one machine the secret is made in ``run_dir``; with a fixed ``port``
            (several machines) only when ``secret_file`` names a file every machine reads.
        secret_file: the job's secret (mode 0600, this user's); default ``<run_dir>/store.secret``
            on one machine.
        etcd: the job's etcd cluster (:mod:`.etcd_store`): no store host then, and no single
            machine whose loss ends the job. None: the store host.
        start_method: how this process starts the host: ``"exec"``, a new interpreter (about 1.5 s
            of CPU importing torch before it listens); ``"fork"``, forked from this process (listens
            at once, but keeps the pages this process holds at that point for its lifetime: for
            processes that hold little when the strategy sets up; :mod:`.host_fork`). None:
            ``$RESIHP_STORE_START_METHOD``, else ``"exec"``.
    """

    run_dir: str | None = None
    run_id: str | None = None
    attempt: int | None = None
    host: str | None = None
    port: int | None = None
    spawn: bool = True
    timeout_s: float = 30.0
    connect_timeout_s: float = 60.0
    linger_s: float = 2.0
    startup_timeout_s: float = 120.0
    remote_idle_s: float = 30.0
    authenticate: bool = True
    secret_file: str | None = None
    etcd: EtcdConfig | None = None
    start_method: str | None = None

    def __post_init__(self) -> None:
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise invalid_option("resilience.store.start_method", self.start_method, "null, 'exec' or 'fork'")
        self.resolved_start_method()  # a bad $RESIHP_STORE_START_METHOD is refused now
        for name in ("timeout_s", "connect_timeout_s", "linger_s", "startup_timeout_s", "remote_idle_s"):
            _positive(f"resilience.store.{name}", getattr(self, name))
        if self.port is not None and (not isinstance(self.port, int) or not 0 < self.port < 65536):
            raise invalid_option("resilience.store.port", self.port, "null or a TCP port 1-65535")
        if self.attempt is not None and (not isinstance(self.attempt, int) or self.attempt < 0):
            raise invalid_option("resilience.store.attempt", self.attempt, "null or an integer >= 0")
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]+", self.run_id):
            raise invalid_option("resilience.store.run_id", self.run_id, "letters, digits and _ . : -")
        if not isinstance(self.authenticate, bool):
            raise invalid_option("resilience.store.authenticate", self.authenticate, "true or false")
        if self.etcd is not None and not isinstance(self.etcd, EtcdConfig):
            raise invalid_option("resilience.store.etcd", self.etcd, "null or an EtcdConfig")

    def resolved_run_id(self) -> str:
        if self.run_id is not None:
            return self.run_id
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if not run_id or run_id == "none":
            run_id = os.environ.get("SLURM_JOB_ID", "")
        if not run_id:
            run_id = f"{os.environ.get('MASTER_ADDR', 'localhost')}-{os.environ.get('MASTER_PORT', '0')}"
        return re.sub(r"[^A-Za-z0-9_.:-]", "_", run_id)

    def resolved_attempt(self) -> int:
        if self.attempt is not None:
            return self.attempt
        for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
            if os.environ.get(name, "").isdigit():
                return int(os.environ[name])
        return 0

    def agrees_round(self) -> bool:
        """Whether the workers agree on their launch round through the store (:mod:`.store_round`):
        under torchrun (``$TORCHELASTIC_RESTART_COUNT`` set, ``$WORLD_SIZE`` known) unless ``attempt``
        is given."""
        return (self.attempt is None and "TORCHELASTIC_RESTART_COUNT" in os.environ
                and os.environ.get("WORLD_SIZE", "").isdigit())

    def resolved_run_dir(self) -> Path:
        if self.run_dir is not None:
            return Path(self.run_dir)
        return Path(tempfile.gettempdir()) / f"resihp-{os.getuid()}" / self.resolved_run_id()

    def resolved_start_method(self) -> str:
        """``start_method``, else ``$RESIHP_STORE_START_METHOD``, else ``"exec"``.

        Raises:
            ConfigError: the environment variable is neither ``exec`` nor ``fork``.
        """
        if self.start_method is not None:
            return self.start_method
        method = os.environ.get(START_METHOD_ENV, "").strip() or "exec"
        if method not in START_METHODS:
            raise ConfigError(f"{START_METHOD_ENV}={method!r}: expected 'exec' or 'fork'")
        return method

    def resolved_host(self) -> str:
        if self.host is not None:
            return self.host
        return os.environ.get("MASTER_ADDR", "127.0.0.1") if self.port is not None else "127.0.0.1"

    def resolved_secret_file(self) -> Path | None:
        """The secret that signs the TCP store's values, or None (unsigned)."""
        if not self.authenticate or self.etcd is not None:
            return None
        if self.secret_file is not None:
            return Path(self.secret_file)
        return None if self.port is not None else self.resolved_run_dir() / SECRET_FILE


def _private_dir(path: Path) -> None:
    """Creates ``path`` readable by this user only (made so if it exists and is this user's)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        path.chmod(0o700)


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if needed), waited for at most ``timeout_s``.

    Raises:
        StoreUnavailable: the lock was not obtained in time.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"could not lock {path} within {timeout_s:.0f} s") from None
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_address(run_dir: Path) -> dict[str, Any] | None:
    """The address file's content (``host``, ``port``, ``identity``), or None."""
    try:
        return json.loads((run_dir / ADDRESS_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_address(run_dir: Path, content: dict[str, Any]) -> None:
    """Writes the address file atomically (readers never see half of it)."""
    tmp = run_dir / f".{ADDRESS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(content))
    os.replace(tmp, run_dir / ADDRESS_FILE)


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def tcp_client(host: str, port: int, timeout_s: float) -> Any:
    """A new client connection to the TCPStore at ``host:port`` (raises if none within ``timeout_s``)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class RendezvousStore:
    """This worker's handle on the job's store host: finds or starts it, registers, hands out clients.

    A thread that polls the store all the time (the detector) or blocks on it (a generation's
    groups while they connect) has a connection of its own (:meth:`connect`). :attr:`control` is
    shared by everyone else, one operation at a time (:class:`LockedStore`); nobody blocks on it.

    Args:
        config: where the host runs and timeouts.
        rank: this worker's original rank (names its registration); ``None`` for a process joining a
            running job, whose rank :meth:`open` claims from the job's keys.
    """

    def __init__(self, config: StoreConfig | None = None, *, rank: int | None) -> None:
        self.config = config or StoreConfig()
        self.rank = rank
        self.run_dir = self.config.resolved_run_dir()
        #: Key prefix of this run and launch attempt (``resihp/<run id>/a<attempt>``).
        self.namespace = f"resihp/{self.config.resolved_run_id()}/a{self.config.resolved_attempt()}"
        self.address: tuple[str, int] | None = None
        self.host_identity: ProcessIdentity | None = None
        self._raw: Any = None
        #: The locked store client under :attr:`namespace` (``None`` until :meth:`connect`).
        self.control: Any = None
        self.member_id: int | None = None
        self._lock = threading.Lock()
        self._secret: bytes | None = None
        self._etcd: Any = None
        self._client: Any = None
        self._claim: Callable[[Any], int] | None = None

    # ------------------------------------------------------------------------------ opening
    def open(self, claim: Callable[[Any], int] | None = None) -> RendezvousStore:
        """Connects to the job's store (etcd, or the store host, starting it if there is none) and registers.

        Args:
            claim: for a process joining a running job (``rank`` is ``None``): returns its rank, given the
                job's store (:func:`~.joining.claim_rank`). Under torchrun such a process takes the newest
                launch round that is complete (it did not take part in agreeing on it).

        Raises:
            StoreUnavailable: no host was reachable within ``connect_timeout_s``, or the etcd cluster
                refused the credentials (:class:`~.etcd_gateway.StoreAccessDenied`) or did not answer.
        """
        cfg = self.config
        self._claim = claim
        if cfg.etcd is not None:
            return self._open_etcd()
        if cfg.run_dir is None:  # $TMPDIR/resihp-<uid>: this user's alone
            _private_dir(self.run_dir.parent)
        deadline = time.monotonic() + cfg.connect_timeout_s
        while True:
            with file_lock(self.run_dir / LOCK_FILE, max(deadline - time.monotonic(), 0.1)):
                self._load_secret(create=cfg.spawn)
                client = self._find_host()
                if client is None and cfg.spawn:
                    client = self._spawn_host(deadline)
                if client is not None:
                    self._register(self._sign(client))
                    break
            if time.monotonic() > deadline:
                raise StoreUnavailable(
                    f"no store host reachable for run dir {self.run_dir} within {cfg.connect_timeout_s:.0f} s"
                )
            time.sleep(0.2)
        self._join_namespace()
        log.info("rank %d uses the store host at %s:%d%s", self.rank, *self.address,
                 " (values signed)" if self._secret else "")
        return self

    def _open_etcd(self) -> RendezvousStore:
        from resihp_lightning.resilience.etcd_store import EtcdStore

        cfg = self.config
        assert cfg.etcd is not None
        self._etcd = EtcdStore(cfg.etcd, root="", timeout=datetime.timedelta(seconds=cfg.timeout_s))
        self._register(self._etcd.connect_now())
        self._join_namespace()
        log.info("rank %d uses the etcd store at %s", self.rank, ", ".join(cfg.etcd.endpoints))
        return self

    def _load_secret(self, create: bool) -> None:
        path = self.config.resolved_secret_file()
        if path is None or self._secret is not None:
            return
        from resihp_lightning.resilience.store_auth import create_secret, read_secret

        if create and self.config.secret_file is None:
            self._secret = create_secret(path)
        else:
            self._secret = read_secret(path)

    def _sign(self, client: Any) -> Any:
        """``client`` with the job's signature on every value (unchanged without a secret)."""
        if self._secret is None:
            return client
        from resihp_lightning.resilience.store_auth import SignedStore

        return SignedStore(client, self._secret)

    def _find_host(self) -> Any:
        cfg = self.config
        if cfg.port is not None:
            address, identity = (cfg.resolved_host(), cfg.port), None
        else:
            info = read_address(self.run_dir)
            if info is None:
                return None
            identity = ProcessIdentity(**info["identity"])
            if not identity.alive():
                return None
            address = (info["host"], int(info["port"]))
        if not port_open(*address):  # refused at once; a TCPStore client would retry for seconds
            return None
        try:
            client = tcp_client(address[0], address[1], 2.0)
        except Exception as err:  # noqa: BLE001 - refused, reset, timed out: no host there
            log.debug("no store host at %s:%d: %s", *address, err)
            return None
        self.address, self.host_identity = address, identity
        return client

    def _spawn_host(self, deadline: float) -> Any:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        previous = read_address(self.run_dir)
        args = [
            "--run-dir", str(self.run_dir),
            "--host", cfg.resolved_host(),
            "--port", str(cfg.port or 0),
            "--timeout", str(cfg.timeout_s),
            "--linger", str(cfg.linger_s),
            "--startup-timeout", str(cfg.startup_timeout_s),
            "--remote-idle", str(cfg.remote_idle_s),
            "--spawner", ProcessIdentity.current().to_json(),
        ]
        secret_file = cfg.resolved_secret_file()
        if secret_file is not None:
            args += ["--secret-file", str(secret_file)]
        if cfg.resolved_start_method() == "fork":
            from resihp_lightning.resilience.host_fork import fork_store_host

            fork_store_host(args, self.run_dir / LOG_FILE)
        else:
            self._exec_host(args)
        log.info("rank %s started a store host (run dir %s)", self.rank, self.run_dir)
        while time.monotonic() < deadline:
            info = read_address(self.run_dir)
            if info is not None and info != previous:
                identity = ProcessIdentity(**info["identity"])
                try:
                    client = tcp_client(info["host"], int(info["port"]), max(deadline - time.monotonic(), 0.5))
                except Exception as err:  # noqa: BLE001
                    raise StoreUnavailable(f"the store host started but is not reachable: {err}") from err
                self.address, self.host_identity = (info["host"], int(info["port"])), identity
                return client
            time.sleep(0.02)
        raise StoreUnavailable(f"the store host did not come up; see {self.run_dir / LOG_FILE}")

    def _exec_host(self, args: list[str]) -> None:
        """Starts the host in a new interpreter (``--detach``: it forks once more; its first process exits)."""
        command = [sys.executable, "-m", "resihp_lightning.resilience.store_host", *args, "--detach"]
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        with open(self.run_dir / LOG_FILE, "ab") as log_file:
            launcher = subprocess.Popen(  # noqa: S603 - our own module, with our interpreter
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                start_new_session=True, close_fds=True, env=env,
            )
        try:
            launcher.wait(timeout=10)  # the intermediate process exits right after its fork
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()

    def _register(self, client: Any) -> None:
        """Registers with the host (under the run directory's lock); :meth:`_join_namespace` follows."""
        import torch.distributed as dist

        client.set_timeout(datetime.timedelta(seconds=self.config.timeout_s))
        # etcd: the host's bookkeeping keys (nobody reads them there) stay inside the job's prefix.
        raw = client if self._etcd is None else dist.PrefixStore(f"resihp/{self.config.resolved_run_id()}", client)
        self._raw = LockedStore(raw, self._lock)
        self._client = client
        identity = ProcessIdentity.current()
        self.member_id = int(self._raw.add(host_key("count"), 1)) - 1
        registration = {
            "rank": self.rank,
            "identity": json.loads(identity.to_json()),
            # The host's sign of life from a member on another machine: its machine's beat (under the
            # namespace; None until the launch round is agreed, then in ``member/<i>/beat``).
            "beat_key": None if self.config.agrees_round() else self._beat_key(identity),
        }
        self._raw.set(host_key(f"member/{self.member_id}"), json.dumps(registration))

    def _beat_key(self, identity: ProcessIdentity) -> str:
        return f"{self.namespace}/{machine_beat_key(identity.machine_key)}"

    def _join_namespace(self) -> None:
        """Agrees on the launch round where torchrun's restart count cannot name it, then writes this
        process's job keys (outside the run directory's lock: the agreement waits for the others)."""
        import torch.distributed as dist

        cfg = self.config
        identity = ProcessIdentity.current()
        if cfg.agrees_round():
            from resihp_lightning.resilience.store_round import agree_round, sealed_round

            rounds = dist.PrefixStore(f"resihp/{cfg.resolved_run_id()}/rounds", self._client)
            with self._lock:
                if self.rank is None:  # joining a running launch: its round is complete already
                    number = sealed_round(rounds)
                    if number is None:
                        raise StoreUnavailable("no complete launch round of this job in the store to join")
                else:
                    number = agree_round(rounds, rank=self.rank, world_size=int(os.environ["WORLD_SIZE"]),
                                         timeout_s=cfg.startup_timeout_s)
            self.namespace = f"resihp/{cfg.resolved_run_id()}/a{number}"
            self._raw.set(host_key(f"member/{self.member_id}/beat"), self._beat_key(identity))
            log.info("launch round %d (store namespace %s)", number, self.namespace)
        self.control = LockedStore(dist.PrefixStore(self.namespace, self._client), self._lock)
        if self.rank is None:
            if self._claim is None:
                raise ValueError("a store opened without a rank needs a claim (a process joining a running job)")
            self.rank = self._claim(self.control)
        self.control.set(f"member/{self.rank}", str(self.member_id))
        self.control.set(proc_key(self.rank), identity.to_json())

    # ------------------------------------------------------------------------------ clients
    def connect(self) -> Any:
        """A new connection to the store (raw keys; wrap with :meth:`scoped` for job keys)."""
        if self._etcd is not None:
            return self._etcd.clone().connect_now()
        if self.address is None:
            raise StoreUnavailable("the store is not open")
        return self._sign(tcp_client(self.address[0], self.address[1], self.config.timeout_s))

    @property
    def peer_addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of the store's servers (``"*"``: any host), whose connections an abort must not cut."""
        if self.config.etcd is not None:
            return self.config.etcd.peer_addresses()
        return [("*", self.address[1])] if self.address else []

    def scoped(self, client: Any) -> Any:
        """``client`` seen through this job's key namespace."""
        import torch.distributed as dist

        view = dist.PrefixStore(self.namespace, client)
        return view if type(client).__module__.startswith("torch") else Pinned(view, client)

    # ------------------------------------------------------------------------------ leaving
    def mark_left(self, rank: int, reason: str) -> None:
        """Tells the host that ``rank`` no longer counts as a member (evicted or finished)."""
        control = self.control
        member = control.get(f"member/{rank}").decode() if control.check([f"member/{rank}"]) else None
        if member is not None:
            self._raw.set(host_key(f"left/{member}"), reason)

    def close(self, done: bool = True) -> None:
        """Leaves: with ``done`` the host stops counting this process (it exits once all are done).

        Never raises: at shutdown the host may be gone already.
        """
        if self._raw is None:
            return
        if done and self.member_id is not None:
            try:
                self._raw.set(host_key(f"left/{self.member_id}"), "done")
            except Exception as err:  # noqa: BLE001
                log.debug("could not say goodbye to the store host: %s", err)
        if self._etcd is not None:
            self._etcd.gateway.close()
        self._raw = self.control = None


class Pinned:
    """A C++ store view (``PrefixStore``) over a store written in Python, holding that store alive.

    pybind11 keeps only the C++ part of a Python subclass of ``torch.distributed.Store`` that nothing
    in Python references: its overridden methods are then gone ("Not implemented"). This view keeps
    the reference for as long as the view is used.
    """

    def __init__(self, view: Any, pinned: Any) -> None:
        self._view = view
        self._pinned = pinned

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


class LockedStore:
    """A store connection that several threads share: one operation at a time.

    Args:
        store: the connection (or a ``PrefixStore`` over it).
        lock: the lock of the underlying connection (shared by all views of it).
    """

    def __init__(self, store: Any, lock: threading.Lock) -> None:
        self._store = store
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attribute(*args, **kwargs)

        return locked


def beat_key(rank: int) -> str:
    """The job key of ``rank``'s heartbeat (the detector writes it, the host reads it)."""
    return f"hb/{rank}"


def proc_key(rank: int) -> str:
    """The job key of ``rank``'s :class:`~.procs.ProcessIdentity` (JSON; read by detectors on its machine)."""
    return f"proc/{rank}"
