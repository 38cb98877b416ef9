"""ResiHPStrategy: a Lightning strategy that runs a DeepSpeed pipeline x data-parallel job and re-plans it live."""
