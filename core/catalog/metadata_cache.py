"""The metadata of the checkpoints one Checkpointer reads, parsed once per version of their commit
file: ours (metadata.json), or another format's read as ours (core/foreign/: PyTorch DCP)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Tuple

from .. import foreign
from ..format.metadata import METADATA_FILE, Metadata
from ..pipeline import load as loader
from ..storage import Storage

_FOREIGN = "foreign:"  # cache keys of other formats' checkpoints


class MetadataCache:
    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: "OrderedDict[str, Tuple[object, Metadata]]" = OrderedDict()

    def read(self, store: Storage) -> Metadata:
        """metadata.json of `store`, parsed once per version (a stat/conditional read otherwise);
        without one, a foreign format's commit file; else why `store` is not a checkpoint."""
        md = self._cached(store.url, store, METADATA_FILE, lambda raw: loader.parse_metadata(store, raw))
        if md is not None:
            return md
        md = self._cached(_FOREIGN + store.url, store, foreign.COMMIT_FILES[0], lambda raw: foreign.read_metadata(store))
        if md is None:
            md = foreign.read_metadata(store)  # the rank-local DCP form (no one .metadata): read afresh
        if md is None:
            keys = store.list() if store.exists_any() else []
            raise foreign.incomplete(store, keys) or loader.missing_metadata_error(store)
        return md

    def _cached(self, key: str, store: Storage, commit_file: str, parse) -> Optional[Metadata]:
        cached = self._entries.get(key)
        version, raw, changed = store.get_versioned(commit_file, cached[0] if cached else None)
        if raw is None and not (cached is not None and not changed):
            self._entries.pop(key, None)
            return None
        if cached is not None and not changed:
            self._entries.move_to_end(key)
            return cached[1]
        md = parse(raw)
        self._entries[key] = (version, md)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return md

    def forget(self, url: str) -> None:
        self._entries.pop(url, None)
        self._entries.pop(_FOREIGN + url, None)

    def clear(self) -> None:
        self._entries.clear()
