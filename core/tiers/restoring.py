"""Restoring from the local tier: which local checkpoint the current ranks can restore (a
collective over what every node holds), and loading it from the ranks that hold its parts.
Checkpointer.restore() compares the choice with the newest persistent checkpoint."""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..collectives.comm import Comm
from ..pipeline import load as loader
from ..pipeline.workers import Workers
from ..state.flatten import TypeRegistry, top_level_placeholders
from . import local as local_tier_mod
from .local import Restored

# What one node holds of one local checkpoint (local_tier.held_here):
# (name, save_id, order key, world size at save, parts held)
Held = Tuple[str, str, Any, int, Sequence[int]]


class LocalChoice(NamedTuple):
    """The newest local checkpoint the current ranks hold completely (name None: none), when it
    was made (format/metadata.order_key), why none was chosen, and what every rank holds."""
    name: Optional[str]
    save_id: Optional[str]
    created: Any
    why: str
    candidates: List[List[Held]]


def local_choice(tier: "local_tier_mod.TierState", comm: Comm, only: Optional[str] = None) -> LocalChoice:
    """Collective over `comm`: every rank lists what its node holds, every rank gets the choice."""
    nodes = tier.nodes(comm)
    mine = local_tier_mod.held_here(tier.tier, nodes[comm.rank])
    if only is not None:
        mine = [m for m in mine if m[0] == only]
    candidates = comm.all_gather(mine)
    choice = local_tier_mod.choose(candidates)
    if choice is None:
        seen: Dict[Tuple[str, str], Tuple[int, set]] = {}
        for per in candidates:
            for name, save_id, _, world, parts in per:
                seen.setdefault((name, save_id), (world, set()))[1].update(parts)
        detail = "; ".join(f"{n}: parts {sorted(p)} of {w}" for (n, _), (w, p) in sorted(seen.items())[-3:])
        why = (f"no local checkpoint is held completely by these {comm.world_size} ranks"
               + (f" ({detail})" if detail else " (none found)"))
        return LocalChoice(None, None, 0.0, why, candidates)
    created = max(c[2] for per in candidates for c in per if (c[0], c[1]) == choice)
    return LocalChoice(choice[0], choice[1], created, "", candidates)


def restore_local(tier: "local_tier_mod.TierState", comm: Comm, state: Optional[Dict[str, Any]],
                  choice: LocalChoice, *, strict: bool, allow_pickle: bool, threads: int, registry: TypeRegistry,
                  fsdp1_route: str, slabs=None) -> Tuple[Restored, Optional[loader.LoadStats]]:
    """Load the chosen checkpoint into `state` (or, with no template, return all of it): each
    chunk is read on a rank whose node holds its part and sent to the ranks that need it."""
    if choice.name is None:
        return Restored(None, None, reason=choice.why), None
    key = (choice.name, choice.save_id)
    held = [sorted({p for c in per if (c[0], c[1]) == key for p in c[4]}) for per in choice.candidates]
    source = next(r for r, parts in enumerate(held) if parts)
    store = tier.storage(comm, choice.name)
    md = comm.broadcast(local_tier_mod.read_local_metadata(store) if comm.rank == source else None, src=source)
    if state is None:
        state = top_level_placeholders(md.structure)
    stats = loader.LoadStats()
    with Workers(threads) as workers:
        loader.load(comm, store, workers, md, state, strict=strict, allow_pickle=allow_pickle,
                    shared=local_tier_mod.holder_planner(held), stats=stats, registry=registry,
                    fsdp1_route=fsdp1_route, slabs=slabs)
    return Restored("local", choice.name, choice.save_id, state=state), stats


def not_older(local_key, persistent_key) -> bool:
    """A local checkpoint is restored unless the persistent one is newer: by training step when
    both recorded one (a tie goes to the local tier: same state, no remote read), else by key."""
    if local_key[0] >= 0 and persistent_key[0] >= 0:
        return local_key[0] >= persistent_key[0]
    return local_key >= persistent_key
