"""Planner backends over :class:`~resihp_lightning.plan.Problem`.

``solve(problem, config)`` dispatches to the backend named by ``config.solver``.
"""
