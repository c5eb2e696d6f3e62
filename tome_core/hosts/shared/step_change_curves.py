"""The real models' published step-to-step change: MagCache's calibrated ratios (one per step, the first 1.0).

Each ratio is the mean over image tokens of the norm of the blocks' residual (the last block's output minus the
first block's input) divided by the step before's. Where the calibration interleaves the conditional and the
unconditional call, the conditional call's are kept. The sources (MagCache's repository and its ComfyUI node,
Zehong-Ma/MagCache and Zehong-Ma/ComfyUI-MagCache) are named per curve; the thresholds beside them are the ones
its authors publish for the same model. What each family does with them: ``dit_families``.
"""

# FLUX.1-dev, 28 steps (MagCache4FLUX; the same array in ComfyUI-MagCache and in diffusers' MagCache). MagCache's
# threshold for it: 0.24.
FLUX1_DEV = (
    1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344, 0.98047, 1.01562,
    1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047, 0.98828, 0.96484, 0.95703, 0.93359,
    0.89062,
)  # fmt: skip

# Qwen-Image, 50 steps, the conditional call (MagCache4QwenImage, which pads the list with [1.0, 1.0] for step 0).
# ComfyUI-MagCache's threshold for it: 0.10.
QWEN_IMAGE = (
    1.0, 1.64062, 1.45312, 1.1875, 1.17188, 1.05469, 1.21094, 1.10938, 1.11719, 1.13281, 1.11719, 1.07812, 1.07031,
    1.08594, 1.08594, 1.07812, 1.03906, 1.04688, 1.07812, 1.07031, 1.03125, 1.07812, 1.04688, 1.04688, 1.04688,
    1.03906, 1.01562, 1.03125, 1.02344, 1.02344, 1.02344, 1.03906, 1.0, 1.01562, 1.0, 0.99219, 1.00781, 0.98047,
    0.95703, 0.96875, 0.99219, 0.92578, 0.92578, 0.90625, 0.85938, 0.80469, 0.87891, 0.75, 0.60938, 0.55078,
)  # fmt: skip

# HunyuanVideo (1.0) at 720p, 50 steps (MagCache4HunyuanVideo; ComfyUI-MagCache's hunyuan_video). Threshold 0.24.
HUNYUAN_VIDEO = (
    1.0, 1.0754, 1.27807, 1.11596, 1.09504, 1.05188, 1.00844, 1.05779, 1.00657, 1.04142, 1.03101, 1.00679, 1.02556,
    1.00908, 1.06949, 1.05438, 1.02214, 1.02321, 1.03019, 1.00779, 1.03381, 1.01886, 1.01161, 1.02968, 1.00544,
    1.02822, 1.00689, 1.02119, 1.0105, 1.01044, 1.01572, 1.02972, 1.0094, 1.02368, 1.0226, 0.98965, 1.01588,
    1.02146, 1.0018, 1.01687, 0.99436, 1.00283, 1.01139, 0.97122, 0.98251, 0.94513, 0.97656, 0.90943, 0.85703,
    0.75456,
)  # fmt: skip

# Wan 2.1 T2V 14B, 50 steps, the conditional call (MagCache4Wan2.1; ComfyUI-MagCache's wan2.1_t2v_14B).
# Threshold 0.24.
WAN21_T2V_14B = (
    1.0, 1.02504, 1.00025, 0.9985, 0.99779, 0.9966, 0.99482, 0.99467, 0.99664, 0.99434, 0.99533, 0.99468, 0.99438,
    0.99516, 0.99384, 0.99404, 0.99517, 0.99409, 0.99428, 0.99347, 0.99418, 0.99271, 0.99313, 0.99215, 0.99218,
    0.99216, 0.99163, 0.99138, 0.98982, 0.98996, 0.9887, 0.98772, 0.98767, 0.98573, 0.98501, 0.9838, 0.98177,
    0.98037, 0.97678, 0.97546, 0.97184, 0.96711, 0.96349, 0.95629, 0.94926, 0.93964, 0.92511, 0.90693, 0.8796,
    0.86111,
)  # fmt: skip
