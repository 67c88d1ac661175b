"""The checkout itself: the layering and file maps, the docs and their commands, the slow tier's
budget, the install's progress lines, the benchmarks' smokes."""
