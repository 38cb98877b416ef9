"""SLURM's ``srun`` and ``scontrol show hostnames``, emulated across :class:`~.machines.Machines`.

SLURM is not installed here. To run a recipe such as ``examples/slurm_in_process.sbatch`` as it is
written, :class:`~.slurm_machines.SbatchJob` runs the batch script on machine 0 (as SLURM runs it on
the first node of the allocation) with ``resihp_lightning/testing/slurm_bin`` first on its ``PATH``:
its ``srun`` and ``scontrol`` are this module. What is emulated:

* **a job step** (``srun [options] command``): the client writes the step's request (command, the
  caller's environment, as srun's default ``--export=ALL``, the working directory, the step's nodes
  and tasks) into a spool directory on the shared file system (``$RESIHP_FAKE_SLURM_SPOOL``); the
  *slurmd* of each machine (``python -m resihp_lightning.testing.fake_slurm slurmd``, started by the
  harness) starts its node's tasks, each with the variables srun gives a task (``SLURM_PROCID``,
  ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``, ``SLURM_NNODES``, ``SLURM_STEP_*``,
  ``SLURMD_NODENAME``, ...) and the node's own ``TMPDIR``; tasks are laid out in blocks (task ``i``
  on node ``i // ntasks_per_node``, srun's default distribution); each task's output is copied to the
  client's standard output;
* ``--nodes``/``-N`` (the first N nodes of the allocation), ``--ntasks-per-node``, ``--ntasks``/``-n``
  (a multiple of the nodes), ``--kill-on-bad-exit``/``-K`` (``=1``: the first task to exit non-zero
  makes the others be killed; ``=0``, SLURM's default: nobody is), ``--overlap`` and ``--no-kill``/``-k``
  (accepted: the emulation shares every resource and never ends a step for a lost node); any other
  option is refused by name;
* **signals**: SIGINT / SIGTERM to the client are forwarded to every task of the step;
* **a lost node**: a slurmd beats into the spool every 0.5 s; a node whose beat is older than
  ``$RESIHP_FAKE_SLURM_NODE_TIMEOUT_S`` (5 s; SLURM's ``SlurmdTimeout``, 300 s by default) is lost,
  and its tasks that have not ended count as failed (exit status 1, "Node failure on nodeX"). A
  machine whose link is cut still reaches the shared file system: to the emulation it is not lost;
* **the status**: the highest task status (a task killed by signal ``s`` counts as ``128 + s``);
  ``srun: error: nodeX: task N: ...`` lines on standard error name every task that failed.

Not emulated: ``sbatch``'s queue, resource accounting, ``--exclusive``/``--gres``, CPU binding, PMI.
Each task's exit status is kept as ``exit-<task>.json`` in the step's spool directory (the tests read
it: :meth:`~.slurm_machines.SbatchJob.task_exits`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPOOL_ENV = "RESIHP_FAKE_SLURM_SPOOL"
NODE_TIMEOUT_ENV = "RESIHP_FAKE_SLURM_NODE_TIMEOUT_S"
#: The directory of the ``srun`` and ``scontrol`` shims (put it first on the batch script's ``PATH``).
BIN = Path(__file__).resolve().with_name("slurm_bin")
BEAT_S = 0.5
POLL_S = 0.1


class SrunError(ValueError):
    """A command line or an environment the emulated ``srun`` does not take (exit status 2)."""


# --- host lists -------------------------------------------------------------------------------------
def expand_hostlist(text: str) -> list[str]:
    """``"node[0-2,5],gpu01"`` -> ``["node0", "node1", "node2", "node5", "gpu01"]`` (SLURM's host list syntax,
    one bracket per name; zero-padded ranges keep their width)."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text):
        match = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not match:
            names.append(part)
            continue
        prefix, ranges = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            for number in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{number:0{len(low)}d}")
    return names


def compress_hostlist(names: Sequence[str]) -> str:
    """The inverse of :func:`expand_hostlist` for names that end in unpadded numbers (``node0..node2`` -> ``node[0-2]``)."""
    groups: dict[str, list[int]] = {}
    plain: list[str] = []
    for name in names:
        match = re.fullmatch(r"(.*?)(0|[1-9]\d*)", name)
        if match:
            groups.setdefault(match.group(1), []).append(int(match.group(2)))
        else:
            plain.append(name)
    parts = []
    for prefix, numbers in groups.items():
        ranges, start = [], None
        numbers = sorted(numbers)
        for i, n in enumerate(numbers):
            start = n if start is None else start
            if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
                ranges.append(str(start) if start == n else f"{start}-{n}")
                start = None
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts + plain)


