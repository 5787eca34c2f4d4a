"""Resumable streams: the live event logs and their checkpoints (the API's façade)."""

from services.streams.hub import LiveStream, StreamHub, StreamStatus

__all__ = ["LiveStream", "StreamHub", "StreamStatus"]
