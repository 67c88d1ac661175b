"""The diagnostics (fsdp_ext/diagnostics): describe, the stream-order model with its scenarios, the
GPU projection."""
