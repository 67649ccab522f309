"""Test-only plugins: the in-process numpy backend and broken plugins for error tests."""
