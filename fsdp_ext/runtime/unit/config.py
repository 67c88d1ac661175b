"""What a unit is built with. `UnitOptions`: the user's arguments to fully_shard /
FullyShardedDataParallel / replicate as the API read them (api/options.py reads torch's option
objects). `UnitConfig`: those options resolved once, in api/fully_shard.shard_module, with the
unit's process groups and the environment (fsdp_ext/env.py) read for the call; both frozen and
built in one step. A unit keeps its UnitConfig for its life; what torch lets a user change later (the
FSDPModule setters) lives in the unit's own fields, initialised from it, and in the root's
ScheduleOptions (schedule_options.py), which this record hands over as built.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..comm.collectives import Groups
from ..wire.comm_policy import CommPolicy
from ...env import Environment
from ..core.mixed_precision import MixedPrecisionPolicy
from ..core.offload import CPUOffloadPolicy
from .schedule_options import ScheduleOptions


@dataclass(frozen=True, kw_only=True)
class UnitOptions:
    mp: MixedPrecisionPolicy
    layout: str = "rows"                  # "rows": fully_shard's DTensors; "flat": FSDP1's views
    # as given (an int k: reshard to k ranks); in UnitConfig a bool, None: True unless it
    # becomes the root
    reshard_after_forward: bool | int | None = None
    offload: CPUOffloadPolicy | None = None
    comm_policy: CommPolicy | None = None  # its own; None: its root's (at the first forward)
    param_init_fn: object = None          # materialises meta modules at construction
    shard_placement_fn: object = None     # param -> its placement (placement/shard_fn.py)
    # dp_mesh_dims: (the storage mesh, its shard and replicate axis names), whose DTensor
    # parameters are sharded over those axes (placement/model_parallel.OnStorageMesh)
    storage_axes: tuple | None = None
    ignored_params: frozenset = frozenset()  # ids of parameters never sharded
    check_finite_grads: bool | None = False  # None: as the environment says
    direct_min_numel: int | None = None   # rows layout: None for the default split (layout.py)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)  # handed to its schedule


@dataclass(frozen=True, kw_only=True)
class UnitConfig(UnitOptions):
    groups: Groups                        # who it shards and replicates over (comm.Groups)
    env: Environment = field(default_factory=Environment)  # read for its call
    mesh: object = None                   # fully_shard's DeviceMesh (None: one made from groups)
