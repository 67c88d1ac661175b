"""The kernels (fsdp_ext/ops, csrc/): every backend against the plain-torch reference, bit for bit,
the CUDA sources compiled and their bodies run on the host."""
