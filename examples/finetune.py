"""Fine-tune a Llama / Qwen2-style causal LM with ``Trainer(strategy="resihp")`` through a fail-slow.

Everything is configured in YAML and overridable on the command line (jsonargparse), e.g.::

    python examples/finetune.py --config examples/configs/demo_cpu.yaml
    python examples/finetune.py --config examples/configs/demo_cpu.yaml --trainer.max_steps 30 --fault null
    python examples/finetune.py --config examples/configs/llama_finetune.yaml --model.model_path /ckpt/llama

Top-level sections: ``model`` (a local HF checkpoint dir or a ``scratch`` shape), ``data`` (raw text from
JSONL, a folder, a text file or the Python standard library's sources; or instruction JSONL, prompt/completion
or chat, trained on the completions only; an optional validation split), ``trainer``, ``strategy`` (pipeline
degree, micro-batches), ``planner`` (the re-planning controller's planner options), ``detector``,
``controller`` (``replan: false`` turns it off), ``fault`` (one injected fault, or ``null``),
``checkpoint`` (periodic checkpoints and resuming from the newest, or ``null``) and ``run_dir``.
``--print_config`` prints the full config.

On one machine the script launches its ``trainer.devices`` processes itself: Lightning's subprocess
launcher re-runs this script with torchrun-style variables (under ``torchrun`` / SLURM it uses those;
under torchrun ``trainer.num_nodes`` and ``trainer.devices`` follow the world it formed, which after an
elastic restart may be smaller). With ``checkpoint`` set, a checkpoint is written every N steps or
minutes into ``<run_dir>/checkpoints`` (the last K kept) and a (re)started job resumes from the newest
one there, planning for the processes it has now (``ElasticRestart``); the examples/*.sh and
examples/slurm_finetune.sbatch recipes restart it with torchrun.
Rank 0 writes into the run directory (default ``runs/<name>-<UTC timestamp>/``): ``config.yaml``,
``events.jsonl`` (faults, detections, plans), ``steps.jsonl`` (one line per step), ``val.jsonl`` (the
validation loss, when there is validation data), and at the end
``report.txt`` + ``timeline.png`` (``resihp report RUN_DIR`` redraws them). Bad input — an unknown
config key, a missing checkpoint dir, an unsupported architecture, an empty dataset — ends with one
``finetune: error: ...`` line and exit status 2.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # healthy_plan.py

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace  # noqa: E402

from resihp_lightning.callbacks.faults.slowdowns import FaultConfig  # noqa: E402
from resihp_lightning.callbacks.restart.periodic_checkpoint import CheckpointConfig  # noqa: E402
from resihp_lightning.callbacks.replan.replan_policy import ControllerConfig  # noqa: E402
from resihp_lightning.callbacks.failslow.straggler_core import StragglerConfig  # noqa: E402
from resihp_lightning.failstop.fail_stop_config import FailStopConfig  # noqa: E402
from resihp_lightning.config import PlannerConfig, ScratchModelConfig, moved_option  # noqa: E402
from resihp_lightning.errors import ConfigError, ResiHPError, invalid_option  # noqa: E402

RUN_DIR_ENV = "RESIHP_RUN_DIR"
PROG = "finetune"


@dataclass
class ModelOptions:
    """The model and its optimizer.

    Attributes:
        model_path: a local HF checkpoint directory (Llama / Qwen2) to fine-tune; null: train ``scratch``.
        scratch: the shape of a model trained from scratch (used when ``model_path`` is null).
        seed: the seed of everything (a scratch model's initial weights, data order, dropout).
        learning_rate: AdamW learning rate (> 0).
        weight_decay: AdamW weight decay, applied to matrices only (not to norms and biases).
        warmup_steps: linear learning-rate warm-up over this many optimizer steps (0: none).
    """

    model_path: str | None = None
    scratch: ScratchModelConfig = field(default_factory=ScratchModelConfig)
    seed: int = 0
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0


@dataclass
class DataOptions:
    """The training (and validation) data; docs/data.md has examples of each format.

    Attributes:
        source: a ``.jsonl`` file, a folder or a text file; null: the Python standard library's ``.py`` files
            (text, always present, nothing downloaded).
        format: ``text`` (raw text, every token trained), ``prompt_completion`` / ``chat`` (instruction JSONL, loss
            on the completion / assistant turns only, every example whole in one row) or ``auto`` (a ``.jsonl``
            file's first record decides: ``messages_field`` -> chat, ``prompt_field`` + ``completion_field`` ->
            prompt_completion, ``text_field`` -> text; anything else is text).
        seq_len: tokens per row (documents are packed into rows of this length).
        max_files: read at most this many files of a folder (and of the standard library); null: all.
        max_tokens: read at most this many tokens (text: the last document is cut; instruction: whole examples);
            null: all.
        text_field: the JSONL field of a text record.
        prompt_field: the JSONL field of a prompt_completion record's prompt.
        completion_field: the JSONL field of a prompt_completion record's completion (the trained tokens).
        messages_field: a chat's list of ``{"role", "content"}`` messages (rendered with the checkpoint's chat
            template when it has one).
        truncation: an instruction example longer than ``seq_len``: ``truncate`` (keep its first ``seq_len``
            tokens) or ``drop``.
        shuffle_seed: the order of a folder's files and the draw of ``val_fraction``; null: sorted order.
        val_source: validation data (read like ``source``; the caps do not apply), reported as ``val_loss``; or
            use ``val_fraction``.
        val_fraction: hold this fraction of the documents / examples (seeded by ``shuffle_seed``) out for
            validation.
        val_every_n_steps: validate every N training steps; null: once, after the last step
            (``trainer.max_steps``).
    """

    source: str | None = None
    format: str = "auto"
    seq_len: int = 1024
    max_files: int | None = 200
    max_tokens: int | None = None
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    truncation: str = "truncate"
    shuffle_seed: int | None = 0
    val_source: str | None = None
    val_fraction: float = 0.0
    val_every_n_steps: int | None = None


@dataclass
class TrainerOptions:
    """The Lightning ``Trainer`` options this script passes on.

    Attributes:
        accelerator: ``cpu``, ``gpu`` / ``cuda`` or ``auto`` (Lightning's choice), as for ``Trainer``.
        devices: processes per machine (``Trainer(devices=...)``); under torchrun, the rendezvous decides.
        num_nodes: machines (``Trainer(num_nodes=...)``); under torchrun, the rendezvous decides.
        max_steps: optimizer steps to train.
        precision: Lightning's precision flag (``bf16-true``, ``bf16-mixed``, ``32-true``...); null: Lightning's
            default (32-bit).
        threads_per_process: torch threads per process; null: the machine's cores divided by the local
            processes (>= 1).
        progress_bar: show Lightning's progress bar.
        export_hf: save the fine-tuned model as an HF checkpoint in ``<run_dir>/hf`` at the end.
    """

    accelerator: str = "auto"
    devices: int = 4
    num_nodes: int = 1
    max_steps: int = 60
    precision: str | None = None
    threads_per_process: int | None = None
    progress_bar: bool = True
    export_hf: bool = False


@dataclass
class StrategyArgs:
    """``ResiHPStrategy`` options (docs/options.md, "Strategy options", describes each one).

    Attributes:
        pipeline_degree: pipeline stages of the starting plan (a uniform ``pipeline_degree`` x the rest); null:
            the strategy's default.
        micro_batch_size: rows per micro-batch.
        micro_batches: micro-batches per optimizer step over all replicas (the global batch is
            ``micro_batch_size`` x ``micro_batches`` rows).
        deepspeed_config: DeepSpeed config entries merged into the engines' config (e.g.
            ``{"zero_optimization": {"stage": 1}}`` or ``{"bf16": {"enabled": true}}``).
        process_group_backend: ``gloo`` or ``nccl``; null: ``nccl`` on GPUs, ``gloo`` on CPUs.
        timeout_s: collective timeout: a peer that hangs without being detected fails its collectives after this
            long (keep it below torchrun's rendezvous ``join_timeout``, 600 s by default, for elastic jobs).
        fail_stop: in-process recovery from lost ranks (``FailStopConfig`` options as a mapping); null: off, a
            lost rank ends the job.
        start: the starting plan: ``uniform`` (``pipeline_degree`` x the rest) or ``planned`` (the planner's own
            plan for healthy devices, from the layers timed on one micro-batch before training; see
            examples/healthy_plan.py). A job resumed from a checkpoint starts as the checkpoint says.
        tensor_degree: processes that split every layer (tensor parallelism; ``pipeline_degree`` then counts
            groups of them). Above 1 the detector and the controller work per group, and with ``fail_stop`` a
            group that loses a member goes on at a smaller degree; the restart from a checkpoint onto a new
            world and the planned start are not built for it yet: it needs ``checkpoint: null`` and
            ``strategy.start: uniform``.
    """

    pipeline_degree: int | None = 2
    micro_batch_size: int = 1
    micro_batches: int = 8
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    process_group_backend: str | None = None
    timeout_s: float = 1800.0
    fail_stop: FailStopConfig | None = field(default_factory=FailStopConfig)
    start: str = "uniform"
    tensor_degree: int = 1


def build_parser() -> ArgumentParser:
    parser = _OneLineParser(prog=PROG, description=__doc__.splitlines()[0], default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config (later flags override it)")
    parser.add_argument("--name", type=str, default="run", help="run name (prefix of the default run directory)")
    parser.add_argument("--run_dir", type=str | None, default=None, help="run directory (default runs/<name>-<timestamp>)")
    parser.add_argument("--model", type=ModelOptions, default=ModelOptions())
    parser.add_argument("--data", type=DataOptions, default=DataOptions())
    parser.add_argument("--trainer", type=TrainerOptions, default=TrainerOptions())
    parser.add_argument("--strategy", type=StrategyArgs, default=StrategyArgs())
    parser.add_argument("--planner", type=PlannerConfig, default=PlannerConfig(solver="exact"))
    parser.add_argument("--detector", type=StragglerConfig, default=StragglerConfig())
    parser.add_argument("--replan", type=bool, default=True, help="run the re-planning controller")
    parser.add_argument("--controller", type=ControllerConfig, default=ControllerConfig())
    parser.add_argument("--fault", type=FaultConfig | None, default=None, help="one fault to inject, or null")
    parser.add_argument("--checkpoint", type=CheckpointConfig | None, default=None,
                        help="periodic checkpoints (and resuming from the newest), or null")
    return parser


class _OneLineParser(ArgumentParser):
    """Parse errors as one line (jsonargparse's message, without the usage block)."""

    def error(self, message: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        lines = [line.strip() for line in str(message).splitlines() if line.strip()]
        text = " ".join(lines[:3]) if lines else "invalid arguments"
        unknown = _unknown_key(text)
        if unknown:
            moved = moved_option(unknown)
            text = str(moved) if moved else f"unknown config key '{unknown}' (see --print_config for every key)"
        _fail(text)


def _unknown_key(message: str) -> str | None:
    import re

    match = re.search(r'No action for key "([^"]+)"', message) or re.search(r"[Uu]nrecognized arguments: (\S+)", message)
    if match:
        return match.group(1).lstrip("-")
    match = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    if match:
        return f"{match.group(1)}.{match.group(2)}"
    match = re.search(r"Key '([^']+)' is not expected", message) or re.search(r'key "([^"]+)" is not expected', message)
    return match.group(1) if match else None


def _first_process() -> bool:
    """Lightning's launcher parent (no LOCAL_RANK yet) or torchrun's rank 0."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0"


def _fail(message: str) -> None:
    """Exits with status 2; the message is printed once, by the first process (a configuration error,
    e.g. a ``pipeline_degree`` that does not divide the world, is raised on every rank alike), and by a
    process that joins the running job (``RESIHP_JOIN=1``: its errors are its own)."""
    if _first_process() or os.environ.get("RESIHP_JOIN") == "1":
        print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve_run_dir(cfg: Namespace) -> Path:
    """The run directory: ``--run_dir``, the launcher parent's choice, or ``runs/<name>-<timestamp>``."""
    chosen = cfg.run_dir or os.environ.get(RUN_DIR_ENV)
    if not chosen and "RANK" in os.environ:
        # torchrun / SLURM start every rank at once: a timestamp could differ between them.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or os.environ.get("MASTER_PORT", "0")
        chosen = str(Path("runs") / f"{cfg.name}-{run_id}")
    if not chosen:
        chosen = str(Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    os.environ[RUN_DIR_ENV] = str(Path(chosen).resolve())  # the re-run children use the same directory
    return Path(os.environ[RUN_DIR_ENV])


def check_inputs(cfg: Namespace) -> None:
    """Cheap checks before anything heavy is imported (missing checkpoint dir, unsupported architecture)."""
    model_path = cfg.model.model_path
    if model_path is not None:
        if not Path(model_path).is_dir():
            raise ConfigError(f"model.model_path {model_path!r} is not a directory (a local HF checkpoint is needed)")
        from resihp_lightning.models.hf_checkpoint import read_model_type

        read_model_type(model_path)  # raises for a missing config.json or an unsupported architecture
    for option in ("source", "val_source"):
        source = getattr(cfg.data, option)
        if source is not None and not Path(source).exists():
            raise ConfigError(f"data.{option} {source!r} does not exist")
    every = cfg.data.val_every_n_steps
    if every is not None and (not isinstance(every, int) or every < 1):
        raise invalid_option("data.val_every_n_steps", every, "an integer >= 1 or null")
    from healthy_plan import START_CHOICES

    if cfg.strategy.start not in START_CHOICES:
        raise invalid_option("strategy.start", cfg.strategy.start, START_CHOICES)
    _check_tensor_parallel(cfg)
    if cfg.trainer.devices < 1 or cfg.trainer.max_steps < 1:
        raise invalid_option("trainer.devices / trainer.max_steps", (cfg.trainer.devices, cfg.trainer.max_steps), ">= 1")


def _check_tensor_parallel(cfg: Namespace) -> None:
    """A tensor-parallel job cannot start from a planned layout yet: ``strategy.start`` must be uniform."""
    degree = cfg.strategy.tensor_degree
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise invalid_option("strategy.tensor_degree", degree, "an integer >= 1")
    if degree > 1 and cfg.strategy.start != "uniform":
        raise ConfigError(
            f"strategy.tensor_degree {degree} cannot start from a planned layout yet; use --strategy.start uniform"
        )


def _set_threads(cfg: Namespace) -> None:
    import torch

    threads = cfg.trainer.threads_per_process
    if threads is None:
        local = max(1, cfg.trainer.devices)
        threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)


def run(raw: Namespace, extra_callbacks: Sequence[Any] = ()) -> Path:
    """Runs the job described by the parsed config ``raw`` (every rank); returns the run directory.

    Args:
        raw: the parsed config.
        extra_callbacks: callbacks added after the job's own (benchmarks record with them; under
            Lightning's launcher every rank re-runs the calling script, which must pass the same).
    """
    cfg = _instantiate(raw)
    check_inputs(cfg)
    run_dir = resolve_run_dir(cfg)
    # The data first: an empty dataset is reported before Lightning and transformers are imported.
    from resihp_lightning.data import InstructionFields, build_datasets, collate_packed, load_tokenizer

    m, s, d = cfg.model, cfg.strategy, cfg.data
    tokenizer = load_tokenizer(m.model_path)
    data = build_datasets(
        tokenizer, d.seq_len, source=d.source, format=d.format, truncation=d.truncation, max_files=d.max_files,
        max_tokens=d.max_tokens, shuffle_seed=d.shuffle_seed, val_source=d.val_source, val_fraction=d.val_fraction,
        fields=InstructionFields(prompt=d.prompt_field, completion=d.completion_field, messages=d.messages_field,
                                 text=d.text_field),
    )
    dataset = data.train
    rows = s.micro_batches * s.micro_batch_size
    if len(dataset) < rows:
        raise ConfigError(
            f"the dataset has {len(dataset)} rows of {d.seq_len} tokens, fewer than one global batch "
            f"(strategy.micro_batches x micro_batch_size = {rows}); add data or lower data.seq_len"
        )
    if _first_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(build_parser().dump(raw))
        print("\n".join(data.summary()), flush=True)


    import lightning.pytorch as pl
    import transformers

    from resihp_lightning.callbacks.replan.replan_controller import ReplanController
    from resihp_lightning.callbacks.restart.elastic_restart import ElasticRestart
    from resihp_lightning.callbacks.restart.periodic_checkpoint import newest_checkpoint, periodic_checkpoint
    from resihp_lightning.data.resumable import ResumableDataLoader
    from resihp_lightning.launcher_env import launcher_shape
    from resihp_lightning.strategy.checkpoint_io import make_checkpoint_io
    from resihp_lightning.callbacks.failslow.straggler_detector import StragglerDetector
    from resihp_lightning.callbacks.faults.fault_injector import FaultInjector
    from resihp_lightning.callbacks.progress import ResiHPProgressBar, StepRecorder
    from resihp_lightning.callbacks.failstop.failstop_reporter import FailStopReporter
    from resihp_lightning.models.lightning_module import CausalLMPipelineModule
    from resihp_lightning.strategy.strategy import ResiHPStrategy

    transformers.utils.logging.disable_progress_bar()
    _set_threads(cfg)
    module = CausalLMPipelineModule(
        model_path=m.model_path,
        scratch=m.scratch,
        seed=m.seed,
        learning_rate=m.learning_rate,
        weight_decay=m.weight_decay,
        warmup_steps=m.warmup_steps,
    )
    module.check_tokenizer(tokenizer)
    # A DataLoader whose position is saved with each checkpoint (a resumed job skips the rows it trained on).
    loader = ResumableDataLoader(dataset, batch_size=rows, shuffle=True, collate_fn=collate_packed, drop_last=True)
    val_loader, val_options, val_recorder = None, {}, None
    if data.val is not None:  # evaluation batches may be short: the strategy deals them out to the replicas
        from torch.utils.data import DataLoader

        val_loader = DataLoader(data.val, batch_size=rows, shuffle=False, collate_fn=collate_packed)
        val_options = {"val_check_interval": d.val_every_n_steps or cfg.trainer.max_steps, "check_val_every_n_epoch": None}
        val_recorder = _val_loss_recorder(run_dir)

    ckpt = None
    if cfg.checkpoint is not None:
        ckpt_dir = cfg.checkpoint.dirpath or str(run_dir / "checkpoints")
        ckpt = newest_checkpoint(ckpt_dir) if cfg.checkpoint.resume else None
    start_plan = None
    if s.start == "planned" and ckpt is None:
        start_plan = _planned_start(cfg, module, dataset, run_dir)
    strategy = ResiHPStrategy(pipeline_degree=None if start_plan else s.pipeline_degree, plan=start_plan,
                              micro_batch_size=s.micro_batch_size,
                              micro_batches=s.micro_batches, deepspeed_config=dict(s.deepspeed_config),
                              process_group_backend=s.process_group_backend, timeout=s.timeout_s,
                              fail_stop=s.fail_stop, tensor_degree=s.tensor_degree)
    recorder = StepRecorder(run_dir)
    callbacks: list[Any] = [recorder]
    if cfg.fault is not None:
        callbacks.append(FaultInjector([cfg.fault], log_dir=str(run_dir)))
    callbacks.append(StragglerDetector(cfg.detector, log_dir=str(run_dir)))
    if cfg.replan:
        callbacks.append(ReplanController(cfg.controller, planner=cfg.planner))
    if s.fail_stop is not None:
        callbacks.append(FailStopReporter(log_dir=str(run_dir)))
    plugins: list[Any] = []
    if cfg.checkpoint is not None:
        callbacks.append(periodic_checkpoint(cfg.checkpoint, ckpt_dir))
        callbacks.append(ElasticRestart(planner=cfg.planner, controller=cfg.controller, log_dir=str(run_dir)))
        plugins.append(make_checkpoint_io(cfg.checkpoint.asynchronous))
    if val_recorder is not None:
        callbacks.append(val_recorder)
    callbacks.extend(extra_callbacks)
    if cfg.trainer.progress_bar:
        callbacks.append(ResiHPProgressBar(recorder))
    t = cfg.trainer
    num_nodes, devices = launcher_shape(t.devices, t.num_nodes)  # torchrun: the world of this rendezvous round
    trainer = pl.Trainer(
        accelerator=t.accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=t.max_steps,
        precision=t.precision, callbacks=callbacks, plugins=plugins, logger=False,
        enable_checkpointing=cfg.checkpoint is not None, enable_progress_bar=t.progress_bar,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(run_dir), log_every_n_steps=1,
        **val_options,
    )
    pl.seed_everything(m.seed, workers=True, verbose=False)
    started = time.perf_counter()
    # Lightning's stateful form (not fit(ckpt_path=...)): ElasticRestart reads the path before the strategy's setup.
    trainer.ckpt_path = str(ckpt) if ckpt is not None else None
    trainer.fit(module, loader, val_loader)
    if t.export_hf:  # every rank: each stage writes its own layers' shard, no rank assembles the model
        module.save_hf_checkpoint(run_dir / "hf", tokenizer_dir=m.model_path)
    if trainer.global_rank == 0:
        from resihp_lightning.report import render

        text, png = render(run_dir)
        if val_recorder is not None and val_recorder.last is not None:
            print(f"\nvalidation loss {val_recorder.last[1]:.4f} after {val_recorder.last[0]} steps (every validation: val.jsonl)")
        count = trainer.world_size // s.tensor_degree
        groups = f" ({count} tensor-parallel group{'s' if count > 1 else ''} of {s.tensor_degree})" if s.tensor_degree > 1 else ""
        print(f"\ntrained {trainer.global_step} steps in {time.perf_counter() - started:.0f} s on "
              f"{trainer.world_size} processes{groups}\n{text}\nrun directory: {run_dir}\ntimeline: {png}")
    return run_dir


def _val_loss_recorder(run_dir: Path) -> Any:
    """A callback that appends every validation's ``val_loss`` to ``<run_dir>/val.jsonl`` (rank 0) and keeps the last.

    Each line: ``steps`` (training steps done), ``val_loss`` (mean over the validation rows), ``time``.
    """
    import json

    import lightning.pytorch as pl

    class ValLossRecorder(pl.Callback):
        def __init__(self) -> None:
            self.last: tuple[int, float] | None = None

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            value = trainer.callback_metrics.get("val_loss")
            if trainer.sanity_checking or value is None:
                return
            self.last = (int(trainer.global_step), float(value))
            if trainer.global_rank == 0:
                with open(run_dir / "val.jsonl", "a", encoding="utf-8") as handle:
                    handle.write(json.dumps({"steps": self.last[0], "val_loss": self.last[1], "time": time.time()}) + "\n")

    return ValLossRecorder()


def _planned_start(cfg: Namespace, module: Any, dataset: Any, run_dir: Path) -> dict[str, Any]:
    """The planner's plan for healthy devices (``strategy.start: planned``), the same on every rank."""
    from torch.utils.data import DataLoader

    from healthy_plan import initial_plan, plan_for_healthy_devices, profile_layers
    from resihp_lightning.data import collate_packed

    s = cfg.strategy
    world = cfg.trainer.devices * cfg.trainer.num_nodes

    def compute() -> tuple[Any, dict[str, Any]]:
        batch = next(iter(DataLoader(dataset, batch_size=s.micro_batches * s.micro_batch_size, collate_fn=collate_packed)))
        costs = profile_layers(module, batch, s.micro_batch_size)
        plan = plan_for_healthy_devices(costs, world, s.micro_batches, cfg.controller, cfg.planner)
        return plan, {"layer_ms": [round(c.compute_ms, 3) for c in costs], "predicted_ms": plan.iteration_ms}

    writer = os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0"
    return initial_plan(run_dir, compute, is_writer=writer)["plan"]


def _instantiate(raw: Namespace) -> Namespace:
    """The config with its sections built as dataclasses (their own validation runs here)."""
    try:
        parser = build_parser()
        return getattr(parser, "instantiate", None)(raw) if hasattr(parser, "instantiate") else parser.instantiate_classes(raw)
    except ResiHPError:
        raise
    except Exception as err:  # jsonargparse wraps a dataclass's ConfigError
        cause = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
            if isinstance(cause, ResiHPError):
                raise cause from None
        raise ConfigError(str(err).splitlines()[0]) from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        cfg = parser.parse_args(argv)
    except ResiHPError as err:  # a dataclass's own validation, raised while parsing
        _fail(str(err))
    try:
        run(cfg)
    except ResiHPError as err:
        _fail(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
