"""Step time of the layer-wise gradient reduction vs DeepSpeed's own (not a test, not run by CI).

What runs: 4 spawned gloo processes (this machine's CPU, one thread each) form a P=2 x D=2 plan on
ranks (0, 1) and (2, 3). The model is 8 ``Linear(h, h) + tanh`` layers (DeepSpeed ``LayerSpec``s,
built only on the ranks that hold them; initial values depend only on the layer index, so every
variant starts from the same model), trained with ``torch.optim.Adam`` in fp32, no clipping, MSE
loss, M=4 micro-batches of 4 rows per replica per step (the same data every step). For each model
size three ``PipelineEngine``s are built side by side, each with its own module and optimizer:

1. ``stock``: shared bounds (0,4,8) in both replicas; ``build_engine(..., broadcast=True)`` and
   DeepSpeed's stage-paired all-reduce (``allreduce_gradients`` -> ``buffered_allreduce_fallback``);
2. ``layerwise``: the same shared bounds, with a ``LayerwiseReducer`` installed (``layerwise.install``);
3. ``layerwise per-replica``: bounds (0,3,8) in replica 0 and (0,5,8) in replica 1, layer-wise.
   Its busiest stage holds 5 layers instead of 4, so its step also pays a pipeline imbalance that
   has nothing to do with the reduction.

What is timed: after ``--warmup`` untimed steps of each variant, ``--steps`` rounds; each round runs
one ``train_batch`` of every variant, in an order rotated every round, so load drift on the shared
machine hits all variants alike. Every timed step starts after a world barrier; its time is the
slowest rank's ``train_batch`` wall time (forward, backward, p2p, reduction, Adam step, loss
broadcast). ``reduce ms`` is the longest time any rank spent inside ``engine.allreduce_gradients``
during that step (a ``perf_counter`` wrapper set on the engine instance here, not in library code;
it is DeepSpeed's method in 1 and the reducer's override in 2 and 3, and it includes time spent
waiting for the slowest member of a group). Tables give per-variant medians over the rounds; the
ratio is median step ms / the stock median from the same run. A second table gives the spread: the
interquartile ranges, min-max, and the median of per-round paired ratios (variant step / stock step
of the same round). As a sanity check, the losses of all variants are compared (identical model,
data and maths, so they should agree to float rounding).

Run (about 1 minute per size on an idle 2-core machine, more under load)::

    OMP_NUM_THREADS=1 python benchmarks/gradient_reduction.py [--sizes 1M,10M,50M] [--steps 15] [--warmup 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time

LAYERS = 8
WORLD = 4
MICRO_BATCHES = 4
MICRO_BATCH_SIZE = 4
#: hidden width h per size name; params = 8 (h^2 + h).
SIZES = {"tiny": 64, "1M": 352, "10M": 1120, "50M": 2500, "100M": 3536}
DEVICES = ((0, 1), (2, 3))
#: name -> (bounds of replica 0, bounds of replica 1, layer-wise reduction)
VARIANTS = {
    "stock": ((0, 4, 8), (0, 4, 8), False),
    "layerwise": ((0, 4, 8), (0, 4, 8), True),
    "layerwise per-replica": ((0, 3, 8), (0, 5, 8), True),
}


def _plan(bounds0, bounds1):
    from resihp_lightning.plan import Plan, Replica

    return Plan(
        (Replica(DEVICES[0], tuple(bounds0), MICRO_BATCHES), Replica(DEVICES[1], tuple(bounds1), MICRO_BATCHES))
    )


def _block_class():
    import torch
    from torch import nn

    class _Block(nn.Module):
        """Linear + tanh whose initial values depend only on (hidden, index)."""

        def __init__(self, hidden: int, index: int) -> None:
            super().__init__()
            self.linear = nn.Linear(hidden, hidden)
            gen = torch.Generator().manual_seed(1000 + index)
            with torch.no_grad():
                self.linear.weight.copy_(torch.randn(hidden, hidden, generator=gen) / hidden**0.5)
                self.linear.bias.copy_(torch.randn(hidden, generator=gen) / hidden**0.5)

        def forward(self, x):
            return self.linear(x).tanh()

    return _Block


class Block:  # replaced below by the nn.Module (kept import-light for the parent process)
    pass


class _Variant:
    """One engine of the benchmark, with the time its ranks spent in ``allreduce_gradients``."""

    def __init__(self, name: str, rank: int, hidden: int) -> None:
        import torch
        from deepspeed.pipe import LayerSpec
        from torch.nn import functional as F

        from resihp_lightning.runtime.engine import build_engine, engine_config
        from resihp_lightning.runtime.layerwise import LayerwiseReducer, install
        from resihp_lightning.runtime.pipeline_module import BoundedPipelineModule
        from resihp_lightning.placement import position
        from resihp_lightning.runtime.topology import PlanTopology

        bounds0, bounds1, layerwise = VARIANTS[name]
        plan = _plan(bounds0, bounds1)
        pos = position(plan, rank)
        replica = plan.replicas[pos.replica]
        self.name = name
        self.pipe = BoundedPipelineModule(
            [LayerSpec(Block, hidden, i) for i in range(LAYERS)], PlanTopology(plan), replica.bounds,
            loss_fn=F.mse_loss,
        )
        self.reducer = LayerwiseReducer(plan, rank, self.pipe.local_layers()) if layerwise else None
        optimizer = torch.optim.Adam(self.pipe.parameters(), lr=1e-4)
        config = engine_config(MICRO_BATCH_SIZE, MICRO_BATCHES, plan.data_degree, {})
        self.engine = build_engine(self.pipe, optimizer, config, broadcast=not layerwise)
        if self.reducer is not None:
            self.reducer.broadcast()
            install(self.engine, self.reducer)
        self.reduce_seconds = 0.0
        reduce = self.engine.allreduce_gradients  # bound to the (possibly swapped) class's method

        def timed_reduce(*args, **kwargs):
            start = time.perf_counter()
            try:
                return reduce(*args, **kwargs)
            finally:
                self.reduce_seconds += time.perf_counter() - start

        self.engine.allreduce_gradients = timed_reduce
        gen = torch.Generator().manual_seed(7)
        rows = MICRO_BATCHES * MICRO_BATCH_SIZE
        x = torch.randn(plan.data_degree * rows, hidden, generator=gen)
        y = torch.tanh(torch.randn(plan.data_degree * rows, hidden, generator=gen))
        first = pos.replica * rows
        self.items = [
            (x[first + k * MICRO_BATCH_SIZE : first + (k + 1) * MICRO_BATCH_SIZE],
             y[first + k * MICRO_BATCH_SIZE : first + (k + 1) * MICRO_BATCH_SIZE])
            for k in range(MICRO_BATCHES)
        ]

    def step(self) -> tuple[float, float, float]:
        """One ``train_batch``: (loss, step seconds, seconds in ``allreduce_gradients``)."""
        self.reduce_seconds = 0.0
        start = time.perf_counter()
        loss = float(self.engine.train_batch(iter(self.items)))
        return loss, time.perf_counter() - start, self.reduce_seconds

    def destroy(self) -> None:
        from resihp_lightning.runtime.engine import destroy_engine

        destroy_engine(self.engine)
        if self.reducer is not None:
            self.reducer.destroy()


def _rank(rank: int, port: int, hiddens: list[int], steps: int, warmup: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1",
    )
    sys.stdout = sys.stderr  # DeepSpeed's prints; the parent's stdout carries only the tables
    import gc

    import torch
    import torch.distributed as dist

    from resihp_lightning.runtime.engine import init_deepspeed_comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    init_deepspeed_comm("gloo")
    names = list(VARIANTS)
    for hidden in hiddens:
        build_start = time.perf_counter()
        variants = [_Variant(name, rank, hidden) for name in names]
        build_seconds = time.perf_counter() - build_start
        record = {name: {"loss": [], "step": [], "reduce": []} for name in names}
        for round_ in range(warmup + steps):
            shift = round_ % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                dist.barrier()
                loss, seconds, reduce_seconds = variant.step()
                rec = record[variant.name]
                rec["loss"].append(loss)
                if round_ >= warmup:
                    rec["step"].append(seconds)
                    rec["reduce"].append(reduce_seconds)
        for variant in variants:
            variant.destroy()
        del variants
        gc.collect()
        dist.barrier()
        queue.put((rank, hidden, build_seconds, record))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _report(name: str, hidden: int, build_seconds: float, records: dict[int, dict]) -> tuple[list[str], list[str]]:
    """Main-table and spread-table rows of one size, from every rank's record."""
    params = LAYERS * (hidden * hidden + hidden)
    ranks = sorted(records)
    step: dict[str, list[float]] = {}
    reduce: dict[str, list[float]] = {}
    for variant in VARIANTS:
        per_rank = [records[r][variant] for r in ranks]
        # ms per round: the slowest rank (every timed step starts after a world barrier).
        step[variant] = [1e3 * max(ts) for ts in zip(*(rec["step"] for rec in per_rank))]
        reduce[variant] = [1e3 * max(ts) for ts in zip(*(rec["reduce"] for rec in per_rank))]
    stock = statistics.median(step["stock"])
    main, spread = [], []
    for variant in VARIANTS:
        med = statistics.median(step[variant])
        main.append(
            f"| {name} | {params / 1e6:.2f} M | {variant} | {med:.1f} | {statistics.median(reduce[variant]):.1f} | "
            f"{med / stock:.3f} |"
        )
        s25, s75 = _quartiles(step[variant])
        r25, r75 = _quartiles(reduce[variant])
        paired = [v / s for v, s in zip(step[variant], step["stock"])]
        p25, p75 = _quartiles(paired)
        spread.append(
            f"| {name} | {variant} | {s25:.1f}-{s75:.1f} | {min(step[variant]):.1f}-{max(step[variant]):.1f} | "
            f"{r25:.1f}-{r75:.1f} | {statistics.median(paired):.3f} ({p25:.3f}-{p75:.3f}) |"
        )
    # Identical model, data and maths: every variant's losses should agree to rounding.
    losses = {v: records[ranks[0]][v]["loss"] for v in VARIANTS}
    diff = max(abs(a - b) for v in VARIANTS for a, b in zip(losses[v], losses["stock"]))
    print(
        f"<!-- {name}: {len(step['stock'])} timed rounds, engines built in {build_seconds:.1f} s; "
        f"max |loss - stock loss| over all steps = {diff:.3g} (first loss {losses['stock'][0]:.6f}) -->",
        file=sys.stderr,
    )
    return main, spread


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,10M,50M", help=f"comma-separated, from {list(SIZES)}")
    parser.add_argument("--steps", type=int, default=15, help="timed rounds (one step of every variant each)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for one size")
    args = parser.parse_args(argv)
    names = args.sizes.split(",")
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; allowed: {list(SIZES)}")
    if args.steps < 2 or args.warmup < 0:
        parser.error("--steps must be >= 2 and --warmup >= 0")
    hiddens = [SIZES[n] for n in names]

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    start = time.perf_counter()
    procs = [
        ctx.Process(target=_rank, args=(r, port, hiddens, args.steps, args.warmup, queue)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    main_rows: list[str] = []
    spread_rows: list[str] = []
    try:
        for name, hidden in zip(names, hiddens):
            records: dict[int, dict] = {}
            build = 0.0
            while len(records) < WORLD:
                rank, got_hidden, build_seconds, record = queue.get(timeout=args.timeout)
                assert got_hidden == hidden, (got_hidden, hidden)
                records[rank] = record
                build = max(build, build_seconds)
            rows, spread = _report(name, hidden, build, records)
            main_rows += rows
            spread_rows += spread
            print(f"<!-- {name} done at {time.perf_counter() - start:.0f} s -->", file=sys.stderr)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    print("| size | params | variant | step ms (median) | reduce ms (median) | ratio vs stock |")
    print("|---|---|---|---|---|---|")
    print("\n".join(main_rows))
    print()
    print("| size | variant | step ms p25-p75 | step ms min-max | reduce ms p25-p75 | paired ratio median (p25-p75) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(spread_rows))


if __name__ == "__main__" or __name__ == "__mp_main__":
    Block = _block_class()  # LayerSpec needs a real nn.Module class in every rank

if __name__ == "__main__":
    main()
