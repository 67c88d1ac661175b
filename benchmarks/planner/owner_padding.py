"""What placing whole matrices on ranks (Muon with no optimizer-step collective) costs the
all-gathers: per unit, each rank's piece is the matrices it owns, padded to the largest piece.

For each model's Muon matrices (a transformer block's attention and MLP weights; an MoE block's
attention weights and its routed experts, each expert a matrix) the table gives, at world 2, 4
and 8, the padding the owner assignment (fsdp_ext/runtime/placement/owners.py: largest first to the
least-loaded rank) leaves, the least any assignment can leave (an exact search), and the floor
no assignment can beat when one matrix is larger than a rank's fair share (world * largest -
total), as a percentage of the unit's matrices; with 1, 2 and 4 blocks per unit. Row-wise
sharding (torch's Shard(0)) pads at most world - 1 rows per matrix: about 0 here. Shapes are the
models' published configurations; nothing is trained.

    python -m benchmarks.planner.owner_padding
"""
from __future__ import annotations

import argparse

from fsdp_ext.runtime.placement.owners import assign_owners, padding

from ..common import RESULTS, command, markdown_table, write_results

WORLDS = (2, 4, 8)
BLOCKS_PER_UNIT = (1, 2, 4)


def _dense(d: int, heads: int, kv_heads: int, ffn: int) -> list[int]:
    head = d // heads
    return [d * d, kv_heads * head * d, kv_heads * head * d, d * d, ffn * d, d * ffn, ffn * d]


def _moe(d: int, heads: int, kv_heads: int, head: int, experts: int, moe_ffn: int) -> list[int]:
    attention = [heads * head * d, kv_heads * head * d, kv_heads * head * d, d * heads * head]
    return attention + [moe_ffn * d] * (3 * experts)  # w1, w2, w3 of each expert


MODELS = {  # name: the Muon matrices of one block (element counts)
    "examples/models.py GPT (d 128)": [3 * 128 * 128, 128 * 128, 512 * 128, 128 * 512],
    "Llama 3 8B (d 4096, ffn 14336, GQA 8)": _dense(4096, 32, 8, 14336),
    "Llama 3 70B (d 8192, ffn 28672, GQA 8)": _dense(8192, 64, 8, 28672),
    "Qwen3-30B-A3B (d 2048, 128 experts of 768)": _moe(2048, 32, 4, 128, 128, 768),
}


def exact_min_padding(sizes: list[int], world: int, budget: int = 200_000) -> int | None:
    """The least padding any assignment leaves (branch and bound over owners, largest first;
    None where the search would exceed `budget` nodes)."""
    order = sorted(sizes, reverse=True)
    total = sum(order)
    # the largest piece of owners.py's assignment: the search looks for a smaller one
    best_max = (padding(sizes, assign_owners(sizes, world), world) + total) // world
    nodes = 0

    def search(i: int, loads: list[int]) -> None:
        nonlocal best_max, nodes
        nodes += 1
        if nodes > budget:
            raise TimeoutError
        if i == len(order):
            best_max = min(best_max, max(loads))
            return
        seen = set()
        for r in range(world):
            if loads[r] in seen or loads[r] + order[i] >= best_max:
                continue  # equal loads are symmetric; a load past the best cannot win
            seen.add(loads[r])
            loads[r] += order[i]
            search(i + 1, loads)
            loads[r] -= order[i]

    floor = max(order[0], -(-total // world))
    try:
        if best_max > floor:
            search(0, [0] * world)
    except TimeoutError:
        return None
    return world * best_max - total


def rows(models: dict) -> list[dict]:
    out = []
    for name, block in models.items():
        for blocks in BLOCKS_PER_UNIT:
            sizes = block * blocks
            total = sum(sizes)
            for world in WORLDS:
                ours = padding(sizes, assign_owners(sizes, world), world)
                best = exact_min_padding(sizes, world)
                floor = max(0, world * max(sizes) - total)
                out.append(dict(model=name, blocks=blocks, world=world, matrices=len(sizes),
                                elements=total, padding=ours, exact=best, floor=floor))
    return out


def report(results: list[dict], cmd: str) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"
    table = [[r["model"], r["blocks"], r["world"], r["matrices"],
              pct(r["padding"] / r["elements"]),
              pct(None if r["exact"] is None else r["exact"] / r["elements"]),
              pct(r["floor"] / r["elements"])] for r in results]
    return "\n".join([
        "# Whole matrices per rank: all-gather padding", "",
        f"`{cmd}`", "",
        "Padding as a share of the unit's Muon matrices (what the all-gather carries beyond them). "
        "'-': the exact search stopped at its node budget.", "",
        markdown_table(["model", "blocks per unit", "world", "matrices", "owners.py",
                        "exact", "floor (largest matrix)"], table), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    results = rows(MODELS)
    text = report(results, command("benchmarks.planner.owner_padding"))
    write_results(args.out, "owner_padding", text, {"rows": results})
    print(text)


if __name__ == "__main__":
    main()
