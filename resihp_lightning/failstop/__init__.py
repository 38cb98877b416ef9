"""A job that can lose ranks: the surviving job (commit vote, recovery, reshape), hot spares that mirror the
members' calls, and the fail-stop options. Built on :mod:`resihp_lightning.resilience`."""
