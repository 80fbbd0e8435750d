"""Lines from a byte stream read in chunks, in time linear in the output's length.

Each chunk is decoded incrementally (a UTF-8 character split across two
reads stays whole) and only the new text is searched for line ends; the
unfinished line is kept as a list of pieces and joined once, when it ends.
Re-splitting the unfinished line with every chunk costs the square of its
length: a single 40 MB line without a line end took minutes that way.
"""

from __future__ import annotations

import codecs

from detctx._cli.curves import split_lines

__all__ = ["LineReader"]


class LineReader:
    """Split a stream fed in chunks at ``\\n``, ``\\r\\n`` and ``\\r``.

    ``feed(decode(b"loss 1\\r"))`` gives ``["loss 1"]``; then
    ``feed(decode(b"\\nloss 2"))`` gives ``[]`` (the ``\\r\\n`` was one line
    end) and ``finish()`` gives ``["loss 2"]``.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []
        self._after_cr = False

    def decode(self, chunk: bytes) -> str:
        """The text of ``chunk``; a character split across chunks comes out with the next."""
        return self._decoder.decode(chunk)

    def finish(self) -> list[str]:
        """The last, unterminated line (if any) once the stream has ended."""
        lines = self.feed(self._decoder.decode(b"", final=True))
        if self._pieces:
            lines.append("".join(self._pieces))
            self._pieces = []
        return lines

    def feed(self, text: str) -> list[str]:
        """The lines that ``text`` (from :meth:`decode`) completes."""
        if not text:
            return []
        if self._after_cr and text.startswith("\n"):
            text = text[1:]  # the \n of a \r\n split across two chunks
        self._after_cr = text.endswith("\r")
        if not text:
            return []
        parts = split_lines(text)
        if len(parts) == 1:
            self._pieces.append(parts[0])
            return []
        lines = ["".join([*self._pieces, parts[0]]), *parts[1:-1]]
        self._pieces = [parts[-1]] if parts[-1] else []
        return lines
