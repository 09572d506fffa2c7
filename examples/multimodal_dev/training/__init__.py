"""Engine glue between the entry point and megatron.training: module backend, throughput and
FLOPs logging, settings refused before launch, and the launcher (with its warm engine). The
layout planner and the pipeline splits live in ``planner/``, the vision tower's own layout and
ranks in ``vision_ranks/``."""
