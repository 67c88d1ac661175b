"""fsdp_ext's benchmarks, one folder per question; run each from the top of the checkout as
`python -m benchmarks.<folder>.<script>` (docs/benchmarks.md lists them and their figures)."""
