"""Thin doors from the hosts' hook signatures into the engine. No host is imported here: the hosts' objects
are used by duck typing, so the same code serves ComfyUI, Forge and the WebUI's ldm/sgm UNets."""
