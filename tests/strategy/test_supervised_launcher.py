"""The supervised launcher: the command the user typed is no rank, outlives every rank, and exits with the job's status.

The supervisor's tests run it over small real Python processes (no training). A real training job under
it, whose rank 0 is killed mid-step while the command lives on: tests/examples/test_finetune.py (the
example script, under Lightning's own launcher).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from resihp_lightning.strategy.rank_supervisor import RankExit, job_status

ROOT = Path(__file__).resolve().parents[2]


def test_the_jobs_status_is_the_survivors_the_restart_request_or_the_first_failure() -> None:
    killed, done, restart = RankExit(0, -signal.SIGKILL, 1.0), RankExit(1, 0, 5.0), RankExit(2, 75, 4.0)
    assert job_status([killed, done, RankExit(2, 0, 5.1)], restart_code=75) == 0
    assert job_status([killed, RankExit(1, 75, 3.0), restart], restart_code=75) == 75
    assert job_status([RankExit(0, 1, 2.0), killed, RankExit(2, 1, 2.1)], restart_code=75) == 128 + signal.SIGKILL
    assert job_status([RankExit(0, 1, 2.0), RankExit(1, 1, 2.1)], restart_code=75, interrupted=signal.SIGINT) == 130
    assert job_status([done, RankExit(0, 0, 5.0)], restart_code=75, interrupted=signal.SIGTERM) == 0
    assert killed.describe() == "killed by SIGKILL" and restart.describe() == "exit 75"


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_fail_stop_gives_lightnings_launcher_a_supervisor_that_starts_every_rank(package, monkeypatch) -> None:
    """``Trainer(devices=3, strategy=ResiHPStrategy(fail_stop=...))`` in either Lightning package, from a script:
    the launcher's ranks are local ranks 0, 1 and 2 (rank 0 too), each the command Lightning would run, one world."""
    pl = pytest.importorskip(package)
    if package == "pytorch_lightning":
        from resihp_lightning.strategy.standalone import ResiHPStrategy
    else:
        from resihp_lightning.strategy.strategy import ResiHPStrategy
    from resihp_lightning.failstop.fail_stop_config import FailStopConfig

    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)  # restored after the test (the launcher sets them, as Lightning's does)
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.1"])
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=ResiHPStrategy(fail_stop=FailStopConfig(exit_code=76)),
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    launcher = trainer.strategy.launcher
    assert type(launcher).__name__ == "Supervised_SubprocessScriptLauncher" and launcher.restart_code == 76
    commands, envs, _ = launcher.rank_commands()
    from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd

    assert commands == [list(_basic_subprocess_cmd())] * 3 and commands[0][-2:] == ["--lr", "0.1"]  # Lightning's own
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {(e["WORLD_SIZE"], e["NODE_RANK"], e["MASTER_PORT"]) for e in envs} == {("3", "0", os.environ["MASTER_PORT"])}
    plain = pl.Trainer(accelerator="cpu", devices=3, strategy=ResiHPStrategy(), logger=False)
    assert type(plain.strategy.launcher).__name__ == "_SubprocessScriptLauncher"  # without fail_stop: Lightning's


def _supervise(*ranks: str) -> subprocess.Popen:
    """A supervisor process (as the user's command) over one ``python -c`` process per rank source."""
    program = textwrap.dedent(f"""
        import os, sys
        from resihp_lightning.strategy.rank_supervisor import RankSupervisor
        ranks = {list(ranks)!r}
        commands = [[sys.executable, "-c", source] for source in ranks]
        envs = [{{**os.environ, "LOCAL_RANK": str(r)}} for r in range(len(ranks))]
        sys.exit(RankSupervisor(commands, envs, grace_s=5.0).run())
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", program], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _rank(body: str) -> str:
    """A rank's source; ``say(text)`` writes one line in one ``write`` (ranks share the supervisor's stdout)."""
    prelude = "import os, signal, sys, time\nrank = os.environ['LOCAL_RANK']\nsay = lambda text: os.write(1, f'{text}\\n'.encode())\n"
    return prelude + textwrap.dedent(body)


def test_the_supervisor_outlives_a_killed_rank_0_and_streams_the_survivors_output() -> None:
    proc = _supervise(
        _rank("os.kill(os.getpid(), signal.SIGKILL)"),
        *[_rank("time.sleep(1.0); say(f'rank {rank} trained on')")] * 2,
    )
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "rank 1 trained on" in out and "rank 2 trained on" in out
    assert "local rank 0 ended (killed by SIGKILL); ranks [1, 2] still running" in err
    assert "the job's exit status is 0" in err


def test_a_run_where_every_rank_finishes_exits_0_and_the_supervisor_says_nothing() -> None:
    proc = _supervise(*[_rank("say(f'rank {rank} done')")] * 2)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and sorted(out.splitlines()) == ["rank 0 done", "rank 1 done"]
    assert "[resihp supervisor]" not in err, err


@pytest.mark.parametrize(("codes", "expected"), [((3, 1, 1), 3), ((0, 75, 75), 75)])
def test_the_supervisor_exits_with_the_first_failure_or_the_restart_request(codes, expected) -> None:
    ranks = [_rank(f"time.sleep({0.0 if r == 0 else 0.5}); sys.exit({code})") for r, code in enumerate(codes)]
    proc = _supervise(*ranks)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == expected, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_supervisor_forwards_sigint_and_sigterm_once_and_exits_with_the_signals_status(signum) -> None:
    handler = _rank("""
        def stop(signum, frame):
            say(f'rank {rank} got {signal.Signals(signum).name}')
            sys.exit(1)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        say(f'rank {rank} ready')
        time.sleep(60)
    """)
    proc = _supervise(handler, handler)
    ready = [proc.stdout.readline() for _ in range(2)]
    assert sorted(ready) == ["rank 0 ready\n", "rank 1 ready\n"]
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err
    assert sorted(out.splitlines()) == [f"rank 0 got {name}", f"rank 1 got {name}"], repr(out)  # once each


def test_ranks_die_with_a_supervisor_killed_hard() -> None:
    proc = _supervise(*[_rank("say(os.getpid()); time.sleep(60)")] * 2)
    pids = [int(proc.stdout.readline()) for _ in range(2)]
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), "a rank outlived its killed supervisor"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
