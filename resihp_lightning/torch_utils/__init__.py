"""Small torch utilities shared across packages: layers on the meta device, split parameters (shards),
and the object collectives callbacks use."""
