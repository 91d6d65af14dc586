"""Decoder definitions, one per family, written against the Backend interface."""
