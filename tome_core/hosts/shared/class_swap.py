"""Undoing a block class swap: shared by the adapters that patch blocks by giving them a subclass of ours."""

from __future__ import annotations


def restore_classes(root, state_key: str, parent_key: str) -> None:
    """Give every module under ``root`` back the class it had before ours and drop its ``state_key`` state.
    A tomesd class wrapping ours gets its ``_parent`` pointed past ours, so tomesd's own removal still works."""
    root.__dict__.pop(state_key, None)
    for module in root.modules():
        module.__dict__.pop(state_key, None)
        cls = type(module)
        if parent_key in cls.__dict__:
            module.__class__ = getattr(cls, parent_key)
            continue
        parent = cls.__dict__.get("_parent")
        if isinstance(parent, type) and parent_key in parent.__dict__:
            cls._parent = getattr(parent, parent_key)