def tasks_per_node(value: str) -> int | None:
    """``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``"2"`` or ``"2(x3)"``) as one count."""
    head = value.split("(")[0].split(",")[0]
    return int(head) if head.isdigit() else None


# --- the step ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StepRequest:
    """One job step as the client hands it to every node's slurmd.

    Attributes:
        step_id: ``SLURM_STEP_ID`` (0, 1, ... in the order the batch script starts steps).
        argv: the command every task runs.
        env: the client's environment (srun's ``--export=ALL``).
        cwd: the client's working directory.
        nodes: the step's nodes, in order (node ``i`` runs tasks ``i * per_node .. (i + 1) * per_node - 1``).
        per_node: tasks per node.
        job_nodes: the allocation's nodes.
    """

    step_id: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "."
    nodes: tuple[str, ...] = ()
    per_node: int = 1
    job_nodes: tuple[str, ...] = ()

    @property
    def ntasks(self) -> int:
        return len(self.nodes) * self.per_node

    def task_env(self, node: str, local_id: int) -> dict[str, str]:
        """What srun sets for the task ``local_id`` of ``node`` (on top of the client's environment)."""
        node_id = self.nodes.index(node)
        count = len(self.nodes)
        job_id = self.env.get("SLURM_JOB_ID", "0")
        return {
            "SLURM_PROCID": str(node_id * self.per_node + local_id), "SLURM_LOCALID": str(local_id),
            "SLURM_NODEID": str(node_id), "SLURMD_NODENAME": node, "SLURM_STEP_ID": str(self.step_id),
            "SLURM_STEPID": str(self.step_id), "SLURM_NTASKS": str(self.ntasks), "SLURM_NPROCS": str(self.ntasks),
            "SLURM_NNODES": str(count), "SLURM_STEP_NUM_NODES": str(count), "SLURM_STEP_NUM_TASKS": str(self.ntasks),
            "SLURM_STEP_NODELIST": compress_hostlist(self.nodes), "SLURM_NTASKS_PER_NODE": str(self.per_node),
            "SLURM_TASKS_PER_NODE": f"{self.per_node}(x{count})", "SLURM_STEP_TASKS_PER_NODE": f"{self.per_node}(x{count})",
            "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id,
        }


def step_dirs(spool: Path) -> list[Path]:
    """The spool's step directories, in step order."""
    return sorted((p for p in spool.glob("step-*") if p.is_dir()), key=lambda p: int(p.name.split("-")[1]))


def read_request(step_dir: Path) -> StepRequest | None:
    try:
        raw = json.loads((step_dir / "request.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return StepRequest(**{**raw, "argv": tuple(raw["argv"]), "nodes": tuple(raw["nodes"]),
                          "job_nodes": tuple(raw["job_nodes"])})


