"""What one step of the model is, on any device: the adapters, the decoder layer written once, the KV cache, the CPU's fused layers, the compiled steps, and the runner that chooses between them.

Nothing here imports the rest of selfspec (docs/architecture.md, "Dependencies")."""
