"""Anthropic-compatible endpoints (`/v1/messages`, `/v1/messages/count_tokens`): protocol types and routes."""
