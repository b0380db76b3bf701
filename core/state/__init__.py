"""State flattening: the walker and its handlers per value type (containers, modules, optimizers, DTensor, FSDP1, DeepSpeed), and the registry."""
