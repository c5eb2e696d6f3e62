"""Undoing a block class swap: shared by the adapters that patch blocks by giving them a subclass of ours."""

from __future__ import annotations


def restore_classes(root, state_key: str, parent_key: str) -> None:
    """Give every module under ``root`` back the class it had before ours (our subclasses name it in
    ``parent_key``) and drop the per-module state stored under ``state_key``.

    tomesd (also the WebUI's built-in token merging) wraps whatever class a block has, one new class per block,
    and remembers it in ``_parent`` for its own removal. If that was ours, point it past ours, so that tomesd's
    removal later restores the original class and tomesd keeps working until then.
    """
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
