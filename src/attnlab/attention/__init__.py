"""Attention variants. Importing this package registers every variant in `ATTENTION`."""

from attnlab.attention import full, local, routing, sinkhorn  # noqa: F401  # noqa: F401
