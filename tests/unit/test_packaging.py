"""The wheel's package list (pyproject.toml) names every folder of the engine: an editable install
finds a missing one anyway, `pip install bytecheckpoint` would not (bytecheckpoint.foreign was left out)."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_engine_folder_is_packaged():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        listed = set(re.findall(r'"(bytecheckpoint(?:\.\w+)?)"', f.read()))
    core = os.path.join(ROOT, "core")
    folders = {f"bytecheckpoint.{d}" for d in os.listdir(core)
               if os.path.isfile(os.path.join(core, d, "__init__.py"))}
    assert folders | {"bytecheckpoint"} <= listed, sorted(folders - listed)
    assert not any(d == "dist" for d in os.listdir(core)), "core/dist reads as a build-output folder"
