"""What load_checkpoint reads into, and the checks of a checkpoint against the model.

Everything here is computed from DCP's metadata, which every rank has (rank 0 read and broadcast
it), so every rank reaches the same verdict: a mismatch raises everywhere, before any collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..runtime.placement import dtensor_params
from .checkpoint_files import CheckpointError
from .optim_state_dict import param_infos
from .sharded_tensor import flat_sharded_tensor, local_param_range


def param_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Every state-dict key of a sharded parameter (tied ones too) -> its unflattened shape."""
    infos = param_infos(model)
    return {name.replace("_checkpoint_wrapped_module.", ""): list(infos[id(p)].slot.shape)
            for name, p in model.named_parameters(remove_duplicate=False)}


def saved_entries(metadata, top: str) -> dict[tuple, object]:
    """Object path (below `top`) -> storage metadata, for everything saved under `top`."""
    out = {}
    for flat_key, path in metadata.planner_data.items():
        if path and path[0] == top:
            out[tuple(path[1:])] = metadata.state_dict_metadata[flat_key]
    return out


def check_model(model_sd: dict, saved: dict, manifest: dict, model: nn.Module) -> None:
    """Raise one error listing missing / unexpected keys and shape mismatches."""
    saved_keys = {path[0] for path in saved}
    missing = sorted(set(model_sd) - saved_keys)
    unexpected = sorted(saved_keys - set(model_sd))
    problems = []
    if missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {missing}")
    if unexpected:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): {unexpected}")
    saved_shapes = manifest["param_shapes"]
    for key, shape in param_shapes(model).items():
        if key in saved_shapes and saved_shapes[key] != shape:
            problems.append(f"size mismatch for {key}: the checkpoint has shape "
                            f"{saved_shapes[key]}, the model has {shape}")
    for key, value in model_sd.items():
        md = saved.get((key,))
        if key not in saved_shapes and isinstance(value, torch.Tensor) and isinstance(
                md, TensorStorageMetadata) and list(md.size) != list(value.shape):
            problems.append(f"size mismatch for {key}: the checkpoint has shape "
                            f"{list(md.size)}, the model has {list(value.shape)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(problems))


def set_path(root: dict, path: tuple, value) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (str keys) and lists (int keys)."""
    node = root
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
        child = node[key] if isinstance(node, list) else node.get(key)
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            node[key] = child
        node = child
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def optim_template(model: nn.Module, saved: dict) -> dict:
    """A name-keyed sharded optimizer state dict for this rank's layout, to read into.

    Built from the checkpoint's metadata, so it works for an optimizer that has not stepped yet:
    a state tensor saved in the parameter's shape becomes a DTensor of this rank's rows (DTensor
    parameters), one saved with the flattened parameter's size a ShardedTensor over this rank's
    range (FSDP1's flat views); anything else (step, hyperparameters) a placeholder DCP replaces.
    """
    infos = {info.name: info for info in param_infos(model).values()}
    template: dict = {}
    unknown = sorted({p[1] for p in saved if p[0] == "state" and p[1] not in infos})
    if unknown:
        raise CheckpointError(f"the checkpoint has optimizer state for parameters the model does "
                              f"not have: {unknown}")
    distributed = dist.is_available() and dist.is_initialized()
    for path, md in saved.items():
        value = None
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            info = infos.get(path[1]) if path[0] == "state" and len(path) == 3 else None
            sharded = info is not None and path[2] != "step"
            # A DTensor parameter's state is saved with the parameter's global shape: for a
            # tensor- or expert-parallel one the TP-global shape, not the slot's (TP-local) one.
            if (sharded and info.bucket.distributed
                    and list(md.size) == list(info.bucket.spec_of(info.index).shape)):
                # A DTensor parameter's state: DCP reads this rank's rows into the template.
                shape = info.bucket.layout.local_shape(info.index)
                value = dtensor_params.as_dtensor(
                    torch.empty(shape, dtype=dtype, device=info.bucket.shard.device),
                    info.bucket.spec_of(info.index))
            elif sharded and list(md.size) == [info.slot.numel]:
                start, end = local_param_range(info.bucket, info.index)
                local = torch.empty(end - start, dtype=dtype, device=info.bucket.shard.device)
                value = (flat_sharded_tensor(info.bucket, info.index, local, info.unit.groups.shard)
                         if distributed else local.view(info.slot.shape))
            else:
                value = torch.empty(md.size, dtype=dtype)
        set_path(template, path, value)
    return template
