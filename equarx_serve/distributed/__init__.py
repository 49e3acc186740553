"""Processes joined by `jax.distributed` (gloo on CPU), their devices, and the emulated hosts
(network namespaces joined by tc-shaped links) the multi-process benchmarks and tests run on."""
