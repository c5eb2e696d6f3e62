"""The hosts the tests run: a real ComfyUI in-process (``comfy_host``) and as a server (``comfy_server``), the
WebUI's call order around its real ``ldm`` UNet (``webui_host``) and its gradio page (``webui_page``, run in
``.venv-webui``), diffusers pipelines assembled offline (``diffusers_host``), and the headless browser
(``browser``)."""
