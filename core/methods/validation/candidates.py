"""What the chain is run on: the candidate heads, ranked on the search split
(:func:`find_candidates`), and the routes worth testing when candidates share a
block (:func:`find_routes`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.methods.validation.context import ChainContext
from core.methods.validation.setting import HeadRef, RouteRef


def find_candidates(ctx: ChainContext, k: int = 3, *, add_attention_top: bool = True) -> list[tuple[HeadRef, dict]]:
    """Heads that write from the sources toward S's answer, ranked on the *search*
    split by mean source DLA (answer minus foil; a quiet sink's claim: by mean mass
    on the sources); the top ``k``, plus the head with the highest hit rate if it is
    not among them (an attention-picked candidate, for contrast). Returns ``(head, search
    numbers)`` with the search table of every head under ``"table"``."""
    obs = ctx.search_obs
    nh = len(obs.heads)  # the heads' columns (routes planned so far come after them)
    target_dla = obs.region_sum(obs.dla, obs.sources).mean(0)[:nh]
    hits = obs.hits().mean(0)[:nh]
    mass = obs.region_sum(obs.attn, obs.sources).mean(0)[:nh]
    chance = float(obs.chance().mean())
    table = [
        {
            "head": h.name,
            "target_dla": float(target_dla[c]),
            "hit_rate": float(hits[c]),
            "target_mass": float(mass[c]),
            "entropy": float(obs.entropy[:, c].mean()),
        }
        for c, h in enumerate(obs.heads)
    ]
    # a quiet sink is found by where it attends (its write is what it is claimed not to have)
    rank, by = (mass, "top source mass") if ctx.spec.content == "quiet" else (target_dla, "top target-source DLA")
    order = list(np.argsort(-rank))
    picked = [(int(c), by) for c in order[:k]]
    if add_attention_top:
        top_att = int(np.argmax(hits))
        if top_att not in [c for c, _ in picked]:
            picked.append((top_att, "top target hit rate (attention only)"))
    out = []
    for c, why in picked:
        out.append(
            (
                obs.heads[c],
                {
                    "split": ctx.search_condition.split,
                    "n": obs.n,
                    "picked_by": why,
                    "rank_by_target_dla": order.index(c) + 1,
                    "target_dla": float(target_dla[c]),
                    "hit_rate": float(hits[c]),
                    "chance_hit_rate": chance,
                    "target_mass": float(mass[c]),
                    "condition": ctx.search_condition.to_dict(),
                    "table": table,
                },
            )
        )
    return out


def find_routes(ctx: ChainContext, found: Sequence[tuple[HeadRef, dict]]) -> list[tuple[RouteRef, dict]]:
    """Routes to test when a function may be shared by the heads of a block
    (4.5: "one function can be spread over heads"): for each block holding two
    or more of the ``found`` candidates (:func:`find_candidates`), those
    candidates together, and the whole block if it has more heads. Returns
    ``(route, search numbers)`` measured on the search split like a head's."""
    by_block: dict[int, list[HeadRef]] = {}
    for head, _ in found:
        by_block.setdefault(head.block, []).append(head)
    obs = ctx.search_obs
    out = []
    for block, heads in by_block.items():
        if len(heads) < 2:
            continue
        block_name = heads[0].name.rsplit(".H", 1)[0]
        whole = [h.head for h in ctx.pool if h.block == block]
        routes = [
            (RouteRef(block, tuple(h.head for h in heads), block_name), "the candidate heads of one block, together")
        ]
        if len(whole) > len(heads):
            routes.append(
                (RouteRef(block, tuple(whole), block_name), "every head of a block with two or more candidates")
            )
        for route, why in routes:
            c = obs.col(route)
            out.append(
                (
                    route,
                    {
                        "split": ctx.search_condition.split,
                        "n": obs.n,
                        "picked_by": why,
                        "members": [m.name for m in route.members],
                        "target_dla": float(obs.region_sum(obs.dla, obs.sources)[:, c].mean()),
                        "hit_rate": float(obs.hits()[:, c].mean()),
                        "chance_hit_rate": float(obs.chance().mean()),
                        "target_mass": float(obs.region_sum(obs.attn, obs.sources)[:, c].mean()),
                        "condition": ctx.search_condition.to_dict(),
                    },
                )
            )
    return out
