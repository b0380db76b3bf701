"""The node-local tier: local checkpoints with replicas on other nodes, and restoring from them."""
