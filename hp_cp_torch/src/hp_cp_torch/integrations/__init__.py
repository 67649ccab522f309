"""Integrations with model libraries (loaded only when the library is installed)."""
