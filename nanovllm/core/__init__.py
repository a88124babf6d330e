"""The metadata floor that the engine and the host tier both stand on: sequences, block pools and block hashing.
Plain Python (no torch); it imports nothing from nanovllm.engine or nanovllm_offload."""
