"""Training glue between the entry point and megatron.training: module backend, throughput and
FLOPs logging, the pipeline layout, and the launcher."""
