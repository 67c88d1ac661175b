"""The options a root's schedule reads, as one typed record.

Every unit holds one `ScheduleOptions` from its construction (fully_shard's and
FullyShardedDataParallel's arguments). The unit that becomes the root at the first forward hands
its own record to the schedule, which reads it from then on: a setter called on the root before the
first forward (`set_is_last_backward`, `set_prefetch_depth`, ...) writes the record the schedule
will read, and one called after writes the record it reads now. This mirrors torch's FSDP2, whose
root shares its state context with every module at lazy initialisation: a value set on the root
before it is kept, one set on another module then is not (api/fsdp_module.py: _schedule_options
says where a setter writes).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScheduleOptions:
    forward_prefetch: int = 1           # units whose all-gather is issued ahead in forward
    backward_prefetch: int = 1          # ... in backward
    backward_prefetch_at: str = "pre"   # "pre": before the unit's backward compute; "post": after it
    limit_in_flight: bool = True        # bound transient unsharded units by max(depth) + 1
    max_pending_reduce_scatters: int = 1  # each pending one holds a unit-sized packed gradient buffer
    collective_timeout: float | None = None  # comm.collective_timeout's argument
    comm_ctx: dict | None = None        # share_comm_ctx: roots that share their streams
    is_last_backward: bool = True       # False: the backward's end leaves its reductions pending

    def update(self, **values) -> None:
        """A setter's change (api/fsdp_module.py: _schedule_options says which record)."""
        for name, value in values.items():
            if name not in self.__dataclass_fields__:
                raise AttributeError(f"ScheduleOptions has no option {name!r}")
            setattr(self, name, value)
