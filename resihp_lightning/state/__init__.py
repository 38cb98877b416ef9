"""Moving and keeping model state: layer migration between ranks, optimizer state across engine rebuilds
(plain and DeepSpeed-wrapped), the LightningModule's keys for pipeline layers, layer-keyed checkpoints."""
