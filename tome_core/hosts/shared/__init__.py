"""Shared by several hosts: the UNet layout, undoing a class swap, the ModelPatcher hooks (ComfyUI, Forge)."""
