"""fsdp_ext: a fully-sharded data-parallel runtime for PyTorch."""
from . import ops  # noqa: F401
