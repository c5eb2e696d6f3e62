"""The UNet benchmarks' parts: scope block, the break-even per token count, the engine's own work, the diffusers
path, and whole sampling runs of reuse across steps."""
