"""The AUTOMATIC1111 WebUI and Forge: the ldm/sgm block patch, the script's arguments and controls, reuse wiring."""
