"""C kernels for the CPU and their build code (`build.py`): decode attention (`decode.py`,
`decode_attention.c`), RMSNorm / SiLU-and-mul / RoPE (`elementwise.py`, `elementwise.c`), shared SIMD
helpers (`simd.h`). Each is compiled with the system C compiler at first use; see `build.py`."""
