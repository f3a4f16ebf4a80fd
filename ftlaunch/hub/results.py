"""The values a download returns and checks against."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DownloadResult:
    repo_id: str
    path: str  # the snapshot folder, usable as model_name_or_path
    endpoint: str
    revision: str | None  # as requested (None: the default branch)
    files: int
    bytes: int
    retries: int  # whole-attempt retries made by download()
    commit: str | None = None  # the commit actually downloaded
    resumes: int = 0  # broken transfers continued in place with a Range request
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ExpectedFile = tuple[str, int | None, str | None]  # (rfilename, size, sha256 for LFS files)
