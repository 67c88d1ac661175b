"""The runtime (fsdp_ext/runtime): units and their states, collectives, tags, placements, wire
formats, the block cache, the trace, the gradient path."""
