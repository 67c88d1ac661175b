"""Muon on sharded parameters: torch.optim.Muon's arguments and math (its momentum, Nesterov
update, Newton-Schulz iteration with its coefficients and steps, decoupled weight decay and
`adjust_lr_fn`), for the parameters fully_shard (fsdp_ext's or torch's) leaves sharded.

Newton-Schulz orthogonalises a whole matrix; a rank holds a part of it. Per parameter:

    plain tensor (a whole matrix here)   the update is computed here, as torch.optim.Muon does
    DTensor split along one mesh axis    the Nesterov update is made on the local shard; each
      (Shard(dim) there, Replicate on    matrix goes whole to one owner rank of that axis, is
      the others)                        orthogonalised there, and each rank gets its part back
                                         (to_owners.py: two all-to-alls per group and mesh, the
                                         owners balanced; DistMuon's traffic)
    DTensor split along several axes     gathered (bf16) along all axes but its widest plain
      (FSDP x TP)                        Shard one, then exchanged over that one as above
    DTensor whole here (Replicate only;  the update is computed from the local tensor: no
      an expert stack sharded along its  collective (fully_shard's default Shard(0) keeps whole
      expert dim only)                   experts on each rank)
    3-D expert stack [E, out, in]        each expert's matrix orthogonalised on its own (torch's
                                         Muon takes 2-D only; each slice is what it would do)
    `block_rows=R` (a group option)      a [M * R, C] matrix is M independent [R, C] matrices
                                         (one attention head each), as DistMuon's
                                         BlockShard(0, R) computes them; where every rank's
                                         Shard(0) rows are whole blocks (R divides the chunk),
                                         each rank steps its own blocks with no collective

The matrices orthogonalised on a rank go through newton_schulz.py: one at a time, torch's
iteration and bits (the default), or batched by shape under the group option `batch_same_shape`.

The momentum buffer lives like the parameter (a DTensor with its placements: DCP saves and
reshards it as it does the parameter). A split matrix crosses its shard group twice per step
(to its owner, and its parts back); placements that keep whole matrices or blocks on each rank
need no collective at all (docs/api.md, "Muon").

On the GPU path: no host sync (the exchanges are collectives the compute stream waits for; the
learning-rate adjustment is computed from shapes on the host; a tensor `lr` is read on the host
once per parameter group and step, as torch's Muon reads it).
"""
from __future__ import annotations

import functools
import itertools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
# torch's own learning-rate adjustment: the same math, bit for bit
# (tests/optim/test_muon.py fails if torch changes what they compute)
from torch.optim._muon import _adjust_lr

from .newton_schulz import orthogonalised
from .to_owners import exchange_layout, orthogonalised_parts, piece_of

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's arguments, defaults and checks, for matrices of any placement: 2-D
    parameters, and 3-D expert stacks orthogonalised per expert. A parameter of another number
    of dims, or a DTensor placed otherwise than by Shard/Replicate (and FSDP's _StridedShard
    beside a Shard), is refused naming it."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 block_rows: int | None = None, batch_same_shape: bool = False):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        for name, value in (("Learning rate", lr), ("momentum", momentum),
                            ("weight decay", weight_decay)):
            if not 0.0 <= value:
                raise ValueError(f"{name} should be >= 0 but is: {value}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported "
                             f"(one of {ADJUST_LR_FNS})")
        # the options torch's Muon has no name for: how each group is cut, kept beside the
        # groups (group_options) rather than in them, as its parameters' list is: a checkpoint
        # then holds what torch.optim.Muon's and DistMuon's hold, and loads into either and back
        # (DCP and torchtitan refuse a group key the checkpoint lacks); a loaded state dict
        # replaces the groups' hyperparameters, not how they are cut
        self._option_defaults = dict(block_rows=block_rows, batch_same_shape=batch_same_shape)
        self.group_options: list[dict] = []  # per param group: block_rows, batch_same_shape
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_coefficients=ns_coefficients,
                                      eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with `block_rows` and `batch_same_shape` taken out of the group into
        group_options (the constructor's values where the group gives none); each parameter is
        checked (and refused, naming it) here."""
        param_group = dict(param_group)
        options = {k: param_group.pop(k, v) for k, v in self._option_defaults.items()}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for index, param in enumerate(group["params"]):
            _check(param, _name(group, index), options["block_rows"])
        self.group_options.append(options)

    def __getstate__(self) -> dict:
        """torch's (pickle, copy.deepcopy) with the options beside the groups."""
        return {**super().__getstate__(), "group_options": self.group_options,
                "_option_defaults": self._option_defaults}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, options in zip(self.param_groups, self.group_options):
            group = {**group, **options}
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else lr  # (torch's _to_scalar)
            batch = group["batch_same_shape"]
            here = []  # (param, what is orthogonalised here, how its result is placed)
            split = []  # (param, its Nesterov update): orthogonalised on their owners
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        param.grad, memory_format=torch.preserve_format)
                update = _nesterov_update(param.grad, state["momentum_buffer"], group)
                if not isinstance(param, DTensor):
                    here.append((param, update, _as_is))
                elif _whole_here(param, group["block_rows"]):
                    here.append((param, update.to_local(), _as_placed))
                else:
                    split.append((param, update))
                if not batch:  # one at a time, as torch's Muon: one update alive at once
                    _step_here(here, group, lr)
                    here = []
            _step_here(here, group, lr)
            parts = orthogonalised_parts([u for _, u in split],
                                         lambda wholes: orthogonalised(wholes, group))
            for (param, _), part in zip(split, parts):
                _apply(param, _as_placed(part, param), group, lr)
        return loss


