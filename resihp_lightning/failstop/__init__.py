"""A job that can lose ranks: the surviving job (commit vote, recovery, reshape), hot spares that mirror the
members' calls, the fail-stop options, and the strategy's parts for such a job: its membership
(:mod:`.surviving_membership`) and its step runner (:mod:`.surviving_steps`). Built on
:mod:`resihp_lightning.resilience`."""
