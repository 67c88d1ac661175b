"""The runtime: what happens to a unit in every training step (the FSDP timeline).

Its subpackages are its layers, each importing only those below it (tests/project/test_layering.py,
RUNTIME_LAYERS; docs/architecture.md draws them):

    unit/        units and their hooks, their named states, the schedule and prefetch
    bucket/      a unit's buckets: who owns their tensors, their layout, the gather, the gradient path
    wire/        what a bucket puts on the wire and how it comes back: exact, quantized, subclasses
    placement/   where each parameter is sharded, over which mesh, and its DTensor face
    comm/        collectives, process groups, the tags beside them and the peers' heartbeats
    core/        streams, the host's waits, offload and mixed precision, trace, errors

May import: ops (and the compiled `fsdp_ext._C`). Every other layer imports it.

Start from `Unit` in unit/unit.py (unshard -> use -> reshard -> post_backward) and `Schedule` in
unit/schedule.py (who is gathered when); core/registry.py says how a module finds its unit.
Owns: each subpackage's own docstring is its file map.
"""
