"""The output JSONL of a CLI run: durable while requests finish, final and atomic at the end.

- Each request's line is appended to `OUT.partial` and flushed the moment the request finishes
  (completion order), so a killed or interrupted run keeps every finished request.
- `finish()` writes `OUT` in input order through a temp file and a rename: a reader never sees a
  half-written output file, and a full disk leaves the previous `OUT` (if any) intact.
- Every OS error names the file it happened on.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.outputs import RequestOutput
from neuron_async_sm.serve.detokenizer import IncrementalText
from neuron_async_sm.serve.tokenizer import ServedTokenizer


class ResultsWriteError(NeuronAsyncSMError, OSError):
    """Writing the output failed; the message names the file."""

    def __str__(self) -> str:
        # OSError's own form is "[Errno 2] cannot write ...": the user reads the message alone.
        return self.strerror or super().__str__()


class ResultsFile:
    """One line per request: appended as requests finish, rewritten in input order at the end."""

    def __init__(
        self, path: str | os.PathLike[str], request_ids: Sequence[str], tokenizer: ServedTokenizer | None = None
    ):
        """Check the output is writable before any compute: creates the parent directory and the
        partial file. Raises ResultsWriteError naming the path otherwise."""
        self.path = Path(path)
        self.partial_path = self.path.with_name(self.path.name + ".partial")
        self._order = list(request_ids)
        self._tokenizer = tokenizer
        self._lines: dict[str, str] = {}
        if self.path.is_dir():
            raise ResultsWriteError(f"cannot write {self.path}: it is a directory")
        self._partial: IO[str] | None = None
        with _naming(self.path.parent):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with _naming(self.partial_path):
            self._partial = open(self.partial_path, "w", encoding="utf-8")  # noqa: SIM115 (closed in finish)

    def add(self, output: RequestOutput) -> None:
        """Record a finished request and make its line durable at once."""
        line = json.dumps(self._to_json(output))
        self._lines[output.request_id] = line
        assert self._partial is not None, "add() after finish()"
        with _naming(self.partial_path):
            self._partial.write(line + "\n")
            self._partial.flush()

    def unfinished(self) -> list[str]:
        return [r for r in self._order if r not in self._lines]

    def finish(self, unfinished_reason: str | None = None) -> None:
        """Write the final file in input order (temp file + rename) and drop the partial file.

        A request without a line gets an "abort" line carrying `unfinished_reason`."""
        for request_id in self.unfinished():
            self._lines[request_id] = json.dumps(
                self._to_json(RequestOutput(request_id, [], [], True, "abort", unfinished_reason))
            )
        with _naming(self.path):
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.writelines(self._lines[r] + "\n" for r in self._order)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        self.close(remove_partial=True)

    def close(self, *, remove_partial: bool = False) -> None:
        """Close the partial file; keep it (a run that could not finish) unless told otherwise."""
        if self._partial is not None:
            self._partial.close()
            self._partial = None
        if remove_partial:
            self.partial_path.unlink(missing_ok=True)

    def _to_json(self, output: RequestOutput) -> dict:
        line = output.to_json()
        if self._tokenizer is not None:  # decoded after the prompt, as vLLM's LLM writes an output's text
            text = IncrementalText(self._tokenizer, (), prompt_ids=output.prompt_token_ids)
            line["text"] = text.push(output.output_token_ids, output.finish_reason or "length")
        return line


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Re-raise an OSError as ResultsWriteError whose message names `path`."""
    try:
        yield
    except ResultsWriteError:
        raise
    except OSError as exc:
        raise ResultsWriteError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc
