"""The UNet benchmarks' parts: the full run's rows, scope block, the break-even per token count, the engine's own
work, the diffusers path, and whole sampling runs of reuse across steps."""
