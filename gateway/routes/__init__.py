"""Thin HTTP routers; the work happens in gateway.pipeline and gateway.streaming."""
