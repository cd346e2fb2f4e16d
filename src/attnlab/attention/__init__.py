"""Attention variants. Importing this package registers every variant in `ATTENTION`."""

from attnlab.attention import full, local, nsa, routing, sinkhorn  # noqa: F401
