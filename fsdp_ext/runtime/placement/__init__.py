"""Where each parameter of a unit is placed: along which dim of the tensor it holds here, over which
mesh, and what model parallelism did to it first.

Files: shard_fn.py reads fully_shard's `shard_placement_fn` (Shard(dim), torch's
ShardPlacementResult, fsdp_ext's MeshPlacement); model_parallel.py holds the parameters that
tensor or expert parallelism split before fully_shard (a DTensor on its own TP / EP mesh, an
annotated plain tensor, a DTensor on the whole storage mesh); spmd_params.py reads a plain
tensor's spmd_types annotations on the storage mesh `dp_mesh_dims` names.

May import: runtime modules below the unit (dtensor_params, comm), ops.
"""
