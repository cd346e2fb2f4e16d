"""Attention variants. Importing this package registers every variant in `ATTENTION`."""

from attnlab.attention import full, local  # noqa: F401
