"""One package per host (comfyui, webui, diffusers) plus ``shared``; the engine never imports them, and no host
imports another. See docs/how-it-works.md, section 'Development: where each part lives'.
"""