def _step_here(here, group, lr) -> None:
    """Steps the parameters whose matrices are orthogonalised on this rank (batched by shape
    under `batch_same_shape`)."""
    results = orthogonalised([tensor for _, tensor, _ in here], group)
    for (param, _, place), ortho in zip(here, results):
        _apply(param, place(ortho, param), group, lr)


def _nesterov_update(grad, buf, group):
    """torch's _single_tensor_muon up to Newton-Schulz: the momentum step and the update."""
    buf.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


def _apply(param, ortho, group, lr: float) -> None:
    """Decoupled weight decay and the orthogonalised step, with torch's lr adjustment for the
    shape of one matrix (one block under `block_rows`)."""
    rows = group["block_rows"]
    shape = (rows, param.shape[-1]) if rows else param.shape[-2:]
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))


def _whole_here(param: DTensor, rows: int | None) -> bool:
    """Whether every rank's part of `param` is whole matrices (the same answer on every rank, as
    the collective it spares must be): replicated, an expert stack split along its expert dim
    (dim 0) only, or blocks of `rows` rows split along dim 0 where every rank's first row and
    row count are multiples of `rows`."""
    return _whole_everywhere(tuple(param.shape), tuple(param.device_mesh.shape),
                             tuple(param.placements), rows)


@functools.lru_cache(maxsize=1024)
def _whole_everywhere(shape, mesh_shape, placements, rows) -> bool:
    """_whole_here from shapes alone (worked out once per kind of parameter, not every step)."""
    dims = {p.dim for p in placements if not isinstance(p, Replicate)}
    if not dims or (len(shape) == 3 and dims == {0}):
        return True
    if not rows or dims != {0} or any(type(p) not in (Shard, Replicate) for p in placements):
        return False
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        (count, *_), (first, *_) = piece_of(shape, mesh_shape, coordinate, placements)
        if count % rows or first % rows:
            return False
    return True


def _as_is(ortho: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    return ortho


def _as_placed(local: torch.Tensor, param: DTensor) -> DTensor:
    return DTensor.from_local(local.to(param.dtype), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())


def _name(group, index: int) -> str:
    names = group.get("param_names")
    return f"parameter '{names[index]}'" if names else f"parameter {index} of its group"


def _check(param, where: str, rows: int | None) -> None:
    if rows is not None and (param.ndim != 2 or rows <= 0 or param.shape[0] % rows):
        raise ValueError(f"Muon: {where} has shape {list(param.shape)}, which block_rows={rows} "
                         "does not cut into whole blocks (a 2-D matrix whose rows it divides)")
    if param.ndim not in (2, 3):
        raise ValueError(f"Muon: {where} has shape {list(param.shape)}; Muon orthogonalises "
                         "matrices (2-D) and expert stacks (3-D, one matrix per expert): give "
                         "embeddings, norms, biases and other parameters to AdamW")
    if isinstance(param, DTensor):
        placements, mesh_shape = tuple(param.placements), tuple(param.device_mesh.shape)
        odd = [p for p in placements if type(p) not in (Shard, Replicate, _StridedShard)]
        if odd or not (_whole_everywhere(tuple(param.shape), mesh_shape, placements, rows)
                       or exchange_layout(placements, mesh_shape)):
            raise NotImplementedError(
                f"Muon: {where} is a DTensor placed {param.placements} on "
                f"{param.device_mesh}; Muon gathers and splits Shard(dim) and Replicate "
                f"placements (and FSDP's _StridedShard beside a Shard(dim)), not these")
