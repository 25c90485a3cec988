"""What one forward pass needs, below both the engine and the models: the forward batch, the KV
pool, the attention interface and its backends, and the tagged device-memory regions."""