def read_exits(step_dir: Path) -> dict[int, dict]:
    """``{task: {"status": int | None, "node": str, "time": float, "how": str}}`` of the tasks that ended."""
    out = {}
    for path in step_dir.glob("exit-*.json"):
        try:
            out[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return out


def _write_json(path: Path, payload: Mapping) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _signals(step_dir: Path) -> list[int]:
    try:
        return [int(s) for s in (step_dir / "signals").read_text().split()]
    except (OSError, ValueError):
        return []


def _send_signal(step_dir: Path, signum: int) -> None:
    with open(step_dir / "signals", "a") as handle:
        handle.write(f"{signum}\n")


# --- slurmd: one per machine ------------------------------------------------------------------------
def slurmd(spool: Path, node: str) -> None:
    """Runs this node's tasks of every step in ``spool`` until killed (the harness ends it with its machine)."""
    running: dict[tuple[str, int], subprocess.Popen] = {}  # (step dir, task) -> process
    handled: set[str] = set()
    signalled: dict[str, int] = {}  # step dir -> signals already delivered
    beat = spool / f"node-{node}.beat"
    last_beat = 0.0
    while True:
        now = time.time()
        if now - last_beat >= BEAT_S:
            _write_json(beat, {"time": now})
            last_beat = now
        for step_dir in step_dirs(spool):
            if step_dir.name in handled:
                continue
            request = read_request(step_dir)
            if request is None:
                continue
            handled.add(step_dir.name)
            if node in request.nodes:
                for local_id in range(request.per_node):
                    env = {**request.env, **request.task_env(node, local_id), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
                    task = int(env["SLURM_PROCID"])
                    with open(step_dir / f"task-{task}.out", "wb") as out:
                        try:
                            running[(step_dir.name, task)] = subprocess.Popen(
                                list(request.argv), env=env, cwd=request.cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
                        except OSError as exc:  # srun: "execve(): ...: No such file or directory"
                            out.write(f"slurmstepd: error: execve(): {request.argv[0]}: {exc.strerror}\n".encode())
                            _write_json(step_dir / f"exit-{task}.json",
                                        {"status": 2, "node": node, "time": time.time(), "how": "exec failed"})
        for step_name in {name for name, _ in running}:
            sent = _signals(spool / step_name)
            for signum in sent[signalled.get(step_name, 0):]:
                for (name, _), process in running.items():
                    if name == step_name:
                        try:
                            os.killpg(process.pid, signum)
                        except ProcessLookupError:
                            pass
            signalled[step_name] = len(sent)
        for (step_name, task), process in list(running.items()):
            status = process.poll()
            if status is not None:
                del running[(step_name, task)]
                how = f"Killed by signal {-status}" if status < 0 else f"Exited with exit code {status}"
                _write_json(spool / step_name / f"exit-{task}.json",
                            {"status": status, "node": node, "time": time.time(), "how": how})
        time.sleep(POLL_S)


# --- srun: the client, in the batch script ----------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SrunOptions:
    """The options the emulation takes (see the module's documentation)."""

    nodes: int | None = None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    kill_on_bad_exit: bool = False
    argv: tuple[str, ...] = ()


_VALUED = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
           "--ntasks-per-node": "ntasks_per_node"}
_ACCEPTED = {"--overlap", "-k", "--no-kill"}


def parse_srun(argv: Sequence[str]) -> SrunOptions:
    """srun's command line: options, then the command."""
    values: dict[str, object] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in _VALUED:
            if not eq:
                i += 1
                if i >= len(argv):
                    raise SrunError(f"option {name} needs a value")
                value = argv[i]
            if not value.isdigit() or int(value) < 1:
                raise SrunError(f"option {name} takes a positive count, not {value!r}")
            values[_VALUED[name]] = int(value)
        elif name in ("-K", "--kill-on-bad-exit"):
            if value not in ("", "0", "1"):
                raise SrunError(f"option {name} takes 0 or 1, not {value!r}")
            values["kill_on_bad_exit"] = value != "0"
        elif name not in _ACCEPTED:
            raise SrunError(f"option {name} is not emulated (the emulation takes --nodes, --ntasks, --ntasks-per-node, "
                            "--kill-on-bad-exit, --overlap, --no-kill)")
        i += 1
    if i >= len(argv):
        raise SrunError("no command given")
    return SrunOptions(**values, argv=tuple(argv[i:]))  # type: ignore[arg-type]


def plan_step(options: SrunOptions, env: Mapping[str, str]) -> tuple[tuple[str, ...], int]:
    """The step's nodes and tasks per node, from its options and the allocation (the batch script's environment)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SrunError("not inside an allocation (no SLURM_JOB_NODELIST)")
    job_nodes = expand_hostlist(nodelist)
    count = options.nodes or len(job_nodes)
    if count > len(job_nodes):
        raise SrunError(f"--nodes {count}: the allocation has {len(job_nodes)} nodes")
    if options.ntasks_per_node:
        per_node = options.ntasks_per_node
    elif options.ntasks:
        if options.ntasks % count:
            raise SrunError(f"--ntasks {options.ntasks} over {count} nodes: the emulation needs a multiple")
        per_node = options.ntasks // count
    else:
        per_node = tasks_per_node(env.get("SLURM_NTASKS_PER_NODE", "")) or 1
    return tuple(job_nodes[:count]), per_node


def _new_step_dir(spool: Path) -> tuple[int, Path]:
    step_id = 0
    while True:
        path = spool / f"step-{step_id}"
        try:
            path.mkdir()
            return step_id, path
        except FileExistsError:
            step_id += 1


def _lost_nodes(spool: Path, nodes: Iterable[str], timeout_s: float) -> set[str]:
    lost = set()
    for node in nodes:
        try:
            beat = json.loads((spool / f"node-{node}.beat").read_text())["time"]
        except (OSError, ValueError, KeyError):
            continue  # never beat yet: its slurmd is starting
        if time.time() - beat > timeout_s:
            lost.add(node)
    return lost


def srun(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Runs one job step across the allocation; returns srun's exit status."""
    env = dict(os.environ if env is None else env)
    spool = Path(env.get(SPOOL_ENV, ""))
    if not env.get(SPOOL_ENV) or not spool.is_dir():
        raise SrunError(f"{SPOOL_ENV} names no spool directory (start the job with slurm_machines.SbatchJob)")
    options = parse_srun(argv)
    nodes, per_node = plan_step(options, env)
    job_nodes = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]))
    timeout_s = float(env.get(NODE_TIMEOUT_ENV, "5"))
    step_id, step_dir = _new_step_dir(spool)
    request = StepRequest(step_id=step_id, argv=options.argv, env=env, cwd=os.getcwd(), nodes=nodes, per_node=per_node,
                          job_nodes=job_nodes)
    _write_json(step_dir / "request.json", asdict(request))
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _frame: _send_signal(step_dir, s))
    offsets: dict[int, int] = {}
    failed: dict[int, dict] = {}  # tasks of lost nodes
    reported: set[int] = set()
    killing = False
    while True:
        _copy_output(step_dir, request.ntasks, offsets)
        exits = {**failed, **read_exits(step_dir)}
        for task in sorted(set(exits) - reported):
            reported.add(task)
            entry = exits[task]
            if entry["status"] != 0:
                print(f"srun: error: {entry['node']}: task {task}: {entry['how']}", file=sys.stderr, flush=True)
                if options.kill_on_bad_exit and not killing:
                    killing = True
                    _send_signal(step_dir, signal.SIGKILL)
        if len(exits) >= request.ntasks:
            break
        for node in _lost_nodes(spool, nodes, timeout_s):
            first = nodes.index(node) * per_node
            for task in range(first, first + per_node):
                if task not in exits and task not in failed:
                    failed[task] = {"status": None, "node": node, "time": time.time(), "how": f"Node failure on {node}"}
        time.sleep(POLL_S)
    _copy_output(step_dir, request.ntasks, offsets)
    return max(_status_code(e["status"]) for e in exits.values())


