"""What a unit checks for its user: parameters replaced or re-pointed since fully_shard, parameters
left on the meta device, and a submodule called while its parameters are sharded. Each raises
before any collective, naming the parameter or module and its unit."""
from __future__ import annotations

from ..placement import dtensor_params
from .states import Installed


def check_params_unchanged(unit) -> None:
    """Raise if a sharded parameter was replaced since fully_shard.

    The runtime points the module attributes at its own views in every forward, so an assigned
    new Parameter (or a `.data` swapped for a tensor of another shape) would be silently dropped,
    and the optimizer would keep updating a shard the model no longer reads. The check costs two
    identity/pointer comparisons per parameter.
    """
    if unit.params.installed is not Installed.SHARDED:  # gathered on purpose: not shards
        return
    for bucket in unit.buckets:
        for slot, view in zip(bucket.slots, bucket.shard_views):
            name = unit.param_name(slot)
            for module, attr in slot.locations:
                if module._parameters.get(attr) is not slot.param:
                    raise RuntimeError(
                        f"parameter '{name}' ({type(module).__name__}.{attr}) was replaced after "
                        "fully_shard: the sharded parameter is no longer the module's attribute. "
                        "Change parameters in place (torch.no_grad() + copy_) or via "
                        "load_state_dict, or make the change before fully_shard")
            local = dtensor_params.local_of(slot.param)
            replaced = local is not slot.param and dtensor_params.data_was_replaced(slot.param)
            moved = bucket.wire.local_moved(local, view)
            if replaced or moved:
                local = slot.param.data if replaced else local
                raise RuntimeError(
                    f"parameter '{name}' had its .data replaced after fully_shard (now shape "
                    f"{list(local.shape)}; this rank's shard is {list(view.shape)} of the "
                    f"original {list(slot.shape)}): it no longer views the sharded storage. "
                    "Copy new values in place, or make the change before fully_shard")


def check_materialized(unit) -> None:
    """Raise if parameters are still on the meta device (built under torch.device("meta"),
    sharded, and never given storage)."""
    for bucket in unit.buckets:
        if bucket.on_meta():
            raise RuntimeError(
                f"unit '{unit.name or '<root>'}' ({unit.type_name}) still has its "
                f"parameters (e.g. '{bucket.slots[0].fqn}') on the meta device: call "
                "model.to_empty(device=...) and initialise them (e.g. reset_parameters()) "
                "before the first forward, as with torch's fully_shard")


def check_params_gathered(unit, module) -> None:
    """A forward pre-hook on the submodules holding `unit`'s parameters: raise when one is called
    while they are sharded (outside the unit's forward), instead of a shape error deep in torch."""
    if unit.params.installed is not Installed.SHARDED:
        return
    owned = [(prefix, n) for prefix, member in zip(unit.member_names, unit.members)
             for n, m in member.named_modules() if m is module]
    prefix, owned = owned[0] if owned else ("", "")
    name = f"'{prefix}.{owned}'" if prefix and owned else (
        f"'{owned}'" if owned else "a submodule")
    raise RuntimeError(
        f"{type(module).__name__} {name} was called while its parameters are sharded: they "
        f"belong to the unit of {unit.type_name} ('{unit.name or '<root>'}'), "
        "whose forward is not running. A module outside forward() (e.g. the encoder that "
        "generate() calls) needs the method that calls it registered: "
        "fsdp_ext.register_fsdp_forward_method(model, 'generate') (FullyShardedDataParallel: "
        "or call it inside FullyShardedDataParallel.summon_full_params(model, recurse=False)); "
        "a container whose own forward never runs (ModuleList, ModuleDict) cannot be a unit: "
        "shard its children")
