"""The planner (fsdp_ext/planner): its memory and time model against measured runs."""
