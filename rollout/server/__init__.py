"""The HTTP server: FastAPI app (SGLang-native and OpenAI endpoints) and the `serve` CLI."""
