"""What the framework adapters share, once (DESIGN.md §2): the attach lifecycle of a handle that
wraps a framework object's methods (attachment.py) and the automatic staging warm-up with the
per-call async_staging setting (staging.py). The adapter packages (lightning_/accelerate_/
transformers_/torchtitan_bytecheckpoint) translate their framework's contract on top of these;
the metrics hand-over lives in monitor/metrics.py and the data position in data/.

The top layer of core/: it builds on the facade (Checkpointer) and may use tools/ (export)."""
