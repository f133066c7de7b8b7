"""The audit over processes: which batches a rank runs, one shard's run, the
merge on rank 0, the launcher's environment and the gather."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from core.dataset_audit.batches import run_chunk
from core.errors import ReadoutError
from core.files.pairs import Pair
from core.readouts import ReadoutMethod, ReadoutOptions


def shard_chunks(n_items: int, batch_size: int, rank: int, world: int) -> list[range]:
    """The batches (index ranges) process ``rank`` of ``world`` runs: the
    consecutive batches of ``batch_size`` with ``k % world == rank``."""
    chunks = [range(s, min(n_items, s + batch_size)) for s in range(0, n_items, batch_size)]
    return [c for k, c in enumerate(chunks) if k % world == rank]


@dataclass
class ShardResult:
    """What one process computed: records in index order, the method audit
    rows of its first successful sample, and whether it stopped early."""

    records: list[dict]
    first_audits: dict[str, dict] | None
    first_index: int | None
    cancelled: bool


def run_shard(
    loaded,
    items: list[Pair],
    methods: list[ReadoutMethod],
    options: ReadoutOptions | None = None,
    *,
    batch_size: int = 8,
    rank: int = 0,
    world: int = 1,
    progress: Callable[[int, int, str], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> ShardResult:
    """Run the audit on this process's share of ``items``.

    Args:
        progress: ``progress(done, total, message)`` after each batch (this shard's counts).
        cancel: polled between batches; True stops early, keeping what is done.
    """
    options = options or ReadoutOptions()
    if batch_size < 1:
        raise ReadoutError("--batch-size must be at least 1")
    mine = shard_chunks(len(items), batch_size, rank, world)
    total = sum(len(c) for c in mine)
    records: list[dict] = []
    first_audits = None
    first_index = None
    done = 0
    cancelled = False
    for c in mine:
        if cancel is not None and cancel():
            cancelled = True
            break
        for rec, audits in run_chunk(loaded, [items[i] for i in c], methods, options):
            records.append(rec)
            if first_audits is None and rec["status"] == "ok":
                first_audits, first_index = audits, rec["index"]
        done += len(c)
        if progress is not None:
            progress(done, total, "auditing")
    return ShardResult(records, first_audits, first_index, cancelled)


def merge_shards(shards: list[ShardResult]) -> ShardResult:
    """Rank 0's merge: records placed by their dataset index (the order of a
    one-process run), the audit rows of the lowest-index successful sample."""
    records = [r for s in shards for r in s.records]
    by_index = {r["index"]: r for r in records}
    ordered = [by_index[i] for i in sorted(by_index)]
    firsts = [(s.first_index, s.first_audits) for s in shards if s.first_index is not None]
    first_index, first_audits = min(firsts, key=lambda x: x[0]) if firsts else (None, None)
    return ShardResult(ordered, first_audits, first_index, any(s.cancelled for s in shards))


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the launcher's environment
    (torchrun, accelerate launch); ``(0, 1, 0)`` when not launched so."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ReadoutError("RANK / WORLD_SIZE / LOCAL_RANK must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise ReadoutError(f"bad launcher environment: RANK={rank}, WORLD_SIZE={world}")
    return rank, world, local


def gather(shard: ShardResult, rank: int, world: int) -> list[ShardResult] | None:
    """Every rank's :class:`ShardResult` on rank 0 (``gather_object``); None on the others."""
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(shard, gathered, dst=0)
    return gathered
