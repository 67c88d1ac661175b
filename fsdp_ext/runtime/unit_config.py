"""What a unit is built with: the user's arguments to fully_shard / FullyShardedDataParallel, read
once by the API (api/options.py reads torch's option objects) together with the environment
(fsdp_ext/env.py), frozen. A unit keeps it for its life; what torch lets a user change later (the
FSDPModule setters) lives in the unit's own fields, initialised from it, and in the root's
ScheduleOptions (schedule_options.py), which this record hands over as built.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .comm import Groups
from .comm_policy import CommPolicy
from ..env import Environment
from .mixed_precision import MixedPrecisionPolicy
from .offload import CPUOffloadPolicy
from .schedule_options import ScheduleOptions


@dataclass(frozen=True)
class UnitConfig:
    groups: Groups                        # who it shards and replicates over (comm.Groups)
    mp: MixedPrecisionPolicy
    env: Environment = field(default_factory=Environment)
    layout: str = "rows"                  # "rows": fully_shard's DTensors; "flat": FSDP1's views
    mesh: object = None                   # fully_shard's DeviceMesh (None: one made from groups)
    reshard_after_forward: bool | None = None  # None: True unless it becomes the root
    offload: CPUOffloadPolicy | None = None
    comm_policy: CommPolicy | None = None  # its own; None: its root's (at the first forward)
    param_init_fn: object = None          # materialises meta modules at construction
    shard_placement_fn: object = None     # param -> Shard(dim) | None (placements.py)
    # dp_mesh_dims: (the storage mesh, its shard and replicate axis names), whose DTensor
    # parameters are sharded over those axes (model_parallel.OnStorageMesh)
    storage_axes: tuple | None = None
    ignored_params: frozenset = frozenset()  # ids of parameters never sharded
    check_finite_grads: bool = False
    direct_min_numel: int | None = None   # rows layout: None for the default split (layout.py)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)  # handed to its schedule
