"""A small, strict Server-Sent Events reader over an aiohttp response: one `SseFrame` per
event (and per comment, such as a keep-alive, when asked), a timeout on every wait."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bridge.routes import SSE_CONTENT_TYPE


@dataclass
class SseFrame:
    """One dispatched event (or, with ``comments=True``, one comment line)."""

    event: str = "message"
    data: str = ""
    id: str | None = None
    comment: str | None = None

    def json(self) -> Any:
        # orjson reads as deep as the bridge writes (1,000+ levels; json stops short).
        return orjson.loads(self.data)


class SseReader:
    """Parse ``response``'s body as an event stream."""

    def __init__(self, response: aiohttp.ClientResponse, *, comments: bool = False) -> None:
        content_type = response.headers.get("Content-Type", "")
        if not content_type.startswith(SSE_CONTENT_TYPE):
            raise ValueError(f"not an event stream: Content-Type {content_type!r}")
        self._response = response
        self._comments = comments

    async def next(self, timeout: float = 10.0) -> SseFrame | None:
        """The next frame, ``None`` at the end of the stream; ``TimeoutError`` if quiet."""
        async with asyncio.timeout(timeout):
            return await self._next_frame()

    async def collect(self, count: int, timeout: float = 10.0) -> list[SseFrame]:
        """Exactly ``count`` frames (fewer only if the stream ends first)."""
        frames: list[SseFrame] = []
        async with asyncio.timeout(timeout):
            while len(frames) < count and (frame := await self._next_frame()) is not None:
                frames.append(frame)
        return frames

    async def until(self, predicate: Any, timeout: float = 10.0) -> list[SseFrame]:
        """Frames up to and including the first for which ``predicate(frame)`` holds."""
        frames: list[SseFrame] = []
        async with asyncio.timeout(timeout):
            while not frames or not predicate(frames[-1]):
                frame = await self._next_frame()
                if frame is None:
                    raise EOFError("the stream ended before the expected frame")
                frames.append(frame)
        return frames

    async def rest(self, timeout: float = 10.0) -> list[SseFrame]:
        """Every frame until the server ends the stream."""
        return await self.collect(sys.maxsize, timeout)

    async def _next_frame(self) -> SseFrame | None:
        frame = SseFrame()
        data_lines: list[str] = []
        has_field = False
        while True:
            raw = await self._response.content.readline()
            if not raw:
                return None
            line = raw.decode("utf-8").rstrip("\r\n")
            if line == "":
                if has_field:
                    frame.data = "\n".join(data_lines)
                    return frame
                continue
            if line.startswith(":"):
                if self._comments:
                    return SseFrame(comment=line[1:].strip())
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            has_field = True
            if name == "data":
                data_lines.append(value)
            elif name == "event":
                frame.event = value
            elif name == "id":
                frame.id = value
