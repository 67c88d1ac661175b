"""Optimizers that need more of a parameter than a rank's shard holds.

Owns: `Muon` (muon.py): torch.optim.Muon's arguments and math for parameters of any placement a
sharded model gives them (plain tensors, DTensors on data-parallel meshes, expert stacks), each
matrix orthogonalised whole.

May import: runtime (what a parameter's DTensor placement means), torch.
"""
from .muon import Muon

__all__ = ["Muon"]
