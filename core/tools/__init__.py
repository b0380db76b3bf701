"""Tools on top of the engine: the CLI, safetensors export/import."""
