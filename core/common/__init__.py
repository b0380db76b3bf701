"""Vocabulary every layer uses: exception types, dtype tables, Options, Shard/FlatShard, and the one place private torch names are read."""
