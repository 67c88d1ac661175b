"""Where each parameter of a unit is placed: along which dim of the tensor it holds here, over which
mesh, and what model parallelism did to it first. One object per parameter (`ParamSlot.placement`)
answers every question the runtime, the state paths and the diagnostics ask about it; nothing
outside this folder asks which kind it is (tests/project/test_layering.py checks).

Owns: base.py, the protocol and the plain parameter (`Placement`: its shard dim, its own mesh
and that mesh's groups, its DTensor face, what the module computes with, its full tensor); model_parallel.py, the
parameters that tensor or expert parallelism split before fully_shard (a DTensor on its own TP /
EP mesh, an annotated plain tensor, a DTensor on the whole storage mesh); spmd_params.py, a plain
tensor's spmd_types annotations on the storage mesh `dp_mesh_dims` names; choose.py, the
placement a parameter's own spelling gives it; replicated.py, a parameter whole on every rank of
a mesh (`replicate`); shard_fn.py, fully_shard's `shard_placement_fn`
(Shard(dim), torch's ShardPlacementResult, fsdp_ext's MeshPlacement) applied to it;
dtensor_params.py, the DTensor parameters of fully_shard (made, read and re-pointed); owners.py,
which rank owns which whole matrix where a placement keeps matrices whole (balanced pieces).

May import: runtime/comm, runtime/core, torch.
"""