def _status_code(status: int | None) -> int:
    if status is None:  # its node was lost
        return 1
    return 128 - status if status < 0 else status


def _copy_output(step_dir: Path, ntasks: int, offsets: dict[int, int]) -> None:
    for task in range(ntasks):
        try:
            with open(step_dir / f"task-{task}.out", "rb") as handle:
                handle.seek(offsets.get(task, 0))
                data = handle.read()
        except OSError:
            continue
        if data:
            offsets[task] = offsets.get(task, 0) + len(data)
            sys.stdout.buffer.write(data)
    sys.stdout.flush()


def scontrol(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """``scontrol show hostnames [LIST]`` (default ``$SLURM_JOB_NODELIST``): one name per line."""
    env = os.environ if env is None else env
    if list(argv[:2]) != ["show", "hostnames"] or len(argv) > 3:
        raise SrunError("the emulation's scontrol takes `show hostnames [LIST]` only")
    text = argv[2] if len(argv) == 3 else env.get("SLURM_JOB_NODELIST", "")
    sys.stdout.write("".join(f"{name}\n" for name in expand_hostlist(text)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    try:
        if command == "srun":
            return srun(rest)
        if command == "scontrol":
            return scontrol(rest)
        if command == "slurmd" and len(rest) == 2:
            slurmd(Path(rest[0]), rest[1])
            return 0
    except SrunError as exc:
        print(f"{command} (emulated): error: {exc}", file=sys.stderr)
        return 2
    print("usage: fake_slurm srun [options] command... | scontrol show hostnames [LIST] | slurmd SPOOL NODE",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
