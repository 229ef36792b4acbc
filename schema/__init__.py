"""The JSON Schema of buffers.yaml, shipped as package data (``buffers.schema.json``)."""
