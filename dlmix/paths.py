"""Checks of where a command will write, made before it does its work (a plan's search, a benchmark's requests, a
model's conversion), so that an unusable output path is refused at once with the reason instead of failing in a
traceback at the end."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

__all__ = ["folder_problem", "file_problem"]

PathLike = Union[str, "os.PathLike[str]"]


def folder_problem(path: PathLike) -> Optional[str]:
    """Why ``path`` cannot be used as a folder to write files into (created with its parents when missing), else
    None. The reason names the part of the path that stands in the way: ``"X exists and is not a folder"`` (``path``
    itself or one of its parents is a file) or ``"X is not writable"`` (the nearest existing folder). Creates
    nothing; never raises."""
    if "\0" in str(path):
        return f"{path!r} cannot be used: it contains a NUL character"
    try:
        p = Path(path).expanduser().absolute()
        while not p.exists() and p.parent != p:
            if p.is_symlink():  # a dangling link: creating the folder would fail on it
                return f"{p} is a link to a missing target"
            p = p.parent
        if not p.is_dir():
            return f"{p} exists and is not a folder"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{p} is not writable"
    except (OSError, ValueError) as e:  # e.g. a name too long
        return f"{path} cannot be used: {e}"
    return None


def file_problem(path: PathLike) -> Optional[str]:
    """Why a file cannot be written at ``path`` (its folder created when missing), else None: ``path`` is a folder,
    or :func:`folder_problem` of its parent. Creates nothing; never raises."""
    if "\0" in str(path):
        return f"{path!r} cannot be used: it contains a NUL character"
    try:
        p = Path(path).expanduser()
        if p.is_dir():
            return f"{p} is a folder"
        if p.exists() and not os.access(p, os.W_OK):
            return f"{p} is not writable"
    except (OSError, ValueError) as e:
        return f"{path} cannot be used: {e}"
    return folder_problem(p.absolute().parent)
