"""What a cache hit that the group refused leaves among the artifacts a compile records.

A cache lookup records the entry it finds (``CacheArtifactManager``, which
``standalone_compile`` and ``torch.compiler.save_cache_artifacts`` read) before the
group's check of the hit (graph_sessions.group_takes_cached_graph). A refused hit is
compiled afresh and saved under the same key, so the record would hold two entries of
one key: ``standalone_compile``'s artifact is then not saveable (it must hold exactly
one AOTAutograd entry: vLLM's ``InductorStandaloneAdaptor`` raises "The compiled
artifact is not serializable"), and a later load could meet the refused entry. Were the
fresh entry's bytes those of the refused one, the record would skip it as seen and hold
none. So a refused hit's key is taken out of the record, seen ones included.
"""

from __future__ import annotations


def forget(artifact_type: str, key: str) -> None:
    """Take the entries of ``key`` of ``artifact_type`` ("aot_autograd", "inductor") out
    of the artifacts recorded since the record was last emptied."""
    from torch.compiler._cache import CacheArtifactManager

    recorded = CacheArtifactManager._new_cache_artifacts
    if artifact_type in recorded:
        recorded[artifact_type] = [a for a in recorded[artifact_type] if a.key != key]
    seen = CacheArtifactManager._seen_artifacts
    for artifact in [a for a in seen if a.type() == artifact_type and a.key == key]:
        seen.discard(artifact)
