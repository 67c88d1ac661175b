"""Optimizers that need more of a parameter than a rank's shard holds.

Owns: `Muon` (muon.py): torch.optim.Muon's arguments and math for parameters of any placement a
sharded model gives them (plain tensors, DTensors on data-parallel meshes, expert stacks, blocks
of rows), each matrix orthogonalised whole; newton_schulz.py, the iteration over every matrix a
rank orthogonalises in a step (one at a time as torch's Muon, or batched by shape); to_owners.py,
the split matrices' exchange: each to one owner rank (balanced) and its parts back.

May import: runtime (what a parameter's DTensor placement means), torch.
"""
from .muon import Muon

__all__ = ["Muon"]
