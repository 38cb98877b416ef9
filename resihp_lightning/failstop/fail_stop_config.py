"""``FailStopConfig``: the options of in-process recovery from lost ranks (``ResiHPStrategy(fail_stop=...)``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from resihp_lightning.config import SOLVERS
from resihp_lightning.errors import invalid_option

#: Exit status when the job cannot recover in-process (a launcher's restart policy takes over).
UNRECOVERABLE_EXIT_CODE = 75

#: The environment variable that makes a process join a running job (``fail_stop.join`` unset).
JOIN_VARIABLE = "RESIHP_JOIN"

STORE_BACKENDS = ("tcp", "etcd")
_TCP_ONLY = ("port", "secret_file")
_ETCD_ONLY = ("endpoints", "user", "password_file", "ca_file", "cert_file", "key_file")


@dataclass(frozen=True, kw_only=True)
class StoreOptions:
    """Where the survivors agree: ``fail_stop.store``.

    ``backend: tcp`` (the default) is the store host, a process of its own on one machine
    (:mod:`~resihp_lightning.resilience.store`); ``backend: etcd`` is a replicated etcd cluster
    (:mod:`~resihp_lightning.resilience.etcd_store`), which survives the loss of any one machine,
    machine 0 included (docs/machines.md has the recipe).

    Attributes:
        backend: ``"tcp"`` or ``"etcd"``.
        port: tcp: the store host's fixed port (several machines; same as ``fail_stop.store_port``).
        secret_file: tcp: the job's secret that signs every value (mode 0600). Default on one machine:
            made in the run directory; with a fixed port, values are signed only if it is given (a
            file every machine can read).
        authenticate: tcp: sign values and ignore unsigned ones (``false``: anyone who reaches the
            port may write).
        endpoints: etcd: every member's client URL (``http://node0:2379``, ...).
        user: etcd: the job's user (``python -m resihp_lightning.resilience.etcd_admin`` makes it);
            None: the cluster has auth off.
        password_file: etcd: file with that user's password.
        ca_file: etcd: CA of ``https://`` endpoints.
        cert_file: etcd: client certificate (members with ``--client-cert-auth``).
        key_file: etcd: its key.
        request_timeout_s: etcd: bound of one request to one member before the next is tried.
        op_timeout_s: etcd: bound of one operation over all members; then ``StoreUnavailable``
            (e.g. the cluster lost its quorum).
        poll_s: etcd: longest pause between two polls of a key waited for.
    """

    backend: str = "tcp"
    port: int | None = None
    secret_file: str | None = None
    authenticate: bool = True
    endpoints: list[str] | None = None
    user: str | None = None
    password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    request_timeout_s: float = 2.0
    op_timeout_s: float = 10.0
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        from resihp_lightning.resilience.etcd_config import check_etcd_values

        if self.backend not in STORE_BACKENDS:
            raise invalid_option("fail_stop.store.backend", self.backend, STORE_BACKENDS)
        foreign = _ETCD_ONLY if self.backend == "tcp" else _TCP_ONLY
        for name in foreign:
            if getattr(self, name) is not None:
                raise invalid_option(f"fail_stop.store.{name}", getattr(self, name), f"null with backend {self.backend!r}")
        if self.port is not None and (not isinstance(self.port, int) or isinstance(self.port, bool) or not 1 <= self.port <= 65535):
            raise invalid_option("fail_stop.store.port", self.port, "null or a TCP port 1..65535")
        if not isinstance(self.authenticate, bool):
            raise invalid_option("fail_stop.store.authenticate", self.authenticate, "true or false")
        if self.backend == "etcd":
            check_etcd_values(vars(self), "fail_stop.store")

    @classmethod
    def from_value(cls, value: Any) -> StoreOptions:
        """From ``None`` (defaults), a :class:`StoreOptions`, or its mapping."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise invalid_option("fail_stop.store", value, "a mapping with `backend` ('tcp' or 'etcd') and its options")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise invalid_option(f"fail_stop.store.{unknown[0]}", value[unknown[0]], [f.name for f in fields(cls)])
        return cls(**dict(value))

    def etcd_config(self) -> Any:
        """The :class:`~resihp_lightning.resilience.etcd_config.EtcdConfig` of ``backend: etcd``."""
        from resihp_lightning.resilience.etcd_config import EtcdConfig

        return EtcdConfig(
            endpoints=tuple(self.endpoints or ()), user=self.user, password_file=self.password_file,
            ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file,
            request_timeout_s=self.request_timeout_s, op_timeout_s=self.op_timeout_s, poll_s=self.poll_s,
        )


