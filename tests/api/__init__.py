"""The public API (fsdp_ext/api) against torch's: FSDP1's and FSDP2's surfaces, replicate,
interop, bad input, compile, pipelining, dp_mesh_dims, expert parallelism."""
