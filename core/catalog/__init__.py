"""Stored checkpoints as a collection: inspect, verify, delete, latest, keep_last."""
