"""Helpers the tests share (issue 32: one copy, not one per file).

Piped output is laid out at PIPE_WIDTH columns: prose wraps between words, and a word longer than the
line (a path under a long TMPDIR) is folded anywhere. A test that matches a message must not depend
on where those breaks fall, so it matches with `said`, which ignores all whitespace on both sides.
"""

from __future__ import annotations


def flat(text: str) -> str:
    """``text`` with every run of whitespace removed: what stays the same however it was wrapped."""
    return "".join(text.split())


def said(words: str, output: str) -> bool:
    """``words`` appear in ``output``, whatever the console's line wrapping or folding."""
    return flat(words) in flat(output)


def wait_for(pred, what: str, timeout: float = 60.0, poll: float = 0.1):
    """``pred()``'s first truthy value, polled until ``timeout`` seconds (load never decides a test:
    the limit is generous), else an AssertionError naming ``what`` was awaited."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def bind_unix(sock, path) -> None:
    """Bind an AF_UNIX socket at ``path`` whatever its length: the kernel takes 107 bytes, and a long
    TMPDIR (scripts/ci_stress.sh) is longer. Bound by its name from its folder, the cwd put back."""
    import os

    here = os.getcwd()
    os.chdir(path.parent)
    try:
        sock.bind(path.name)
    finally:
        os.chdir(here)
