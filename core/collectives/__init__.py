"""Collectives and peers: the one module that calls torch.distributed (comm), heartbeats (liveness), zero-redundancy reads."""
