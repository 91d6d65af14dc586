"""OpenAI-compatible endpoints: protocol types and one module per route."""
