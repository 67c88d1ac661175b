"""How much of the all-gather time fsdp_ext hides behind compute, beside FSDP2 (bench_overlap)."""
