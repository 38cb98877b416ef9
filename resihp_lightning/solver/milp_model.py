"""The planning model (docs/architecture.md) as an exact, backend-neutral mixed-integer linear program.

One :class:`MilpModel` covers one pipeline degree P: its variables, constraints, and the
:meth:`~MilpModel.encode` / :meth:`~MilpModel.decode` between plans and solutions. The backends
(:mod:`.cpsat`, :mod:`.pulp_backend`) solve one model per allowed P through
:func:`~resihp_lightning.solver.milp_driver.solve_by_degree`, which orders and prunes the degrees and
keeps the time budget.

Formulation (all coefficients integers):

* **Speed classes.** Devices with the same ``(speed, link slowdown, memory_mb)`` are interchangeable, so the model
  counts them instead of naming them. A replica is *pure* when its P devices are all of one class,
  *mixed* otherwise. Every pure replica of class c can take the layout of the pure-c replica with the
  most micro-batches (same stage times; fewer micro-batches never cost more time or memory), so one
  **pure group** per class carries a count ``n_c``, one stage partition, a per-replica maximum ``k_c``
  and a total ``a_c`` with ``n_c <= a_c <= n_c k_c``. A mixed replica holds a device outside the
  largest class, so at most ``min(D, N - max_c N_c)`` **mixed slots** exist; each is one replica with
  a one-hot class per stage and its own ``m = k``, forbidden from being pure. Mixed slots are ordered
  (used first, then by micro-batches descending): no two solutions differ by a slot permutation.
* **Bounds** use a thermometer encoding ``y[j][l] = [b_j >= l]`` (a tight LP relaxation): stage j's
  compute is ``sum_l c_l (y[j+1][l] - y[j][l])``. One grid is shared by every group when
  ``shared_partition``; otherwise each mixed slot has its own, and a pure group needs none: all its
  stages run at one speed, so ``sum_j t_j`` is the constant ``C / s + sum_j e_c(j)`` and its best
  partition for k micro-batches is the memory-feasible bottleneck partition ``B_c(min(k, P))``,
  precomputed by a dynamic programme. Its time is then ``tsum + (k - 1) B_c(k)``, linear in the bits of
  k plus one term per in-flight level where memory raises the bottleneck.
* **Stage times** ``t[g][j] >= compute / speed(class) + e_c(j)`` (big-M on the class indicator),
  ``tmax[g] >= t[g][j]``, where ``e_c(j)`` is class c's transfer time at stage j
  (:func:`~resihp_lightning.plan.stage_p2p_ms`: ``p2p`` for every stage but the last on a healthy
  link; a slow link pays its sends at its speed and the extra of its incoming transfers).
* **The product (k - 1) tmax** is linearised exactly by the binary expansion ``k - 1 = sum_b 2^b z_b``
  and McCormick rows ``w_b >= tmax - Tmax (1 - z_b)``, ``w_b >= B z_b``; ``n_c k_c`` likewise
  (``v_b <= n_c``, ``v_b <= n_max z_b``).
* **Objective** ``T >= AR delta + sum_j t[g][j] + sum_b 2^b w[g][b]`` for every group, with
  ``delta = [D > 1]``; minimise T. With slow links the all-reduce runs at the slowest link used:
  ``AR delta`` becomes a variable ``A >= AR delta`` and ``A >= AR u_c (ind + delta - 1)`` for every
  slow class c and every indicator that places it (its pure group's ``u``, a mixed slot's
  ``x[j][c]``). With healthy links the model is the one without link speeds, row for row.
* **Memory** (hard): ``static + f act <= capacity`` for every in-flight count ``f <= min(P - j, k)``,
  through indicators ``h_f >= [k >= f]``; (stage, class, f) combinations that cannot overflow even at
  the widest possible stage are left out. Memory is checked exactly (floats) in the bottleneck
  programme and in units of 1/1000 MB in the rows.
* **Cuts**: per group ``T' >= u tsum + (k - 1) B`` with B the bottleneck bound of its class (a mixed
  slot: the fastest class's bottleneck, and ``C / ((P - 1) s_0 + s_1)``); per mixed slot the chord
  (from k = 1 to K) of ``lb(k) = min_sigma [sum t + (k - 1) tmax]`` for one stage of compute sigma at
  the second speed s_1 and the rest at s_0 (concave in k, so the chord is below it); per shape
  ``T' >= max(M C / S, C / s_max + (P - 1) p2p + (M - D) C / S)`` where S is the speed of the fastest
  P*D devices (:func:`~resihp_lightning.solver.bounds.shape_lower_bound`); with an incumbent,
  ``k <= K`` where K follows from ``T' <= incumbent``.

Rounding: times are integers in units of ``1 / time_scale`` ms (``time_scale`` >= 1000, i.e. µs or
finer, chosen so the largest time is about 1e9 units). Prefix sums are rounded (not each layer), so a
stage's rounded time is within 1.5 units of the true one and T within ``1.5 (P + M)`` units
(relative error ~1e-6 at worst); cuts computed in ms give up twice that. The driver therefore
re-prices every decoded plan with :func:`~resihp_lightning.plan.evaluate` and reports that
``iteration_ms``, never the rounded objective; "optimal" means optimal up to this rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from resihp_lightning.plan import (
    EPS,
    Plan,
    Problem,
    Replica,
    device_classes,
    evaluate,
    even_bounds,
    even_split,
    prefix_sums,
    stage_p2p_by_position,
    stage_position,
)
from resihp_lightning.solver.bottleneck import min_max_partition
from resihp_lightning.solver.bounds import shape_lower_bound

#: Memory is modelled in units of 1 / MEMORY_SCALE MB.
MEMORY_SCALE = 1000
#: The largest time the model should hold, in units (keeps CP-SAT's LP numerically comfortable).
TARGET_UNITS = 1e9


@dataclass(frozen=True)
class Var:
    """A model variable: integer in ``[lb, ub]`` (``integer=False`` lets LP engines relax it)."""

    name: str
    lb: int
    ub: int
    integer: bool = True


@dataclass(frozen=True)
class Constraint:
    """``lb <= sum(coef * var) <= ub`` (``None`` = unbounded on that side).

    ``indicator``, when set, is the same constraint before its big-M linearisation:
    ``(literals, terms, lb, ub)`` means "if every literal is 1 then lb <= terms <= ub". Engines with
    native enforcement literals (CP-SAT) use it; LP engines use the big-M row. Both admit exactly
    the same integer solutions.
    """

    terms: tuple[tuple[int, int], ...]
    lb: int | None
    ub: int | None
    name: str = ""
    indicator: tuple[tuple[int, ...], tuple[tuple[int, int], ...], int | None, int | None] | None = None


def data_degrees(problem: Problem, pipeline_degree: int) -> list[int]:
    """The D values allowed with ``pipeline_degree``."""
    return sorted(d for p, d in problem.candidate_shapes() if p == pipeline_degree)


def choose_time_scale(upper_ms: float) -> int:
    """Units per ms: a power of ten >= 1000 that puts ``upper_ms`` near :data:`TARGET_UNITS`."""
    if not upper_ms > 0 or math.isinf(upper_ms):
        return 1000
    exponent = math.floor(math.log10(TARGET_UNITS / upper_ms))
    return int(10 ** min(max(exponent, 3), 9))


def bottleneck(
    tprefix: Sequence[int],
    p: int,
    minl: int,
    p2p: int | Sequence[int],
    memory: tuple[Sequence[float], Sequence[float], float, int] | None = None,
) -> tuple[int, tuple[int, ...]] | None:
    """The least possible slowest-stage time of P stages of one speed, and its bounds.

    The integer-unit tables for :func:`~resihp_lightning.solver.bottleneck.min_max_partition`
    (ties: the earliest start).

    Args:
        tprefix: prefix sums of the layers' times on this speed (integer units).
        p: stages; minl: fewest layers per stage; p2p: units added to every stage but the last, or
            a sequence of P: the units added to each stage (a class with a slow link).
        memory: ``(static prefix, activation prefix, capacity, k)``: only stages that fit with
            ``min(P - j, k)`` micro-batches in flight are allowed (checked in MB, like ``evaluate``).

    Returns:
        ``(value, bounds)``, or ``None`` when no partition fits.
    """
    import numpy as np

    pre = np.asarray(tprefix, dtype=np.int64)
    idx = np.arange(len(pre))
    wide = idx[None, :] - idx[:, None] >= minl  # [s, e]: e - s >= minl
    span = pre[None, :] - pre[:, None]
    if memory is not None:
        sp, ap, cap, k = memory
        s_arr, a_arr = np.asarray(sp, dtype=float), np.asarray(ap, dtype=float)
        static = s_arr[None, :] - s_arr[:, None]
        act = a_arr[None, :] - a_arr[:, None]
    costs, allowed = [], []
    extras = [p2p if j < p - 1 else 0 for j in range(p)] if isinstance(p2p, int) else list(p2p)
    for j in range(p):
        costs.append(span + extras[j])
        if memory is None:
            allowed.append(wide)
        else:
            f = min(p - j, k)
            allowed.append(wide & (static + f * act <= cap * (1 + EPS) + EPS))
    return min_max_partition(costs, allowed)


# --------------------------------------------------------------------------------------- model
@dataclass
class _Grid:
    """Thermometer encoding of P+1 bounds: ``const[j][l]`` is 0/1, or ``None`` where ``var[j][l]`` is."""

    const: list[list[int | None]]
    var: list[list[int | None]]


@dataclass
class _Group:
    """A pure group (``cls`` set, count ``n``) or a mixed slot (``cls`` None, one replica)."""

    cls: int | None
    grid: _Grid | None  # None: a pure group of per-replica partitions (bounds from the bottleneck DP)
    u: int = -1  # used indicator
    a: int = -1  # micro-batches (pure: total; mixed: of its replica)
    n: int | None = None  # pure: count
    kmax: int = 0  # most micro-batches one replica of the group may run
    tsum: int = 0  # lower bound of sum_j t_j when used
    tlo: int = 0  # lower bound of tmax when used
    z: list[int] = field(default_factory=list)  # bits of k - 1
    v: list[int] = field(default_factory=list)  # pure: n * z_b
    w: list[int] = field(default_factory=list)  # z_b * tmax
    x: list[list[int]] = field(default_factory=list)  # mixed: x[j][c]
    t: list[int] = field(default_factory=list)
    tmax: int = -1
    h: dict[int, int] = field(default_factory=dict)  # f -> indicator h >= [k >= f]
    q: dict[int, int] = field(default_factory=dict)  # f -> (k - 1) * Delta_f when k >= f (fixed layouts)
    steps: dict[int, int] = field(default_factory=dict)  # f -> Delta_f = B(f) - B(f - 1)
    chord: tuple[int, int] | None = None  # mixed: (lb(1), lb(K)) of the interplay bound


class MilpModel:
    """The exact MILP for one pipeline degree (see the module docstring).

    Attributes:
        problem: the problem (with the config's options already applied).
        pipeline_degree: P.
        time_scale: time units per ms.
        variables, constraints: the model; ``objective`` is the index of T (minimised).
        classes: the device classes the counts refer to.
        infeasible: True when the model cannot have a solution (backends skip it).
    """

    def __init__(self, problem: Problem, pipeline_degree: int, time_scale: int,
                 cutoff_ms: float | None = None) -> None:
        self.problem = problem
        self.pipeline_degree = pipeline_degree
        self.time_scale = time_scale
        self.variables: list[Var] = []
        self.constraints: list[Constraint] = []
        self.classes = device_classes(problem)
        self.groups: list[_Group] = []
        self.infeasible = False
        self._build(cutoff_ms)

    # ------------------------------------------------------------------------------- primitives
    def _var(self, name: str, lb: int, ub: int, integer: bool = True) -> int:
        self.variables.append(Var(name, int(lb), int(ub), integer))
        return len(self.variables) - 1

    def _add(self, terms: dict[int, int], lb: int | None = None, ub: int | None = None, name: str = "",
             indicator: tuple[tuple[int, ...], dict[int, int], int | None, int | None] | None = None) -> None:
        items = tuple((v, c) for v, c in terms.items() if c)
        if not items:
            if (lb is not None and lb > 0) or (ub is not None and ub < 0):
                self.infeasible = True
            return
        ind = None
        if indicator is not None:
            lits, row, ilb, iub = indicator
            ind = (tuple(lits), tuple((v, c) for v, c in row.items() if c), ilb, iub)
        self.constraints.append(Constraint(items, lb, ub, name, ind))

    @staticmethod
    def _acc(terms: dict[int, int], var: int, coef: int) -> None:
        terms[var] = terms.get(var, 0) + coef

    # ------------------------------------------------------------------------------------ build
    def _build(self, cutoff_ms: float | None) -> None:
        pb, p = self.problem, self.pipeline_degree
        L, M, minl = pb.num_layers, pb.micro_batches, pb.min_layers_per_stage
        ts = self.time_scale
        self.d_values = data_degrees(pb, p)
        if not self.d_values:
            raise ValueError(f"pipeline degree {p} is not a candidate shape of this problem")
        d_min, d_max = self.d_values[0], self.d_values[-1]
        classes = self.classes
        n_cls = len(classes)

        prefix = prefix_sums(pb)
        comp, stat, act = prefix.compute, prefix.static, prefix.activation
        self._stat, self._act = stat, act
        self.tcoef = [[round(comp[l] * ts / c.speed) for l in range(L + 1)] for c in classes]
        self.scoef = [round(s * MEMORY_SCALE) for s in stat]
        self.acoef = [round(a * MEMORY_SCALE) for a in act]
        p2p = self.p2p_units = round(pb.p2p_ms * ts)
        ar = self.ar_units = round(pb.allreduce_ms * ts)
        # Transfer units per class and stage position (plan.STAGE_POSITIONS: only, first, last, middle;
        # with a healthy link: 0, p2p, 0, p2p).
        self.link = [c.link_slowdown for c in classes]
        self.p2p_pos = [[round(ms * ts) for ms in stage_p2p_by_position(pb.p2p_ms, u)] for u in self.link]
        # The all-reduce per class when it is the slowest link used (with healthy links all ar).
        self.ar_class = [round(pb.allreduce_ms * u * ts) for u in self.link]
        big_t = max(row[L] for row in self.tcoef) + max(pos[3] for pos in self.p2p_pos)  # the longest a stage can take
        upper = big_t * (M + p) + max(self.ar_class)  # T never needs more than this
        if cutoff_ms is not None:
            upper = min(upper, math.ceil(cutoff_ms * ts) + 2 * (p + M) + 2)
        self.t_hi = max(min(big_t, upper), 0)
        # Rounding allowance of the cuts computed in ms: each rounded stage time is within 1.5 units
        # of the exact one, so T (sum of P stages + (k - 1) tmax, k <= M) within 1.5 (P + M) units.
        slack = 2 * (p + M) + 2
        lb_body = min(shape_lower_bound(pb, p, d, with_allreduce=False) for d in self.d_values)
        lb_units = max(0, math.floor(lb_body * ts) - slack)
        self.T = self._var("T", 0, max(upper, 0), integer=False)
        self.objective = self.T

        if d_max == 1:
            self.delta, self._delta_const = None, 0
        elif d_min == d_max:
            self.delta, self._delta_const = None, 1
        else:
            self.delta, self._delta_const = self._var("delta", 0, 1), None
        # With slow links the all-reduce depends on the classes used: a variable (rows below).
        self.arv = None
        if d_max > 1 and max(self.ar_class) > ar:
            self.arv = self._var("allreduce", 0, max(self.ar_class), integer=False)

        def k_cap(tsum: int, tlo: int) -> int:
            room = upper - tsum
            if room < 0:
                return 0
            return M if tlo <= 0 else min(M, room // tlo + 1)

        # Per-class bottleneck tables: B[c][f] for in-flight level f (1..P), with bounds.
        self.table: list[dict[int, tuple[int, tuple[int, ...]]]] = []
        for c, cls in enumerate(classes):
            levels = range(1, min(p, M) + 1) if self._memory_binds(cls.memory_mb) else [min(p, M)]
            tab = {}
            for f in levels:
                mem = (stat, act, cls.memory_mb, f) if self._memory_binds(cls.memory_mb) else None
                res = bottleneck(self.tcoef[c], p, minl, [self.extra(c, j) for j in range(p)], mem)
                if res is None:
                    break
                tab[f] = res
            self.table.append(tab)

        shared = self._new_grid("") if pb.shared_partition else None
        max_class = max(len(c.ids) for c in classes)
        n_mixed = min(d_max, pb.num_devices - max_class) if p >= 2 and n_cls >= 2 else 0

        # Pure groups.
        for c, cls in enumerate(classes):
            n_hi = min(len(cls.ids) // p, d_max)
            tab = self.table[c]
            if n_hi == 0 or not tab:
                continue
            g = _Group(cls=c, grid=shared)
            g.tsum = self.tcoef[c][L] + sum(self.extra(c, j) for j in range(p))
            g.tlo = tab[min(tab)][0]
            g.kmax = k_cap(g.tsum, g.tlo)
            if self._memory_binds(cls.memory_mb) and max(tab) < min(p, M):
                g.kmax = min(g.kmax, max(tab))  # memory forbids more micro-batches in flight
            g.n = self._var(f"n[{c}]", 0, n_hi)
            g.u = self._var(f"u[{c}]", 0, 1)
            g.a = self._var(f"a[{c}]", 0, M)
            self._add({g.n: 1, g.u: -1}, lb=0, name=f"use_lo[{c}]")
            self._add({g.n: 1, g.u: -n_hi}, ub=0, name=f"use_hi[{c}]")
            self._add({g.a: 1, g.n: -1}, lb=0, name=f"a_ge_n[{c}]")
            self._add({g.a: 1, g.u: -M}, ub=0, name=f"a_le_M[{c}]")
            self._add({g.a: 1, g.n: -max(g.kmax, 0)}, ub=0, name=f"a_le_nK[{c}]")
            nbits = max(g.kmax - 1, 0).bit_length()
            g.z = [self._var(f"z[{c}][{b}]", 0, 1) for b in range(nbits)]
            g.v = [self._var(f"v[{c}][{b}]", 0, n_hi) for b in range(nbits)]
            cap: dict[int, int] = {g.a: 1, g.n: -1}
            for b in range(nbits):
                self._add({g.v[b]: 1, g.n: -1}, ub=0, name=f"v_le_n[{c}][{b}]")
                self._add({g.v[b]: 1, g.z[b]: -n_hi}, ub=0, name=f"v_le_z[{c}][{b}]")
                self._add({g.z[b]: 1, g.u: -1}, ub=0, name=f"z_le_u[{c}][{b}]")
                cap[g.v[b]] = -(1 << b)
            self._add(cap, ub=0, name=f"a_le_nk[{c}]")
            if nbits:
                self._add({z: 1 << b for b, z in enumerate(g.z)}, ub=g.kmax - 1, name=f"k_le_K[{c}]")
            self.groups.append(g)

        # Mixed slots: bounded below by the fastest class, and by C / ((P-1) s0 + s1).
        if n_mixed:
            # A mixed replica holds two classes, so a device no faster than the 2nd class speed.
            s0, s1 = sorted((c.speed for c in classes), reverse=True)[:2]
            tot = comp[L]
            window = min(comp[i + minl] - comp[i] for i in range(L - minl + 1))
            extra_ms = window * (1 / s1 - 1 / s0)
            mix_tsum = max(0, self.tcoef[0][L] + (p - 1) * p2p + math.floor(extra_ms * ts) - p)
            fastest = bottleneck(self.tcoef[0], p, minl, p2p)

            def mix_lb(k: int) -> int:
                """Lower bound (units) of sum t + (k-1) tmax for a replica with one stage at s1."""
                def g_at(sig: float) -> float:
                    rest = (tot - sig) / s0
                    return rest + sig / s1 + (k - 1) * max(sig / s1, rest / (p - 1))
                balance = max(tot * s1 / ((p - 1) * s0 + s1), window)
                best = min(g_at(window), g_at(balance)) + (p - 1) * pb.p2p_ms
                return max(0, math.floor(best * ts) - 2 * (p + k) - 2)  # rounding slack, see above

            mix_tlo = max(fastest[0] if fastest else 0, math.floor(tot * ts / ((p - 1) * s0 + s1)) - p)
            for s in range(n_mixed):
                grid = shared if shared is not None else self._new_grid(f"m{s}")
                g = _Group(cls=None, grid=grid, tsum=mix_tsum, tlo=mix_tlo)
                g.kmax = k_cap(mix_tsum, mix_tlo)
                # The sum/max interplay of one slower stage: lb(k) is concave in k, so its chord
                # from k = 1 to k = K is a valid linear cut (and lb(k) <= upper bounds K).
                while g.kmax > 1 and mix_lb(g.kmax) > upper:
                    g.kmax -= 1
                g.chord = (mix_lb(1), mix_lb(g.kmax)) if g.kmax >= 1 else None
                g.u = self._var(f"um[{s}]", 0, 1)
                g.a = self._var(f"am[{s}]", 0, M)
                self._add({g.a: 1, g.u: -max(g.kmax, 0)}, ub=0, name=f"am_le_K[{s}]")
                nbits = max(g.kmax - 1, 0).bit_length()
                g.z = [self._var(f"zm[{s}][{b}]", 0, 1) for b in range(nbits)]
                defn: dict[int, int] = {g.a: 1, g.u: -1}
                for b in range(nbits):
                    defn[g.z[b]] = -(1 << b)
                    self._add({g.z[b]: 1, g.u: -1}, ub=0, name=f"zm_le_u[{s}][{b}]")
                self._add(defn, lb=0, ub=0, name=f"am_def[{s}]")
                if nbits:
                    self._add({z: 1 << b for b, z in enumerate(g.z)}, ub=g.kmax - 1, name=f"km_le_K[{s}]")
                g.x = [[self._var(f"x[{s}][{j}][{c}]", 0, 1) for c in range(n_cls)] for j in range(p)]
                for j in range(p):
                    row = {g.x[j][c]: 1 for c in range(n_cls)}
                    row[g.u] = -1
                    self._add(row, lb=0, ub=0, name=f"onehot[{s}][{j}]")
                for c in range(n_cls):
                    row = {g.x[j][c]: 1 for j in range(p)}
                    row[g.u] = -(p - 1)
                    self._add(row, ub=0, name=f"not_pure[{s}][{c}]")
                if self.groups and self.groups[-1].cls is None:
                    prev = self.groups[-1]
                    self._add({prev.u: 1, g.u: -1}, lb=0, name=f"sym_u[{s}]")
                    self._add({prev.a: 1, g.a: -1}, lb=0, name=f"sym_a[{s}]")
                self.groups.append(g)

        # Micro-batches, devices, data degree.
        self._add({g.a: 1 for g in self.groups}, lb=M, ub=M, name="micro_batches")
        for c, cls in enumerate(classes):
            row: dict[int, int] = {}
            for g in self.groups:
                if g.cls == c:
                    self._acc(row, g.n, p)
                elif g.cls is None:
                    for j in range(p):
                        self._acc(row, g.x[j][c], 1)
            if not row:
                if not pb.allow_exclude:
                    self.infeasible = True  # this class's devices cannot all be placed with this P
                continue
            self._add(row, lb=None if pb.allow_exclude else len(cls.ids), ub=len(cls.ids), name=f"devices[{c}]")
        dsum: dict[int, int] = {}
        for g in self.groups:
            self._acc(dsum, g.n if g.cls is not None else g.u, 1)
        self._add(dsum, lb=d_min, ub=d_max, name="data_degree")
        if self.delta is not None:
            row = dict(dsum)
            self._acc(row, self.delta, -(d_max - 1))
            self._add(row, ub=1, name="delta")

        for gi, g in enumerate(self.groups):
            obj = {self.T: 1}
            if g.grid is None:
                self._fixed_layout_time(gi, g, obj)
            else:
                self._grid_time(gi, g, obj)
            # Valid cuts without products: T' >= u tsum + (k - 1) tlo, and the mixed chord.
            cut = {self.T: 1, g.u: -g.tsum}
            for b, z in enumerate(g.z):
                self._acc(cut, z, -(g.tlo << b))
            rows = [(obj, "T"), (cut, "T_cut")]
            if g.chord is not None:
                lb1, lbk = g.chord
                slope = (lbk - lb1) // (g.kmax - 1) if g.kmax > 1 else 0
                chord = {self.T: 1, g.u: -lb1}
                for b, z in enumerate(g.z):
                    self._acc(chord, z, -(slope << b))
                rows.append((chord, "T_chord"))
            if g.kmax < 1:
                self._add({g.u: 1}, ub=0, name=f"unusable[{gi}]")
            for row, name in rows:
                if self.arv is not None:
                    self._acc(row, self.arv, -1)
                    self._add(row, lb=0, name=f"{name}[{gi}]")
                elif self.delta is not None:
                    self._acc(row, self.delta, -ar)
                    self._add(row, lb=0, name=f"{name}[{gi}]")
                else:
                    self._add(row, lb=ar * self._delta_const, name=f"{name}[{gi}]")

        cut = {self.T: 1}
        if self.arv is not None:
            cut[self.arv] = -1
            self._add(cut, lb=lb_units, name="cut")
            self._build_allreduce()
        elif self.delta is not None:
            cut[self.delta] = -ar
            self._add(cut, lb=lb_units, name="cut")
        else:
            self._add(cut, lb=lb_units + ar * self._delta_const, name="cut")
        self._build_memory()

    def extra(self, c: int, j: int) -> int:
        """Transfer units of stage j on class c (:func:`~resihp_lightning.plan.stage_p2p_ms`, rounded)."""
        p = self.pipeline_degree
        return self.p2p_pos[c][stage_position(j, p)]

    def _build_allreduce(self) -> None:
        """``A >= ar_c [D > 1] [class c used]`` for every class: the ring runs at its slowest link.

        A class is used when its pure group is (``u``) or a mixed slot puts it on some stage
        (``x[j][c]``): ``A >= ar_c (indicator + delta - 1)``, or ``A >= ar_c indicator`` when
        D > 1 is certain. Classes at the healthy value need only ``A >= ar delta``.
        """
        ar, p = self.ar_units, self.pipeline_degree
        base = {self.arv: 1}
        if self.delta is not None:
            base[self.delta] = -ar
            self._add(base, lb=0, name="allreduce")
        else:
            self._add(base, lb=ar * self._delta_const, name="allreduce")
        for c, ar_c in enumerate(self.ar_class):
            if ar_c <= ar:
                continue
            indicators = [g.u for g in self.groups if g.cls == c]
            indicators += [g.x[j][c] for g in self.groups if g.cls is None for j in range(p)]
            for i, ind in enumerate(indicators):
                row = {self.arv: 1, ind: -ar_c}
                if self.delta is not None:
                    row[self.delta] = -ar_c
                    self._add(row, lb=-ar_c, name=f"allreduce[{c}][{i}]",
                              indicator=((ind,), {self.arv: 1, self.delta: -ar_c}, 0, None))
                else:
                    self._add(row, lb=0, name=f"allreduce[{c}][{i}]")

    def _memory_binds(self, capacity: float) -> bool:
        """Whether some legal stage could overflow ``capacity`` (widest stage, P micro-batches in flight)."""
        if math.isinf(capacity):
            return False
        pb, p = self.problem, self.pipeline_degree
        widest = pb.num_layers - (p - 1) * pb.min_layers_per_stage
        f = min(p, pb.micro_batches)
        worst = max(
            self._stat[e] - self._stat[e - widest] + f * (self._act[e] - self._act[e - widest])
            for e in range(widest, pb.num_layers + 1)
        )
        return worst > capacity * (1 + EPS) + EPS

    def _new_grid(self, tag: str) -> _Grid:
        p = self.pipeline_degree
        L, minl = self.problem.num_layers, self.problem.min_layers_per_stage
        const: list[list[int | None]] = []
        var: list[list[int | None]] = []
        for j in range(p + 1):
            crow: list[int | None] = [None] * (L + 1)
            vrow: list[int | None] = [None] * (L + 1)
            lo, hi = j * minl, L - (p - j) * minl  # b_j in [lo, hi]
            if j == 0:
                lo = hi = 0
            elif j == p:
                lo = hi = L
            for l in range(1, L + 1):
                if l <= lo:
                    crow[l] = 1
                elif l > hi:
                    crow[l] = 0
                else:
                    vrow[l] = self._var(f"y{tag}[{j}][{l}]", 0, 1)
            const.append(crow)
            var.append(vrow)
        grid = _Grid(const, var)
        for j in range(p + 1):
            for l in range(1, L):  # monotone in l
                self._ge(grid, (j, l), (j, l + 1), f"mono{tag}[{j}][{l}]")
        for j in range(p):
            for l in range(1, L + 1 - minl):  # b_{j+1} >= b_j + minl
                self._ge(grid, (j + 1, l + minl), (j, l), f"gap{tag}[{j}][{l}]")
        return grid

    def _ge(self, grid: _Grid, a: tuple[int, int], b: tuple[int, int], name: str) -> None:
        """Adds y[a] >= y[b]."""
        row: dict[int, int] = {}
        const = 0
        va, vb = grid.var[a[0]][a[1]], grid.var[b[0]][b[1]]
        if va is None:
            const += grid.const[a[0]][a[1]]
        else:
            self._acc(row, va, 1)
        if vb is None:
            const -= grid.const[b[0]][b[1]]
        else:
            self._acc(row, vb, -1)
        self._add(row, lb=-const, name=name)

    def _prefix_expr(self, grid: _Grid, j: int, prefix: Sequence[int]) -> tuple[dict[int, int], int]:
        """sum_l (prefix[l] - prefix[l-1]) [b_j >= l] as (terms, constant)."""
        row: dict[int, int] = {}
        const = 0
        for l in range(1, len(prefix)):
            coef = prefix[l] - prefix[l - 1]
            if not coef:
                continue
            cv = grid.const[j][l]
            if cv is None:
                self._acc(row, grid.var[j][l], coef)
            else:
                const += coef * cv
        return row, const

    def _stage_expr(self, grid: _Grid, j: int, prefix: Sequence[int]) -> tuple[dict[int, int], int]:
        hi, chi = self._prefix_expr(grid, j + 1, prefix)
        lo, clo = self._prefix_expr(grid, j, prefix)
        row = dict(hi)
        for k, v in lo.items():
            self._acc(row, k, -v)
        return row, chi - clo

    def _grid_time(self, gi: int, g: _Group, obj: dict[int, int]) -> None:
        """Stage times from the bounds grid; adds ``- sum t - sum 2^b w`` to ``obj``."""
        p, t_hi = self.pipeline_degree, self.t_hi
        g.t = [self._var(f"t[{gi}][{j}]", 0, t_hi, integer=False) for j in range(p)]
        g.tmax = self._var(f"tmax[{gi}]", 0, t_hi, integer=False)
        cls_list = [g.cls] if g.cls is not None else list(range(len(self.classes)))
        for j in range(p):
            for c in cls_list:
                extra = self.extra(c, j)
                ind = g.u if g.cls is not None else g.x[j][c]
                big = self.tcoef[c][-1] + extra
                # t >= stage_c + extra - big (1 - ind)
                row, const = self._stage_expr(g.grid, j, self.tcoef[c])
                row = {k: -v for k, v in row.items()}
                self._acc(row, g.t[j], 1)
                plain = dict(row)
                self._acc(row, ind, -big)
                self._add(row, lb=extra - big + const, name=f"stage[{gi}][{j}][{c}]",
                          indicator=((ind,), plain, extra + const, None))
            self._add({g.tmax: 1, g.t[j]: -1}, lb=0, name=f"tmax[{gi}][{j}]")
            self._acc(obj, g.t[j], -1)
        self._add({g.tmax: 1, g.u: -min(g.tlo, t_hi)}, lb=0, name=f"tmax_lo[{gi}]")

        g.w = [self._var(f"w[{gi}][{b}]", 0, t_hi, integer=False) for b in range(len(g.z))]
        for b, z in enumerate(g.z):
            self._add({g.w[b]: 1, g.tmax: -1, z: -t_hi}, lb=-t_hi, name=f"w[{gi}][{b}]",
                      indicator=((z,), {g.w[b]: 1, g.tmax: -1}, 0, None))
            self._add({g.w[b]: 1, z: -min(g.tlo, t_hi)}, lb=0, name=f"w_lo[{gi}][{b}]")
            self._acc(obj, g.w[b], -(1 << b))

    def _fixed_layout_time(self, gi: int, g: _Group, obj: dict[int, int]) -> None:
        """A pure group with its own partition: T' >= u tsum + (k-1) B(1) + sum_f [k >= f] (k-1) Delta_f."""
        tab = self.table[g.cls]
        levels = sorted(tab)
        self._acc(obj, g.u, -g.tsum)
        base = tab[levels[0]][0]
        for b, z in enumerate(g.z):
            self._acc(obj, z, -(base << b))
        k1 = max(g.kmax - 1, 0)
        for f in levels[1:]:
            step = tab[f][0] - tab[f - 1][0]
            if step <= 0 or f > g.kmax:
                continue
            g.steps[f] = step
            h = self._indicator(g, f)
            q = g.q[f] = self._var(f"q[{gi}][{f}]", 0, step * k1, integer=False)
            # q >= step (k - 1) - step (K - 1) (1 - h)
            row = {q: 1, h: -step * k1}
            for b, z in enumerate(g.z):
                self._acc(row, z, -(step << b))
            self._add(row, lb=-step * k1, name=f"q[{gi}][{f}]")
            self._acc(obj, q, -1)

    def _build_memory(self) -> None:
        pb, p = self.problem, self.pipeline_degree
        L, M, minl = pb.num_layers, pb.micro_batches, pb.min_layers_per_stage
        scoef, acoef = self.scoef, self.acoef
        big_mem = scoef[L] + p * acoef[L]
        for gi, g in enumerate(self.groups):
            if g.grid is None:
                continue  # fixed layouts are memory-feasible by construction
            cls_list = [g.cls] if g.cls is not None else list(range(len(self.classes)))
            for j in range(p):
                lo, hi = j * minl, L - (p - j - 1) * minl  # widest possible stage j
                s_w = self._stat[hi] - self._stat[lo]
                a_w = self._act[hi] - self._act[lo]
                srow, sconst = self._stage_expr(g.grid, j, scoef)
                arow, aconst = self._stage_expr(g.grid, j, acoef)
                for c in cls_list:
                    cap_mb = self.classes[c].memory_mb
                    if math.isinf(cap_mb):
                        continue
                    cap = round(cap_mb * MEMORY_SCALE)
                    ind = g.u if g.cls is not None else g.x[j][c]
                    for f in range(1, min(p - j, M) + 1):
                        if s_w + f * a_w <= cap_mb * (1 + EPS) + EPS:
                            continue
                        if f >= 2 and f > g.kmax:
                            break
                        row = dict(srow)
                        for k, v in arow.items():
                            self._acc(row, k, f * v)
                        plain = dict(row)
                        lits = [ind]
                        self._acc(row, ind, big_mem)
                        rhs = cap + big_mem - sconst - f * aconst
                        if f >= 2:
                            lits.append(self._indicator(g, f))
                            self._acc(row, lits[-1], big_mem)
                            rhs += big_mem
                        self._add(row, ub=rhs, name=f"mem[{gi}][{j}][{c}][{f}]",
                                  indicator=(tuple(lits), plain, None, cap - sconst - f * aconst))

    def _indicator(self, g: _Group, f: int) -> int:
        """h with h >= [k >= f], where k - 1 = sum_b 2^b z_b."""
        if f not in g.h:
            h = self._var(f"h[{f}]", 0, 1)
            g.h[f] = h
            row = {z: 1 << b for b, z in enumerate(g.z)}
            self._acc(row, h, -max(g.kmax - 1, 1))
            self._add(row, ub=f - 2, name=f"h[{f}]")
        return g.h[f]

    # ---------------------------------------------------------------------------- decode/encode
    def objective_ms(self, values: Sequence[int]) -> float:
        """The model's (rounded) objective in ms."""
        return values[self.T] / self.time_scale

    @staticmethod
    def _k(g: _Group, values: Sequence[int]) -> int:
        return 1 + sum(values[z] << b for b, z in enumerate(g.z))

    def _group_bounds(self, g: _Group, values: Sequence[int]) -> tuple[int, ...]:
        if g.grid is None:
            tab = self.table[g.cls]
            level = min(self._k(g, values), self.pipeline_degree, self.problem.micro_batches)
            level = max(lv for lv in tab if lv <= level) if len(tab) > 1 else next(iter(tab))
            return tab[level][1]
        out = []
        for j in range(self.pipeline_degree + 1):
            b = 0
            for l in range(1, self.problem.num_layers + 1):
                cv = g.grid.const[j][l]
                b += cv if cv is not None else values[g.grid.var[j][l]]
            out.append(b)
        return tuple(out)

    def decode(self, values: Sequence[int]) -> Plan:
        """Turns a solution of the model into a :class:`~resihp_lightning.plan.Plan` (metadata left empty)."""
        p = self.pipeline_degree
        pools = [list(c.ids) for c in self.classes]
        replicas: list[Replica] = []
        for g in self.groups:
            if values[g.u] == 0:
                continue
            bounds = self._group_bounds(g, values)
            if g.cls is not None:
                for m in even_split(values[g.a], values[g.n]):
                    devices = tuple(pools[g.cls].pop(0) for _ in range(p))
                    replicas.append(Replica(devices, bounds, m))
            else:
                devices = []
                for j in range(p):
                    c = next(c for c in range(len(self.classes)) if values[g.x[j][c]])
                    devices.append(pools[c].pop(0))
                replicas.append(Replica(tuple(devices), bounds, values[g.a]))
        return Plan(tuple(replicas))

    def encode(self, plan: Plan) -> list[int] | None:
        """A complete assignment of the model's variables for ``plan`` (or a layout no worse).

        Pure replicas of a class are canonicalised (the bounds of the one with the most micro-batches,
        or the bottleneck partition for per-replica partitions; micro-batches re-split evenly); mixed
        replicas fill the slots by micro-batches descending. Returns ``None`` when the plan has another
        P, breaks a rule, or does not satisfy the model (e.g. beyond its cutoff).
        """
        pb, p = self.problem, self.pipeline_degree
        if plan.pipeline_degree != p or self.infeasible:
            return None
        try:
            if not evaluate(pb, plan).fits_memory:
                return None
        except Exception:  # noqa: BLE001 - an invalid plan is simply not a hint
            return None
        cls_of = {i: c for c, cls in enumerate(self.classes) for i in cls.ids}
        pure: dict[int, list[Replica]] = {}
        mixed: list[Replica] = []
        for r in plan.replicas:
            seq = {cls_of[i] for i in r.devices}
            if len(seq) == 1:
                pure.setdefault(seq.pop(), []).append(r)
            else:
                mixed.append(r)
        mixed.sort(key=lambda r: -r.micro_batches)
        vals = [0] * len(self.variables)
        pure_groups = {g.cls: g for g in self.groups if g.cls is not None}
        mixed_groups = [g for g in self.groups if g.cls is None]
        if len(mixed) > len(mixed_groups) or any(c not in pure_groups for c in pure):
            return None
        bounds_of: dict[int, tuple[int, ...]] = {}
        k_of: dict[int, int] = {}
        for c, reps in pure.items():
            g = pure_groups[c]
            best = max(reps, key=lambda r: r.micro_batches)
            bounds_of[id(g)] = best.bounds
            total = sum(r.micro_batches for r in reps)
            vals[g.n], vals[g.u], vals[g.a] = len(reps), 1, total
            k_of[id(g)] = -(-total // len(reps))
        for s, g in enumerate(mixed_groups):
            if s < len(mixed):
                r = mixed[s]
                bounds_of[id(g)] = r.bounds
                vals[g.u], vals[g.a] = 1, r.micro_batches
                k_of[id(g)] = r.micro_batches
                for j, dev in enumerate(r.devices):
                    vals[g.x[j][cls_of[dev]]] = 1
        grids: dict[int, tuple[int, ...]] = {}
        for g in self.groups:
            b = bounds_of.get(id(g))
            if b is None or g.grid is None:
                continue
            if id(g.grid) in grids and grids[id(g.grid)] != b:
                return None
            grids[id(g.grid)] = b
        for g in self.groups:
            if g.grid is None:
                continue
            b = grids.setdefault(id(g.grid), even_bounds(pb.num_layers, p))
            for j in range(p + 1):
                for l in range(1, pb.num_layers + 1):
                    var = g.grid.var[j][l]
                    if var is not None:
                        vals[var] = 1 if b[j] >= l else 0
        d = sum(vals[g.n] if g.cls is not None else vals[g.u] for g in self.groups)
        if self.delta is not None:
            vals[self.delta] = 1 if d > 1 else 0
        delta = vals[self.delta] if self.delta is not None else self._delta_const
        T = 0
        for g in self.groups:
            used = vals[g.u] == 1
            k = k_of.get(id(g), 1)
            nbits = len(g.z)
            if used and ((k - 1) >> nbits or k > g.kmax):
                return None  # more micro-batches than this model allows (beyond its cutoff)
            for bit in range(nbits):
                vals[g.z[bit]] = ((k - 1) >> bit) & 1 if used else 0
            for bit, v in enumerate(g.v):
                vals[v] = vals[g.n] if vals[g.z[bit]] else 0
            for f, h in g.h.items():
                vals[h] = 1 if used and k >= f else 0
            if not used:
                continue
            if g.grid is None:
                tab = self.table[g.cls]
                value = g.tsum + (k - 1) * tab[min(tab)][0]
                for f, q in g.q.items():
                    vals[q] = g.steps[f] * (k - 1) if k >= f else 0
                    value += vals[q]
                T = max(T, value)
                continue
            b = grids[id(g.grid)]
            for j in range(p):
                c = g.cls if g.cls is not None else next(c for c in range(len(self.classes)) if vals[g.x[j][c]])
                vals[g.t[j]] = self.tcoef[c][b[j + 1]] - self.tcoef[c][b[j]] + self.extra(c, j)
            vals[g.tmax] = max(vals[t] for t in g.t)
            for bit in range(nbits):
                vals[g.w[bit]] = vals[g.tmax] if vals[g.z[bit]] else 0
            T = max(T, sum(vals[t] for t in g.t) + (k - 1) * vals[g.tmax])
        if self.arv is not None:
            used = {g.cls for g in self.groups if g.cls is not None and vals[g.u]}
            used |= {c for g in self.groups if g.cls is None and vals[g.u]
                     for j in range(p) for c in range(len(self.classes)) if vals[g.x[j][c]]}
            vals[self.arv] = max([self.ar_units] + [self.ar_class[c] for c in used]) * delta
            T += vals[self.arv]
        else:
            T += self.ar_units * delta
        vals[self.T] = T
        for con in self.constraints:  # the cuts may sit above the rounded value
            if con.name == "cut" or con.name.startswith(("T_cut", "T_chord")):
                need = con.lb - sum(c * vals[v] for v, c in con.terms if v != self.T)
                vals[self.T] = max(vals[self.T], need)
        if self.violations(vals):
            return None
        return vals

    def violations(self, values: Sequence[int]) -> list[str]:
        """Names of the constraints and variable bounds ``values`` breaks (empty when feasible)."""
        bad = [v.name for v, x in zip(self.variables, values) if not v.lb <= x <= v.ub]
        for con in self.constraints:
            s = sum(c * values[v] for v, c in con.terms)
            if (con.lb is not None and s < con.lb) or (con.ub is not None and s > con.ub):
                bad.append(con.name)
        return bad
