"""Tensor parallelism in the strategy: groups of consecutive ranks and their slices, and what a TP job needs
(checked at setup). The layers' Megatron-style splits live with the models (:mod:`resihp_lightning.models.tensor_parallel`)."""
