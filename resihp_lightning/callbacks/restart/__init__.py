"""Restarts: periodic checkpoints and :class:`~.elastic_restart.ElasticRestart` (resume on a new world
under torchrun / SLURM with the speeds measured before)."""
