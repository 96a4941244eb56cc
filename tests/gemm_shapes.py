"""One table of GEMM problem shapes (M, N, K) for every GEMM test: the emulation on the CPU, the
CUTLASS kernels' can_implement on the host (no GPU), and the kernels themselves on a GPU. Each
shape is accepted by all three or by none; none here is rejected."""

GEMM_SHAPES = [
    (1, 256, 512),
    (17, 72, 200),
    (17, 1000, 1040),
    (256, 384, 1000),
    (4095, 4096, 4096),
    # N not a multiple of 16 bytes of output (padded for TMA, cropped after), K = 16, N = 8
    (1, 17, 16),
    (1, 8, 16),
    (7, 1001, 48),
    (3, 50257, 64),
    (2048, 2049, 272),  # enough 128x128 tiles for the large-shape kernels
]

BLOCKWISE_SHAPES = [(1, 256, 512), (17, 200, 300), (130, 1000, 1040), (4095, 2048, 4096),
                    (17, 1001, 300), (5, 50257, 128), (1, 17, 16)]

# Shapes only the host can_implement test visits (too large to run in every GPU test): the
# linear layers of the demo and of common LLMs, with M the tokens of a batch.
HOST_ONLY_SHAPES = [(8192, 50257, 768), (8192, 768, 50257), (50257, 768, 8192), (1, 1, 1),
                    (3, 5, 7), (16384, 7168, 8192), (8192, 1280, 16384)]
