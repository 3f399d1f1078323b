"""The package version, in a module of its own so that any part of ckptsup can read it without
importing the package's `__init__` (which reaches the hooks lazily)."""

__version__ = "0.1.0"
