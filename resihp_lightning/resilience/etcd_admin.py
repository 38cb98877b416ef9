"""Turns on etcd's authentication for one job: a user whose role may read and write the job's key prefix.

Run once per cluster, after its members are up and before the job starts (the launch recipe in
``docs/machines.md`` does)::

    python -m resihp_lightning.resilience.etcd_admin --endpoints http://node0:2379,http://node1:2379 \\
        --user job --password-file job.pw --root-password-file root.pw

It adds the ``root`` user (etcd requires one to enable auth) and the job's user with a role granting
read-write on ``--key-prefix`` (default ``resihp/``, where every job writes) only, then enables auth. From then on a client
without the job's password is refused (:class:`~.etcd_gateway.StoreAccessDenied`), so a stranger who can
reach the members' ports can neither publish an abort marker nor register as a member. Running it on
a cluster that has auth on already (a second job) adds that job's user, authenticated as root.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path

from resihp_lightning.resilience.etcd_gateway import EtcdGateway, StoreAccessDenied, b64
from resihp_lightning.resilience.etcd_config import ETCD_KEY_PREFIX, prefix_end


def new_password_file(path: str | Path) -> str:
    """Writes a random password to ``path`` (mode 0600, created anew) and returns it."""
    password = secrets.token_urlsafe(24)
    path = Path(path)
    path.unlink(missing_ok=True)
    with open(path, "x", opener=lambda p, flags: os.open(p, flags, 0o600)) as handle:
        handle.write(password + "\n")
    return password


def setup_job_user(
    endpoints: list[str],
    *,
    user: str,
    password: str,
    root_password: str,
    key_prefix: str = ETCD_KEY_PREFIX,
    timeout_s: float = 20.0,
) -> None:
    """Adds ``user`` with read-write on ``key_prefix`` and enables authentication (idempotent).

    Raises:
        StoreAccessDenied: auth is on already and ``root_password`` is wrong.
        StoreUnavailable: the cluster did not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    anonymous = EtcdGateway(endpoints)
    try:
        anonymous.call("/v3/auth/user/list", {}, deadline=deadline)
        gateway = anonymous  # auth is off: anyone may administer it
    except StoreAccessDenied:
        gateway = EtcdGateway(endpoints, user="root", password=root_password)
    role = f"{user}-rw"

    def ignore_exists(path: str, body: dict) -> None:
        try:
            gateway.call(path, body, deadline=deadline)
        except StoreAccessDenied:
            raise
        except Exception as err:  # noqa: BLE001 - "already exists" is the idempotent case
            if "already exists" not in str(err) and "already" not in str(err):
                raise

    if gateway is anonymous:
        ignore_exists("/v3/auth/user/add", {"name": "root", "password": root_password})
        ignore_exists("/v3/auth/user/grant", {"user": "root", "role": "root"})
    ignore_exists("/v3/auth/role/add", {"name": role})
    gateway.call("/v3/auth/role/grant", {"name": role, "perm": {
        "permType": "READWRITE", "key": b64(key_prefix.encode()), "range_end": b64(prefix_end(key_prefix.encode())),
    }}, deadline=deadline)
    ignore_exists("/v3/auth/user/add", {"name": user, "password": password})
    gateway.call("/v3/auth/user/grant", {"user": user, "role": role}, deadline=deadline)
    if gateway is anonymous:
        gateway.call("/v3/auth/enable", {}, deadline=deadline)
    gateway.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", required=True, help="comma-separated client URLs")
    parser.add_argument("--user", required=True)
    parser.add_argument("--password-file", required=True, help="created with a random password if missing")
    parser.add_argument("--root-password-file", required=True, help="created with a random password if missing")
    parser.add_argument("--key-prefix", default=ETCD_KEY_PREFIX, help="what the user may write (the job writes resihp/)")
    args = parser.parse_args(argv)

    def password(path: str) -> str:
        return Path(path).read_text().strip() if Path(path).exists() else new_password_file(path)

    setup_job_user(
        args.endpoints.split(","), user=args.user, password=password(args.password_file),
        root_password=password(args.root_password_file), key_prefix=args.key_prefix,
    )
    print(f"etcd auth on; user {args.user!r} may read and write {args.key_prefix!r}*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
