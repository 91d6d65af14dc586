"""Parsers of model output: tool calls (`hermes`), and the lenient JSON their bodies need (`tool_json`)."""
