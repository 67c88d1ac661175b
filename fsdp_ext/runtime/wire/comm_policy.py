"""CommPolicy: fewer bytes on the wire, opt-in (ZeRO++'s qwZ and qgZ classes).

    param_gather  None | "int8" | "fp8": each rank quantizes its shard block-wise (symmetric, one
                  fp32 scale per block) straight into its slot of the all-gather; every rank
                  dequantizes every slot, its own included, into the parameters' dtype. The
                  sharded (master) parameters stay exact: only the gathered copy is lossy.
    grad_reduce   None | "int8" | "bf16": "int8" replaces the reduce-scatter by an all-to-all of
                  block-quantized chunks; each rank dequantizes and sums what it receives in fp32,
                  so each contribution is quantized once whatever the world size. "bf16" reduces
                  in bf16 on the wire (the sum in bf16, as reduce_dtype=bf16 would).
    block_size    values per scale (a multiple of 8).

Default off: exact results stay exact. A unit without a policy of its own takes its root's
(fully_shard is applied bottom-up, so children are resolved when the root first runs forward);
the policy a unit runs with is checked against that unit's mixed precision wherever it comes
from (`policy_in_effect`), as fully_shard checks a policy given to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PARAM_GATHER = (None, "int8", "fp8")
GRAD_REDUCE = (None, "int8", "bf16")


@dataclass(frozen=True)
class CommPolicy:
    param_gather: str | None = None
    grad_reduce: str | None = None
    block_size: int = 256

    def __post_init__(self):
        if self.param_gather not in PARAM_GATHER:
            raise ValueError(f"CommPolicy(param_gather={self.param_gather!r}): choose one of "
                             f"{PARAM_GATHER}")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"CommPolicy(grad_reduce={self.grad_reduce!r}): choose one of "
                             f"{GRAD_REDUCE}")
        if (not isinstance(self.block_size, int) or isinstance(self.block_size, bool)
                or self.block_size < 8 or self.block_size % 8 or self.block_size > 1 << 20):
            raise ValueError(f"CommPolicy(block_size={self.block_size!r}): a multiple of 8 "
                             "between 8 and 1048576 (values per scale)")

    @property
    def active(self) -> bool:
        return self.param_gather is not None or self.grad_reduce is not None

    def describe(self) -> str:
        if not self.active:
            return "exact"
        return (f"param_gather={self.param_gather}, grad_reduce={self.grad_reduce}, "
                f"block_size={self.block_size}")


def check_policy(policy: CommPolicy | None, mp, where: str) -> CommPolicy | None:
    """The policy given to fully_shard / FullyShardedDataParallel, checked against the mixed
    precision it will run with (raises naming the option)."""
    if policy is None:
        return None
    if not isinstance(policy, CommPolicy):
        raise TypeError(f"{where}: comm_policy must be an fsdp_ext.CommPolicy, got {policy!r}")
    if policy.grad_reduce == "int8" and mp.reduce_dtype == torch.float16:
        raise ValueError(
            f"{where}: CommPolicy(grad_reduce='int8') with reduce_dtype=torch.float16: the "
            "dequantized sum of every rank's block can exceed float16's range (65504); use "
            "reduce_dtype=torch.float32 or torch.bfloat16")
    if policy.grad_reduce == "bf16" and mp.reduce_dtype == torch.float16:
        raise ValueError(f"{where}: CommPolicy(grad_reduce='bf16') contradicts "
                         "reduce_dtype=torch.float16: choose one reduction dtype")
    return policy


def policy_in_effect(own: CommPolicy | None, root: CommPolicy | None, mp,
                     unit: str) -> CommPolicy | None:
    """The active policy a unit runs with (its own, else its root's), or None for exact
    collectives; checked against the unit's mixed precision `mp` (check_policy), since a root's
    policy meets each child's reduce_dtype only here.

    Args:
        own: the unit's comm_policy (given to its fully_shard), or None.
        root: its root's comm_policy, or None.
        mp: the unit's MixedPrecisionPolicy.
        unit: the unit as an error names it ("fully_shard(Block) 'blocks.0'").
    """
    inherited = own is None
    policy = root if inherited else own
    where = (f"{unit}, which inherits its root's comm_policy (give it comm_policy=CommPolicy() "
             "to keep its collectives exact)") if inherited else unit
    check_policy(policy, mp, where)
    return policy if policy is not None and policy.active else None