@dataclass(frozen=True, kw_only=True)
class FailStopConfig:
    """Options of in-process fail-stop recovery.

    Attributes:
        detect_timeout_s: a rank stopped this long on its machine (SIGSTOP), or a machine whose heartbeat
            is silent this long, is lost (>= 2 x ``interval_s``); a live process that is not stopped is
            never lost for silence (a hang is ``progress_timeout_s``'s).
        interval_s: seconds between heartbeats and checks.
        progress_timeout_s: a rank whose training step has not advanced for this long is evicted as
            hung (``None``: only silent ranks; set it above the longest step, evaluation and
            checkpoint).
        join_timeout_s: how long the survivors wait for a member that neither joined the regroup nor
            was reported dead (set it above the longest compute between two collectives). Also: a
            process that lost the store (a machine cut off, a minority of etcd members) and has waited
            this long in one collective ends with ``exit_code`` instead of waiting for the collective's
            timeout.
        regroup_timeout_s: bound of one regroup.
        solver: planner backend for the survivors' plan (``exact`` is instant at small scale).
        min_data_degree: the fewest replicas the survivors' plan should keep (>= 1; default 2), so that
            the next death also loses no layer. Where no such plan fits (too few survivors, memory),
            the survivors run the best plan with fewer replicas and a warning says so.
        exit_code: process exit status when recovery is impossible (a layer lost with every holder,
            the store lost, this rank evicted).
        kill_evicted: SIGKILL a hung or silent rank the survivors left out when it runs on the machine
            of the survivors' leader (pid and start time checked), so that it releases its device and
            its launcher can exit; ``false`` leaves it frozen (e.g. to attach a debugger to it).
        store_port: the rendezvous store host's port. ``None`` (one machine): a free port, found by the
            job's processes through a file in the temporary directory. Several machines need a fixed
            port; the host then runs on node 0 at ``$MASTER_ADDR`` (that machine is a single point of
            failure: losing it ends the job, for a restart; ``store`` with the etcd backend has none).
        store: which store the survivors agree through (:class:`StoreOptions` or its mapping, e.g.
            ``{"backend": "etcd", "endpoints": ["http://node0:2379", ...], "user": "job",
            "password_file": "job.pw"}``); default: the TCP store host.
        join: this process joins the running job (a replacement started after the job began) instead of
            starting with it: it gets a rank above every rank the job has had, waits to be admitted at a
            step boundary as a hot spare, and the members' next plan may use it. ``None`` (default): from
            the environment, ``RESIHP_JOIN=1`` joins (``0`` or unset: not), so that one unchanged script
            serves the job and its replacements.
        admission_timeout_s: how long a joining process waits to find the running job in the store and to
            be admitted (the members admit newcomers at their next training step); then it fails with
            :class:`~resihp_lightning.resilience.failures.AdmissionError`.
    """

    detect_timeout_s: float = 1.0
    interval_s: float = 0.2
    progress_timeout_s: float | None = None
    join_timeout_s: float = 30.0
    regroup_timeout_s: float = 120.0
    solver: str = "exact"
    min_data_degree: int = 2
    exit_code: int = UNRECOVERABLE_EXIT_CODE
    kill_evicted: bool = True
    store_port: int | None = None
    store: StoreOptions | None = None
    join: bool | None = None
    admission_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", StoreOptions.from_value(self.store))
        if self.join is not None and not isinstance(self.join, bool):
            raise invalid_option("fail_stop.join", self.join, "null (from $RESIHP_JOIN), true or false")
        joins_from_env()  # a bad $RESIHP_JOIN is refused now, not when the strategy sets up
        if self.solver not in SOLVERS:
            raise invalid_option("fail_stop.solver", self.solver, SOLVERS)
        for name in ("interval_s", "join_timeout_s", "regroup_timeout_s", "admission_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise invalid_option(f"fail_stop.{name}", value, "seconds > 0")
        if not isinstance(self.detect_timeout_s, (int, float)) or not self.detect_timeout_s >= 2 * self.interval_s:
            raise invalid_option("fail_stop.detect_timeout_s", self.detect_timeout_s, f"seconds >= 2 x interval_s ({2 * self.interval_s:g})")
        if self.progress_timeout_s is not None and not (
            isinstance(self.progress_timeout_s, (int, float)) and self.progress_timeout_s >= 2 * self.interval_s
        ):
            raise invalid_option("fail_stop.progress_timeout_s", self.progress_timeout_s, "null or seconds >= 2 x interval_s")
        if self.join_timeout_s >= self.regroup_timeout_s:
            raise invalid_option("fail_stop.join_timeout_s", self.join_timeout_s, f"< regroup_timeout_s ({self.regroup_timeout_s:g})")
        if not isinstance(self.min_data_degree, int) or isinstance(self.min_data_degree, bool) or self.min_data_degree < 1:
            raise invalid_option("fail_stop.min_data_degree", self.min_data_degree, "an integer >= 1")
        if not isinstance(self.kill_evicted, bool):
            raise invalid_option("fail_stop.kill_evicted", self.kill_evicted, "true or false")
        if not isinstance(self.exit_code, int) or not 1 <= self.exit_code <= 255:
            raise invalid_option("fail_stop.exit_code", self.exit_code, "an integer 1..255")
        if self.store_port is not None and (not isinstance(self.store_port, int) or not 1 <= self.store_port <= 65535):
            raise invalid_option("fail_stop.store_port", self.store_port, "null or a TCP port 1..65535")
        store = self.store
        assert isinstance(store, StoreOptions)
        if self.store_port is not None and (store.backend == "etcd" or store.port not in (None, self.store_port)):
            raise invalid_option("fail_stop.store_port", self.store_port, f"null with fail_stop.store {store.backend}:{store.port}")

    @property
    def joins(self) -> bool:
        """Whether this process joins a running job (``join``, else ``$RESIHP_JOIN``)."""
        return self.join if self.join is not None else joins_from_env()

    @property
    def spans_machines(self) -> bool:
        """Whether processes on several machines can reach the store: a fixed store host port, or etcd."""
        store = self.store
        assert isinstance(store, StoreOptions)
        return store.backend == "etcd" or (self.store_port or store.port) is not None

    @classmethod
    def from_value(cls, value: Any) -> FailStopConfig | None:
        """``None``/``False``: off; ``True``: defaults; a dict or a config: as given."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise invalid_option(f"fail_stop.{sorted(unknown)[0]}", value[sorted(unknown)[0]], [f.name for f in fields(cls)])
            return cls(**value)
        raise invalid_option("fail_stop", value, "null, true, false, a FailStopConfig or its dict")

    def world_config(self, backend: str, collective_timeout_s: float, node_rank: int = 0) -> Any:
        """The :class:`~resihp_lightning.resilience.world.WorldConfig` these options describe."""
        from resihp_lightning.resilience.failure_detector import FailureDetectorConfig
        from resihp_lightning.resilience.store import StoreConfig
        from resihp_lightning.resilience.world import WorldConfig

        options = self.store
        assert isinstance(options, StoreOptions)
        port = self.store_port or options.port
        if options.backend == "etcd":
            store = StoreConfig(etcd=options.etcd_config())
        else:
            store = StoreConfig(
                port=port, spawn=port is None or node_rank == 0,
                authenticate=options.authenticate, secret_file=options.secret_file,
            )
        return WorldConfig(
            store=store,
            backend=backend,
            collective_timeout_s=collective_timeout_s,
            join_timeout_s=self.join_timeout_s,
            regroup_timeout_s=self.regroup_timeout_s,
            kill_evicted=self.kill_evicted,
            detector=FailureDetectorConfig(
                interval_s=self.interval_s, timeout_s=self.detect_timeout_s, progress_timeout_s=self.progress_timeout_s,
                stall_timeout_s=self.join_timeout_s,
            ),
        )


def joins_from_env() -> bool:
    """``$RESIHP_JOIN``: ``1`` joins a running job, ``0`` or unset does not.

    Raises:
        ConfigError: any other value.
    """
    value = os.environ.get(JOIN_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise invalid_option(JOIN_VARIABLE, value, "1 (join the running job), 0 or unset")
    return value == "1"
