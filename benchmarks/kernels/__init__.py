"""The copy/cast kernels (fsdp_ext.ops) against plain torch and a same-size copy_
(bench_kernels)."""
