"""The copy/cast kernels (fsdp_ext.ops) against plain torch and a same-size copy_
(bench_kernels); Muon's Newton-Schulz one matrix at a time against batched by shape
(newton_schulz)."""
