"""Every save the tests make cross-checks its metadata.json: the bytes written from the cached,
serialized layout (format/layout_json.py) must be exactly those of the general path
(Metadata.to_files). Installed in the pytest process (conftest.py) and in every rank the launcher
starts for a test (launcher_worker.py, BCP_LAYOUT_CHECK=1; benchmarks that use the launcher do not
pay for it), so single-process, distributed, async and framework saves all check."""
from __future__ import annotations

import dataclasses
import json


def install() -> None:
    from bytecheckpoint.pipeline import commit
    original = commit.metadata_files
    if getattr(original, "layout_checked", False):
        return

    def checked(url, full, save_id, data_dir, world_size, structure, results, info, table_key):
        raw, table = original(url, full, save_id, data_dir, world_size, structure, results, info, table_key)
        md = commit.build_metadata(url, full, save_id, data_dir, world_size, structure, results, info)
        created = json.loads(raw)["info"]["created_unix"]  # the one value that differs between two calls
        ref_raw, ref_table = dataclasses.replace(md, info={**md.info, "created_unix": created}).to_files(table_key)
        assert (raw, table) == (ref_raw, ref_table), (
            f"metadata.json from the cached layout differs from the general path's:\n{raw[:2000]!r}\n{ref_raw[:2000]!r}")
        return raw, table

    checked.layout_checked = True
    commit.metadata_files = checked
